// The one translation unit each ISA variant is built from (cpu_ops.py): the sources compiled together parse
// torch's headers once instead of once each (a variant's build took 45 s of wall and ~75 s of CPU on 2 cores as
// three units, 28 s as one). Each source keeps its helpers in an anonymous namespace of its own names;
// layer_stack.cpp comes last: it calls the kernels of the others.
#include "paged_decode.cpp"
#include "layer_ops.cpp"
#include "sampling.cpp"
#include "prefill_attention.cpp"
#include "gemv.cpp"
#include "panel_gemm.cpp"
#include "coded_gemm.cpp"
#include "coded_recover.cpp"
#include "layer_stack.cpp"
