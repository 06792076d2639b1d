"""Put on vLLM's PYTHONPATH by benchmarks.peer.isa_hold: its CPU platform picks its kernel library (_C with AVX-512 +
BF16, _C_AVX512, _C_AVX2) by asking torch whether the CPU has AVX-512, which reads the CPU, not
ATEN_CPU_CAPABILITY; answering no makes it load _C_AVX2, as it does on an AVX2-only CPU. Only in a process whose
environment asks for it (CONVEYOR_PEER_ISA=avx2), and only there."""

import os
import sys

if os.environ.get("CONVEYOR_PEER_ISA") == "avx2":
    import torch.cpu

    torch.cpu._is_avx512_supported = lambda: False
    torch.cpu._is_avx512_bf16_supported = lambda: False
    sys.stderr.write(f"peer_avx2: process {os.getpid()} told the CPU has no AVX-512\n")
