"""Paged attention, registered as a transformers attention implementation.

transformers' own Llama-family modules compute q/k/v and rotary embeddings; this function
replaces only the attention product. One step's tokens are packed as a [1, T] batch:
decode-format tokens first (one query per sequence), then prefill chunks. The step's
metadata (slot mapping, block tables, masks) is built once by the model runner and reaches
every layer through the `conveyor_attn` keyword of `model(...)`.

GQA without copies: the H = KVH * G query heads are regrouped as [KVH, G * Q] query rows per
KV head, so K/V are gathered once per layer and never repeated.

Decode rows on CPU skip the gather: the engine's own kernel (csrc/paged_decode.cpp, loaded
by cpu_ops.py) reads each sequence's K/V where it lies in the pool. The runner decides per step by
giving the decode group `context_lens` (kernel) or a mask (gather + SDPA, every other case). Prefill
rows likewise: a group with `spans` goes through csrc/prefill_attention.cpp (register-tiled products,
2.4-3.5x torch's CPU flash kernel at head dim 64 on AVX-512), else through torch's kernels below.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from services.worker.engine.cpu import cpu_ops
from services.worker.engine.kv.kv_cache import PagedKVCache

ATTN_IMPLEMENTATION = "conveyor_paged"


@dataclass
class AttnGroup:
    """Sequences attended together with one gather and one SDPA call per layer."""

    block_tables: torch.Tensor  # [S, MB] long, padded with block 0 (masked)
    # [S, 1, R, MB * block_size] bool, True = may attend (R = 1 or G * Q rows); None: built from row_pos at its
    # first use (mask_for), so a step whose layers never need it (decode kernel, causal or two-pass chunks) skips it
    mask: torch.Tensor | None
    row_pos: torch.Tensor | None  # [S, R] position of each query row (masks; None for a kernel prefill group)
    q_index: torch.Tensor | None = None  # [S, Q] rows of the group's packed tokens (prefill only)
    out_index: torch.Tensor | None = None  # [n] flat rows of [S * Q] that are real tokens (prefill only)
    context_lens: torch.Tensor | None = None  # [S] long: set = decode through the CPU kernel (no mask)
    causal: bool = False  # prefill chunks that all start at position 0: each attends to itself only
    num_rows: int = 0  # packed tokens of the group (prefill only)
    starts: tuple[int, ...] = ()  # per sequence: its cached context (the chunk's first position), prefill only
    lens: tuple[int, ...] = ()  # per sequence: the chunk's tokens, prefill only
    num_keys: int = 0  # MB * block_size: the keys a gathered row holds (to build the mask from row_pos)
    spans: torch.Tensor | None = None  # [S, 2] long (start, len): set = prefill through the CPU kernel (no mask)
    _windowed: dict[int, torch.Tensor] = field(default_factory=dict)

    def mask_for(self, window: int | None) -> torch.Tensor:
        """The causal mask, narrowed to the last `window` keys for sliding-window layers."""
        if self.mask is None:  # key j is visible to a query row at position p iff j <= p (padding lies beyond)
            keys = torch.arange(self.num_keys, device=self.row_pos.device)
            self.mask = (keys[None, None, :] <= self.row_pos[:, :, None]).unsqueeze(1)
        if not window:
            return self.mask
        if window not in self._windowed:
            keys = torch.arange(self.mask.shape[-1], device=self.mask.device)
            recent = keys[None, None, :] > self.row_pos[:, :, None] - window  # HF: kv_idx > q_idx - window
            self._windowed[window] = self.mask & recent.unsqueeze(1)
        return self._windowed[window]


@dataclass
class PagedAttentionMetadata:
    kv_cache: PagedKVCache
    slot_mapping: torch.Tensor  # [T] long: where each packed token's K/V is written
    num_decode_tokens: int  # packed rows [0, num_decode_tokens) are one-query sequences
    decode: AttnGroup | None
    # Then each prefill group's rows in turn: the chunks starting at position 0 (attending within themselves,
    # no gather), then those with cached context (gather + mask); apart, so that one chunk with context does not
    # send every chunk of the step through the slow path, padded to the longest.
    prefills: tuple[AttnGroup, ...] = ()


def _attend(
    q: torch.Tensor, group: AttnGroup, cache: PagedKVCache, layer: int, scaling: float, window: int | None
) -> torch.Tensor:
    """q [S, Q, H, D] -> [S, Q, H, D] attending to each sequence's cached K/V."""
    s, qlen, heads, dim = q.shape
    kvh = cache.num_kv_heads
    groups = heads // kvh
    # [S, Q, KVH, G, D] -> [S, KVH, G, Q, D] -> [S, KVH, G*Q, D]
    q = q.view(s, qlen, kvh, groups, dim).permute(0, 2, 3, 1, 4).reshape(s, kvh, groups * qlen, dim)
    k, v = cache.gather(layer, group.block_tables)  # [S, L, KVH, D]
    out = F.scaled_dot_product_attention(
        q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=group.mask_for(window), scale=scaling
    )
    return out.view(s, kvh, groups, qlen, dim).permute(0, 3, 1, 2, 4).reshape(s, qlen, heads, dim)


