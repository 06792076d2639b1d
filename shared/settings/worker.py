"""The worker's settings (WorkerSettings, exported by shared.settings with the other services'): its engine, its
KV pool and disk tier, its CPU kernels, its speculative decoding and the simulated engine's step times."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from shared.settings import CommonSettings, CpuIsa, omp_environment


class WorkerSettings(CommonSettings):
    device: str = Field("auto", description="auto (cuda when present), cpu or cuda[:N]")
    dtype: str = Field("auto", description="auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16, float16")
    kv_cache_bytes: int = Field(1 << 30, ge=1 << 20, description="KV pool size on CPU, in bytes")
    gpu_memory_fraction: float = Field(0.85, gt=0, le=1, description="share of free CUDA memory for the KV pool")
    max_num_seqs: int = Field(64, ge=1, description="most sequences in one step")
    max_num_batched_tokens: int = Field(512, ge=16, description="token budget of one step")
    enable_prefix_caching: bool = Field(True, description="reuse cached full blocks of a shared prompt prefix")
    drain_timeout_s: float = Field(30.0, ge=0, description="on SIGTERM, time to finish held requests")
    gemm_tuning: bool = Field(
        True,
        description="CPU: measure each layer's fastest GEMM kernel at start (kept in the cache dir); off: a coded "
        "weight runs on its codes up to 32 rows, F.linear beyond",
    )
    cpu_kernels: bool = Field(
        True,
        description="CPU: build (once, kept in the cache dir) and use the "
        "engine's C++ paged decode and prefill attention; off or unbuildable = torch's attention",
    )
    cpu_isa: CpuIsa = Field(
        "auto",
        description="CPU: which build of the C++ kernels runs: auto (the best this CPU has: avx512, "
        "else avx2, else portable) or one forced (one the CPU lacks falls back to auto, with a warning)",
    )
    fused_model: bool = Field(
        True,
        description="Llama-family models run the engine's own forward (fused QKV and gate/up GEMMs, rotary once per "
        "step); off = transformers' module forward",
    )
    huge_pages: bool = Field(
        True,
        description="CPU: move the weights and the KV pool into transparent huge pages once allocated (decode "
        "attention 1.03-1.18x, engine/huge_pages.py); on a VM with free page reporting each 2 MB costs 5-13 ms",
    )
    decode_split_rows: int = Field(
        8,
        ge=0,
        description="CPU: decode-only steps run the layer stack in runs of >= this many sequences a thread; 0 = off",
    )
    omp_spin_count: int = Field(
        30_000,
        ge=0,
        description="CPU: GOMP_SPINCOUNT for the torch threads (how long one spins at a barrier before sleeping), "
        "set before torch loads unless GOMP_SPINCOUNT or OMP_WAIT_POLICY is set; 0 = libgomp's default (300,000)",
    )
    warmup_budget_s: float = Field(
        60.0,
        ge=0,
        description="torch engine: most seconds the start-up warm-up may take, running one step of every prefill and "
        "decode shape bucket before the worker takes work (engine/warmup.py); 0 = the smallest prefill only",
    )
    spec_ngram_tokens: int = Field(
        4,
        ge=0,
        le=16,
        description="speculative decoding of greedy requests: up to this many tokens drafted per step from "
        "n-grams of the sequence's own text (prompt lookup) and checked in the same forward pass; exact, the "
        "output is unchanged (engine/spec.py; 1.15-2.6x faster per token for a single stream in "
        "benchmarks/engine/spec_decode.py); 0 = off",
    )
    spec_ngram_min: int = Field(2, ge=1, description="shortest n-gram a draft is looked up by")
    spec_ngram_max: int = Field(4, ge=1, description="longest n-gram a draft is looked up by")
    spec_max_batch: int = Field(
        4,
        ge=1,
        description="drafts only while at most this many sequences decode (beyond, a CPU step is compute-bound)",
    )
    engine: Literal["torch", "sim"] = Field(
        "torch",
        description="torch runs the model; sim simulates its steps "
        "(same scheduler and KV cache, modelled step time, no weights loaded)",
    )
    # The simulated step time (docs/simulated_engine.md): defaults from the real engine's costs, SmolLM2-135M, float32,
    # on the 2-core CPU machine of docs/benchmarks.md (python -m services.worker.engine.sim.sim_calibrate re-measures them).
    sim_step_overhead_s: float = Field(0.042, ge=0, description="sim: fixed time of every step")
    sim_prefill_s_per_token: float = Field(0.0013, ge=0, description="sim: per uncached prompt token computed")
    sim_decode_s_per_seq: float = Field(0.0015, ge=0, description="sim: per sequence decoding in the step")
    sim_decode_s_per_kv_token: float = Field(0.000008, ge=0, description="sim: per KV token a decode attends over")
    sim_speedup: float = Field(1.0, gt=0, description="sim: every modelled step time is divided by this")
    sim_eos_probability: float = Field(
        0.0,
        ge=0,
        le=1,
        description="sim: chance per output token of ending "
        "with EOS where EOS may end the request (0: run to max_tokens)",
    )
    sim_step_log_dir: str = Field(
        "",
        description="sim: folder where each worker appends one line per step "
        "(its modelled time and shape; benchmarks/scale/control_plane.py reads it); empty = none",
    )
    session_max_blocks: int = Field(
        4096, ge=0, description="most KV blocks a paused session keeps between turns (its leading ones); 0 = none"
    )
    session_idle_ttl_s: float = Field(
        600.0,
        gt=0,
        description="a paused session's KV is released after this long without a turn "
        "(the session goes on: its next turn recomputes the conversation)",
    )
    session_swap: bool = Field(
        True, description="under KV pressure move paused sessions' KV to disk (else it is released)"
    )
    session_swap_dir: str = Field(
        "", description="folder of the disk tier; empty = <cache_dir>/kv-swap/<worker id> (emptied at start)"
    )
    session_swap_max_bytes: int = Field(4 << 30, ge=0, description="most bytes the disk tier holds")
    session_swap_min_tokens: int = Field(
        0, ge=0, description="paused sessions shorter than this are released under pressure, not swapped (docs)"
    )
    first_token_preempt_min_tokens: int = Field(
        16, ge=0, description="a request with no token yet preempts running ones that emitted this many; 0 = never"
    )
    session_prefill_tokens: int = Field(
        256, ge=0, description="while a session's turn waits for its first token, prompt tokens a step computes at most"
    )
    prefill_overshoot_tokens: int = Field(
        32, ge=0, description="a prompt this many (and 1/16 of the room) over a step's room ends in it; 0 = strict"
    )

    def library_environment(self) -> dict[str, str]:
        return omp_environment(self.omp_spin_count)
