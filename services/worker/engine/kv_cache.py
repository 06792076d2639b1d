"""The paged KV pool: one K and one V tensor per engine, shared by all layers.

Shapes: key/value [num_layers, num_blocks, block_size, num_kv_heads, head_dim]. A token's
slot is `block_id * block_size + offset`; its K/V live at `[layer].view(-1, KVH, D)[slot]`.
"""

from __future__ import annotations

import logging

import torch

from services.worker.engine.errors import EngineLoadError

logger = logging.getLogger(__name__)


def kv_geometry(model_config) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) of a transformers decoder config."""
    cfg = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return cfg.num_hidden_layers, kv_heads, head_dim


def bytes_per_block(model_config, block_size: int, dtype: torch.dtype) -> int:
    layers, kv_heads, head_dim = kv_geometry(model_config)
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * layers * block_size * kv_heads * head_dim * itemsize  # 2 = K and V


def num_blocks_for_budget(model_config, block_size: int, dtype: torch.dtype, budget_bytes: int) -> int:
    n = budget_bytes // bytes_per_block(model_config, block_size, dtype)
    if n < 1:
        raise EngineLoadError(f"KV budget of {budget_bytes} bytes holds no block of {block_size} tokens")
    return int(n)


class PagedKVCache:
    def __init__(self, model_config, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device):
        layers, kv_heads, head_dim = kv_geometry(model_config)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = kv_heads
        self.head_dim = head_dim
        shape = (layers, num_blocks, block_size, kv_heads, head_dim)
        # zeros, not empty: padded block-table entries are read (then masked); NaN garbage would
        # poison the softmax through 0 * NaN.
        self.key = torch.zeros(shape, dtype=dtype, device=device)
        self.value = torch.zeros(shape, dtype=dtype, device=device)
        self._flat_key = self.key.view(layers, num_blocks * block_size, kv_heads, head_dim)
        self._flat_value = self.value.view(layers, num_blocks * block_size, kv_heads, head_dim)
        logger.info(
            "KV pool: %d blocks x %d tokens, %d layers, %.1f MiB on %s",
            num_blocks,
            block_size,
            layers,
            2 * self.key.numel() * self.key.element_size() / 2**20,
            device,
        )

    def write(self, layer: int, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """slots [T] long; key/value [T, KVH, D]."""
        self._flat_key[layer].index_copy_(0, slots, key)
        self._flat_value[layer].index_copy_(0, slots, value)

    def layer_slots(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """key, value of one layer as [num_blocks * block_size, KVH, D] (contiguous views, no copy)."""
        return self._flat_key[layer], self._flat_value[layer]

    def gather(self, layer: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """block_tables [G, MB] -> key, value [G, MB * block_size, KVH, D] (one copy per tensor)."""
        g, mb = block_tables.shape
        flat = block_tables.reshape(-1)
        shape = (g, mb * self.block_size, self.num_kv_heads, self.head_dim)
        return self.key[layer].index_select(0, flat).view(shape), self.value[layer].index_select(0, flat).view(shape)
