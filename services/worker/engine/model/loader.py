"""Loading a transformers causal LM for the engine and sizing its KV pool."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from services.worker.engine.model.attention import ATTN_IMPLEMENTATION, register_paged_attention
from services.worker.engine.config import EngineConfig
from services.worker.engine.errors import EngineLoadError
from services.worker.engine.kv.kv_cache import bytes_per_block, num_blocks_for_budget

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise EngineLoadError(f"device {name!r} requested but CUDA is not available")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


def load_model(model_dir: Path | str, device: torch.device, dtype: torch.dtype):
    """The model in eval mode on `device`, with the engine's paged attention installed."""
    try:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise EngineLoadError(f"cannot load a causal LM from {model_dir}: {e}") from e
    model.to(device).eval()
    install_paged_attention(model)
    return model


def install_paged_attention(model) -> None:
    register_paged_attention()
    model.set_attn_implementation(ATTN_IMPLEMENTATION)


def eos_token_ids(model_dir: Path | str | None, model) -> frozenset[int]:
    """EOS ids from generation_config.json when present, plus the model config's."""
    ids: set[int] = set()
    candidates = [getattr(model, "generation_config", None), model.config]
    if model_dir is not None:
        try:
            candidates.insert(0, GenerationConfig.from_pretrained(str(model_dir)))
        except OSError:
            logger.info("no generation_config in %s; EOS from the model config", model_dir)
    for cfg in candidates:
        eos = getattr(cfg, "eos_token_id", None)
        if eos is None:
            continue
        ids.update([eos] if isinstance(eos, int) else eos)
    return frozenset(int(i) for i in ids)


def model_context_len(model) -> int:
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return int(getattr(cfg, "max_position_embeddings", 0) or 2048)


def kv_pool_blocks(config: EngineConfig, model, device: torch.device) -> int:
    """Pool size: explicit, else the CPU byte budget, else a share of free CUDA memory."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    dtype = next(model.parameters()).dtype
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        budget = int(free * config.gpu_memory_fraction)
    else:
        budget = config.kv_cache_bytes
    n = num_blocks_for_budget(model.config, config.block_size, dtype, budget)
    logger.info(
        "KV budget %.1f MiB -> %d blocks of %d bytes",
        budget / 2**20,
        n,
        bytes_per_block(model.config, config.block_size, dtype),
    )
    return n


def model_vocab_size(model) -> int:
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return int(cfg.vocab_size)
