"""Prefill chunks that continue a cached context (attention.py): two flash passes merged by their log-sum-exps
give the softmax over all the keys that the masked product gives, per sequence, whatever the chunk's start."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from services.worker.engine.model.attention import AttnGroup, _attend, _attend_chunks_with_context, _flash
from services.worker.engine.kv.kv_cache import PagedKVCache

BS, KVH, G, D = 16, 3, 3, 64
CONFIG = SimpleNamespace(num_hidden_layers=1, num_attention_heads=KVH * G, num_key_value_heads=KVH, head_dim=D)


@pytest.mark.skipif(_flash is None, reason="this torch has no CPU flash attention returning the log-sum-exp")
def test_chunks_with_context_attend_as_the_masked_product_does():
    torch.manual_seed(0)
    cache = PagedKVCache(CONFIG, 64, BS, torch.float32, torch.device("cpu"))
    starts, lens = (37, 160), (21, 5)  # a chunk mid-block, and a few rows (drafts) after a longer context
    tables, qs, ks, vs = [], [], [], []
    for i, (start, n) in enumerate(zip(starts, lens)):
        table = list(range(30 * i, 30 * i + -(-(start + n) // BS)))
        slots = torch.tensor([table[p // BS] * BS + p % BS for p in range(start + n)])
        k, v = torch.randn(start + n, KVH, D), torch.randn(start + n, KVH, D)
        cache.write(0, slots, k, v)  # context and chunk, as paged_attention writes the chunk first
        tables.append(table)
        qs.append(torch.randn(n, KVH * G, D))
        ks.append(k[start:])
        vs.append(v[start:])
    width = max(map(len, tables))
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    group = AttnGroup(bt, None, torch.zeros(0), starts=starts, lens=lens)
    got = _attend_chunks_with_context(torch.cat(qs), torch.cat(ks), torch.cat(vs), group, cache, 0, D**-0.5)
    for i, (start, n) in enumerate(zip(starts, lens)):
        keys = torch.arange(width * BS)
        pos = start + torch.arange(n)
        mask = (keys[None, :] <= pos[:, None]).repeat(G, 1)[None, None]  # [1, 1, G * n, L], rows G-major
        one = AttnGroup(bt[i : i + 1], mask, pos.repeat(G)[None])
        want = _attend(qs[i][None], one, cache, 0, D**-0.5, None)[0]
        row = sum(lens[:i])
        torch.testing.assert_close(got[row : row + n], want, atol=2e-6, rtol=1e-5)
