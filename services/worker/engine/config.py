"""EngineConfig: the knobs of one engine instance (validated once, then read-only)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from services.worker.engine.errors import EngineLoadError
from shared.settings import CPU_ISAS

logger = logging.getLogger(__name__)

_DEVICES = ("auto", "cpu", "cuda")
_DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16  # tokens per KV block
    kv_cache_bytes: int = 1 << 30  # KV pool size on CPU
    gpu_memory_fraction: float = 0.85  # share of free CUDA memory (after loading the model) for the pool
    max_num_seqs: int = 64  # most sequences running at once (and in one step)
    max_num_batched_tokens: int = 512  # token budget of one step (decodes + prefill chunks)
    enable_prefix_caching: bool = True
    device: str = "auto"  # auto (cuda when present), cpu, cuda, cuda:N
    dtype: str = "auto"  # auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16, float16
    num_kv_blocks: int | None = None  # overrides the byte budget: exact pool size (tests, tuning)
    max_model_len: int | None = None  # caps the context window below the model's own
    gemm_tuning: bool = True  # CPU: measure each linear layer's fastest GEMM kernel at start (off: unmeasured_plans)
    cpu_kernels: bool = True  # CPU: the engine's C++ paged decode and prefill attention (cpu_ops.py) over torch's
    cpu_isa: str = "auto"  # CPU: which build of those kernels: auto (the best the CPU has) or one of CPU_ISAS
    gemv_kernel: bool = True  # CPU: offer those kernels' GEMV (csrc/gemv.cpp) to the GEMM plans (they measure it)
    layer_stack: bool = True  # CPU: a step's layers in one C++ call (csrc/layer_stack.cpp), not op by op
    # CPU, with layer_stack: a step of decode rows alone in runs of at least this many sequences, one a thread, each
    # through the whole stack single-threaded (csrc/layer_stack.cpp says why); 0: every op split between the threads
    decode_split_rows: int = 8
    huge_pages: bool = True  # CPU: the weights and the KV pool on transparent huge pages (huge_pages.py)
    fused_model: bool = True  # Llama-family models: the engine's own forward (fused_llama.py) over transformers'
    tuning_cache_dir: str | None = None  # where measured GEMM plans are kept across restarts (None: memory only)
    # Conversation sessions (session_kv.py): the most blocks a paused session keeps in the pool (0: none kept),
    # and where a paused session's KV goes under pressure (None: nowhere, it is released), up to how many bytes,
    # for runs of at least how many tokens (shorter ones recompute faster than they swap back).
    session_max_blocks: int = 4096
    session_swap_dir: str | None = None
    session_swap_max_bytes: int = 4 << 30
    session_swap_min_tokens: int = 0
    # First tokens first: a waiting request that has emitted nothing and finds no room may preempt, by parking its
    # KV in the tier, a less or equally important running one that has emitted at least this many tokens since its
    # admission (0: never; a running request is only ever preempted for a more important one's growth).
    first_token_preempt_min_tokens: int = 16
    # While a session's turn waits for its first token, a step computes at most this many prompt tokens (its decodes
    # as ever; 0: the whole max_num_batched_tokens): scheduler.Scheduler._prompt_room says why.
    session_prefill_tokens: int = 256
    # A prompt whose remaining tokens overshoot the step's room by at most this many (and by at most a sixteenth of
    # the room) is finished in that step instead of leaving a tail of a few tokens to a step of its own: the
    # scheduler's _chunk says why. 0: the budget is strict.
    prefill_overshoot_tokens: int = 32
    # Prompt-lookup speculative decoding of greedy requests (ngram.py): up to this many drafted tokens checked per
    # step and sequence (0: off), from n-grams of ngram_min..ngram_max tokens, while at most spec_max_batch
    # sequences decode (beyond, a step is compute-bound on a CPU and a wrong draft costs its rows in full).
    spec_ngram_tokens: int = 0
    spec_ngram_min: int = 2
    spec_ngram_max: int = 4
    spec_max_batch: int = 4

    def __post_init__(self) -> None:
        problems = []
        if self.block_size < 1:
            problems.append(f"block_size must be >= 1, got {self.block_size}")
        if self.kv_cache_bytes < 1:
            problems.append(f"kv_cache_bytes must be >= 1, got {self.kv_cache_bytes}")
        if not 0 < self.gpu_memory_fraction <= 1:
            problems.append(f"gpu_memory_fraction must be in (0, 1], got {self.gpu_memory_fraction}")
        if self.decode_split_rows < 0:
            problems.append(f"decode_split_rows must be >= 0, got {self.decode_split_rows}")
        if self.max_num_seqs < 1:
            problems.append(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.first_token_preempt_min_tokens < 0:
            problems.append(f"first_token_preempt_min_tokens must be >= 0, got {self.first_token_preempt_min_tokens}")
        if self.session_prefill_tokens < 0:
            problems.append(f"session_prefill_tokens must be >= 0, got {self.session_prefill_tokens}")
        if self.prefill_overshoot_tokens < 0:
            problems.append(f"prefill_overshoot_tokens must be >= 0, got {self.prefill_overshoot_tokens}")
        if self.max_num_batched_tokens < 1:
            problems.append(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.device.split(":")[0] not in _DEVICES:
            problems.append(f"device must be one of {_DEVICES} (cuda:N allowed), got {self.device!r}")
        if self.dtype not in _DTYPES:
            problems.append(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.cpu_isa not in ("auto", *CPU_ISAS):
            problems.append(f"cpu_isa must be one of {('auto', *CPU_ISAS)}, got {self.cpu_isa!r}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            problems.append(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.max_model_len is not None and self.max_model_len < 2:
            problems.append(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.spec_ngram_tokens < 0:
            problems.append(f"spec_ngram_tokens must be >= 0, got {self.spec_ngram_tokens}")
        if not 1 <= self.spec_ngram_min <= self.spec_ngram_max:
            problems.append(
                f"spec_ngram_min/max must satisfy 1 <= min <= max, got {self.spec_ngram_min}/{self.spec_ngram_max}"
            )
        if self.spec_max_batch < 1:
            problems.append(f"spec_max_batch must be >= 1, got {self.spec_max_batch}")
        if problems:
            raise EngineLoadError("invalid EngineConfig: " + "; ".join(problems))
        if self.max_num_batched_tokens < self.max_num_seqs:
            logger.warning(
                "max_num_batched_tokens (%d) < max_num_seqs (%d): some running sequences will skip steps",
                self.max_num_batched_tokens,
                self.max_num_seqs,
            )