def _attend_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> torch.Tensor:
    """Chunks without cached context: q [S, Q, H, D], k/v [S, Q, KVH, D] (the chunk's own) -> [S, Q, H, D].
    Why not _attend: no gather from the pool, and with is_causal (no explicit mask) SDPA skips the upper
    half of the product (a 512-token prefill's attention: 4.2 -> 2.9 ms a layer on the 2-core VM).
    Pad rows repeat a real row's q/k/v; a real row i only sees keys <= i, all real."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=scaling, enable_gqa=True
    )
    return out.transpose(1, 2)


def _kernel(
    q: torch.Tensor, group: AttnGroup, cache: PagedKVCache, layer: int, scaling: float, window: int | None
) -> torch.Tensor:
    """q [N, H, D] -> [N, H, D] through the engine's CPU kernel for the group, reading the layer's K/V in place
    from the pool; float32 arithmetic whatever the pool's dtype (like SDPA's on CPU for 16-bit inputs). Decode
    groups (context_lens): csrc/paged_decode.cpp, one query per sequence. Prefill groups (spans):
    csrc/prefill_attention.cpp, each sequence's rows causal over its keys (chunks with or without cached
    context, drafted decode rows, windows)."""
    qf = q.to(torch.float32).contiguous()
    out = torch.empty_like(qf)
    key, value = cache.layer_slots(layer)
    if group.context_lens is not None:
        op, lens = cpu_ops.ops().paged_decode, group.context_lens
    else:
        op, lens = cpu_ops.ops().prefill_attention, group.spans
    op(out, qf, key, value, group.block_tables, lens, cache.block_size, scaling, window or 0)
    return out.to(q.dtype)


_flash = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)  # -> (out, logsumexp)


def _attend_chunks_with_context(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: AttnGroup, cache: PagedKVCache, layer: int, scaling: float
) -> torch.Tensor:
    """Chunks that continue a cached context, one sequence at a time: q [N, H, D], k/v [N, KVH, D] (the group's
    packed rows) -> [N, H, D]. Each chunk's attention is split where its keys are: the cached context, which
    every query of the chunk sees whole (one flash pass, no mask), and the chunk itself, causal (a flash pass
    with is_causal, which skips the upper half); the two are merged by their log-sum-exps, which is the same
    softmax over all the keys. Why not _attend: a boolean mask over [G * Q, context + Q] that SDPA converts to
    an additive one at every layer (80 ms of a 1 s step at 1,536 tokens of context) and a product over the
    masked half. CPU only (the flash kernel that returns the log-sum-exp is the CPU one)."""
    heads, dim = q.shape[1], q.shape[2]
    kvh = cache.num_kv_heads
    g = heads // kvh
    outs, row = [], 0
    for i, (start, n) in enumerate(zip(group.starts, group.lens)):
        qi, ki, vi = q[row : row + n], k[row : row + n], v[row : row + n]
        row += n
        blocks = group.block_tables[i : i + 1, : -(-start // cache.block_size)]
        kc, vc = cache.gather(layer, blocks)  # [1, >= start, KVH, D]: the context (the chunk's own come after)
        kc, vc = kc[0, :start].transpose(0, 1).unsqueeze(0), vc[0, :start].transpose(0, 1).unsqueeze(0)
        # the context: [1, KVH, G * n, D] query rows per KV head (G-major), no K/V repeated
        qa = qi.view(n, kvh, g, dim).permute(1, 2, 0, 3).reshape(1, kvh, g * n, dim)
        oa, la = _flash(qa, kc, vc, scale=scaling)
        oa, la = oa.view(kvh, g, n, dim).reshape(heads, n, dim), la.view(kvh, g, n).reshape(heads, n)
        # the chunk itself, causal: [1, H, n, D] with its few K/V rows repeated per query head
        kb = ki.repeat_interleave(g, dim=1).transpose(0, 1).unsqueeze(0)
        vb = vi.repeat_interleave(g, dim=1).transpose(0, 1).unsqueeze(0)
        ob, lb = _flash(qi.transpose(0, 1).unsqueeze(0), kb, vb, is_causal=True, scale=scaling)
        ob, lb = ob[0], lb[0]
        m = torch.maximum(la, lb)
        wa, wb = torch.exp(la - m).unsqueeze(-1), torch.exp(lb - m).unsqueeze(-1)
        outs.append(((oa.float() * wa + ob.float() * wb) / (wa + wb)).to(q.dtype).transpose(0, 1))  # [n, H, D]
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: PagedAttentionMetadata,
    layer: int,
    scaling: float,
    window: int | None,
) -> torch.Tensor:
    """q [T, H, D], k/v [T, KVH, D] (rotary applied) -> [T, H, D]; writes k/v into the pool first."""
    meta.kv_cache.write(layer, meta.slot_mapping, k, v)
    parts = []
    nd = meta.num_decode_tokens
    if meta.decode is not None:
        d = meta.decode
        if d.context_lens is not None:
            parts.append(_kernel(q[:nd], d, meta.kv_cache, layer, scaling, window))
        else:
            parts.append(_attend(q[:nd].unsqueeze(1), d, meta.kv_cache, layer, scaling, window).squeeze(1))
    start = nd
    for p in meta.prefills:
        end = start + p.num_rows
        if p.spans is not None:
            parts.append(_kernel(q[start:end], p, meta.kv_cache, layer, scaling, window))
            start = end
            continue
        if p.starts and not p.causal and not window and _flash is not None and q.device.type == "cpu":
            parts.append(
                _attend_chunks_with_context(q[start:end], k[start:end], v[start:end], p, meta.kv_cache, layer, scaling)
            )
            start = end
            continue
        rows = q[start:end][p.q_index]  # [S, Q, H, D]
        if p.causal and not window:
            out = _attend_causal(rows, k[start:end][p.q_index], v[start:end][p.q_index], scaling)
        else:
            out = _attend(rows, p, meta.kv_cache, layer, scaling, window)
        parts.append(out.reshape(-1, *out.shape[2:])[p.out_index])
        start = end
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def paged_attention_forward(
    module,
    query,
    key,
    value,
    attention_mask,
    scaling=None,
    dropout=0.0,
    sliding_window: int | None = None,
    conveyor_attn: PagedAttentionMetadata | None = None,
    **kwargs,
):
    """transformers' attention interface: query [1, H, T, D], key/value [1, KVH, T, D] -> ([1, T, H, D], None)."""
    if conveyor_attn is None:
        raise RuntimeError("conveyor_paged attention called without step metadata (use the engine's runner)")
    q = query[0].transpose(0, 1)  # [T, H, D]
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    # Mistral/Qwen2-style models pass the window of sliding layers (None on full-attention layers)
    window = sliding_window if sliding_window is not None else getattr(module, "sliding_window", None)
    out = paged_attention(
        q, key[0].transpose(0, 1), value[0].transpose(0, 1), conveyor_attn, module.layer_idx, scale, window
    )
    return out.unsqueeze(0), None


def register_paged_attention() -> None:
    """Idempotent: make `ATTN_IMPLEMENTATION` a valid `attn_implementation` name."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
