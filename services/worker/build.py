"""What a worker builds from its settings: its engine (torch or simulated), and the engine's sampling options of a
request's wire Sampling."""

from __future__ import annotations

from services.worker.engine import Engine, EngineConfig, LLMEngine, SamplingOptions
from services.worker.engine.request import GrammarSpec
from services.worker.engine.sim.sim_model import SimTiming
from services.worker.engine.sim.sim_runner import build_sim_engine
from shared.wire.events import Sampling
from shared.text.model_files import resolve_model_dir
from shared.settings import WorkerSettings


def engine_config(s: WorkerSettings, swap_dir: str = "") -> EngineConfig:
    """swap_dir: the disk tier of paused sessions' KV ("" = none)."""
    return EngineConfig(
        block_size=s.block_size,
        kv_cache_bytes=s.kv_cache_bytes,
        gpu_memory_fraction=s.gpu_memory_fraction,
        max_num_seqs=s.max_num_seqs,
        max_num_batched_tokens=s.max_num_batched_tokens,
        enable_prefix_caching=s.enable_prefix_caching,
        device=s.device,
        dtype=s.dtype,
        gemm_tuning=s.gemm_tuning,
        cpu_kernels=s.cpu_kernels,
        cpu_isa=s.cpu_isa,
        fused_model=s.fused_model,
        huge_pages=s.huge_pages,
        decode_split_rows=s.decode_split_rows,
        tuning_cache_dir=str(s.cache_dir),
        session_max_blocks=s.session_max_blocks,
        session_swap_dir=swap_dir or None,
        session_swap_max_bytes=s.session_swap_max_bytes,
        session_swap_min_tokens=s.session_swap_min_tokens,
        first_token_preempt_min_tokens=s.first_token_preempt_min_tokens,
        session_prefill_tokens=s.session_prefill_tokens,
        prefill_overshoot_tokens=s.prefill_overshoot_tokens,
        spec_ngram_tokens=s.spec_ngram_tokens,
        spec_ngram_min=s.spec_ngram_min,
        spec_ngram_max=s.spec_ngram_max,
        spec_max_batch=s.spec_max_batch,
    )


def build_engine(s: WorkerSettings, swap_dir: str = "") -> Engine:
    """The torch engine, or with CONVEYOR_ENGINE=sim the simulated one (no weights are loaded, torch is not
    imported)."""
    model_dir = resolve_model_dir(s.model, s.cache_dir)
    config = engine_config(s, swap_dir)
    if s.engine == "sim":
        timing = SimTiming(
            s.sim_step_overhead_s,
            s.sim_prefill_s_per_token,
            s.sim_decode_s_per_seq,
            s.sim_decode_s_per_kv_token,
            s.sim_speedup,
        )
        return build_sim_engine(model_dir, config, timing, s.sim_eos_probability, s.sim_step_log_dir)
    return LLMEngine.from_model_dir(model_dir, config)


def sampling_options(s: Sampling) -> SamplingOptions:
    """The engine's options of a wire Sampling: every field but the constraint has the same name on both sides (so a
    sampling field is added to the wire struct and the engine's options, and arrives), the constraint becomes the
    engine's GrammarSpec."""
    same = {f: getattr(s, f) for f in s.__struct_fields__ if f != "constraint"}
    grammar = GrammarSpec(s.constraint.kind, s.constraint.spec) if s.constraint else None
    return SamplingOptions(**same, grammar=grammar)
