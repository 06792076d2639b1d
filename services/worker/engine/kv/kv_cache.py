"""The paged KV pool: one K and one V tensor per engine, shared by all layers.

Shapes: key/value [num_layers, num_blocks, block_size, num_kv_heads, head_dim]. A token's
slot is `block_id * block_size + offset`; its K/V live at `[layer].view(-1, KVH, D)[slot]`.

Blocks leave and re-enter the pool whole (read_blocks / write_blocks: a paused session's KV swapped to the disk
tier, kv_tier.py) as one CPU buffer of raw bytes laid out [K | V][layer][block][token][head][dim] in the pool's
dtype: numpy has no bfloat16, so every dtype travels as uint8 and is viewed back on the way in.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from collections.abc import Sequence as Seq

import numpy as np
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
        self._staging: torch.Tensor | None = None  # read_slabs' slab buffer (and its CPU copy on a device)
        self._host: torch.Tensor | None = None
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

    def slots(self) -> tuple[torch.Tensor, torch.Tensor]:
        """key, value of all layers as [layers, num_blocks * block_size, KVH, D] (views, no copy)."""
        return self._flat_key, self._flat_value

    def layer_slots(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """key, value of one layer as [num_blocks * block_size, KVH, D] (contiguous views, no copy)."""
        return self._flat_key[layer], self._flat_value[layer]

    def gather(self, layer: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """block_tables [G, MB] -> key, value [G, MB * block_size, KVH, D] (one copy per tensor)."""
        g, mb = block_tables.shape
        flat = block_tables.reshape(-1)
        shape = (g, mb * self.block_size, self.num_kv_heads, self.head_dim)
        return self.key[layer].index_select(0, flat).view(shape), self.value[layer].index_select(0, flat).view(shape)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block's K and V over all layers (read_blocks' payload per block)."""
        return 2 * self.key[:, 0].numel() * self.key.element_size()

    def _block_index(self, block_ids: Seq[int]) -> torch.Tensor:
        bad = [b for b in block_ids if not 0 <= b < self.num_blocks]
        if bad:
            raise ValueError(f"block ids outside [0, {self.num_blocks}): {bad[:20]}")
        return torch.tensor(list(block_ids), dtype=torch.long, device=self.key.device)

    @torch.inference_mode()
    def read_blocks(self, block_ids: Seq[int]) -> np.ndarray:
        """K and V of the blocks, all layers, as one contiguous uint8 CPU array of len(block_ids) * block_bytes
        (layout in the module docstring): read_slabs' slabs, copied one after the other."""
        out = np.empty(len(block_ids) * self.block_bytes, dtype=np.uint8)
        at = 0
        for slab in self.read_slabs(block_ids):
            out[at : at + slab.nbytes] = slab
            at += slab.nbytes
        return out

    def read_slabs(self, block_ids: Seq[int]) -> Iterator[memoryview]:
        """read_blocks' payload in its order, one slab at a time (one layer's K, or V, of all the blocks), each
        gathered into a staging buffer the pool keeps and reuses for every slab: a slab is valid until the next
        is taken. Why: a swap-out that gathered a conversation's ~100 MB into a fresh array page-faulted every page
        of it (44 ms for 84 MB, against 12 ms for the scatter back into the pool: docs/benchmarks.md); one
        layer's slab (~1.4 MB at 1,900 tokens of SmolLM2) is written to the tier while it is still in the cache.
        ValueError for ids outside the pool (raised here, before any slab is taken)."""
        idx = self._block_index(block_ids)
        layers, _, bs, kvh, d = self.key.shape
        n = len(block_ids) * bs * kvh * d
        if self._staging is None or self._staging.numel() < n:
            self._staging = torch.empty(n, dtype=self.key.dtype, device=self.key.device)
            self._host = self._staging if self.key.device.type == "cpu" else torch.empty(n, dtype=self.key.dtype)
        slab = self._staging[:n].view(len(block_ids), bs, kvh, d)
        host = self._host[:n]
        return self._slabs(idx, slab, host, layers)

    @torch.inference_mode()
    def _slabs(self, idx: torch.Tensor, slab: torch.Tensor, host: torch.Tensor, layers: int) -> Iterator[memoryview]:
        for pool in (self.key, self.value):
            for layer in range(layers):
                torch.index_select(pool[layer], 0, idx, out=slab)
                if host.data_ptr() != slab.data_ptr():
                    host.copy_(slab.view(-1))  # one transfer from a device
                yield memoryview(host.view(torch.uint8).numpy())

    @torch.inference_mode()
    def write_blocks(self, block_ids: Seq[int], payload) -> None:
        """The inverse of read_blocks, into these (possibly other) blocks. payload: bytes, memoryview or numpy
        array of exactly len(block_ids) * block_bytes bytes, else ValueError (nothing written)."""
        data = _as_uint8(payload)
        if data.nbytes != len(block_ids) * self.block_bytes:
            raise ValueError(
                f"payload of {data.nbytes} bytes for {len(block_ids)} blocks of {self.block_bytes} bytes each"
            )
        if len(set(block_ids)) != len(block_ids):
            raise ValueError("write_blocks: a block id appears twice")  # index_copy_ would keep either one
        idx = self._block_index(block_ids)
        layers, _, bs, kvh, d = self.key.shape
        src = torch.from_numpy(data).view(self.key.dtype).view(2, layers, len(block_ids), bs, kvh, d)
        src = src.to(self.key.device)  # a no-op on CPU; one transfer to a device
        self.key.index_copy_(1, idx, src[0])
        self.value.index_copy_(1, idx, src[1])


def _as_uint8(payload) -> np.ndarray:
    """A writable, aligned flat uint8 view of payload. Read-only buffers (bytes, a read-only mapping) are copied
    once: torch.from_numpy warns on them, and writes through the view would be undefined (none are made here, but
    the warning cannot be scoped to this call without touching the global warning filters)."""
    data = payload.reshape(-1).view(np.uint8) if isinstance(payload, np.ndarray) else np.frombuffer(payload, np.uint8)
    if not data.flags.writeable or not data.flags.c_contiguous or data.ctypes.data % 16:
        data = np.array(data, dtype=np.uint8, copy=True)
    return data
