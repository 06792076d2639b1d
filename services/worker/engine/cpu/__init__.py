"""The engine's CPU kernels: what the CPU is (cpu_info), the C++ kernels built for it (cpu_ops, csrc/), the GEMM
plans measured on it (gemm, gemm_kernels, gemm_store) and weights read as the codes they are (coded)."""
