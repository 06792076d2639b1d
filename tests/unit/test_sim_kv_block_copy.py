"""Blocks read out of the paged KV pool and written back into other blocks, on the torch pool (a tiny geometry,
every dtype the engine serves) and on the simulator, which moves no K/V but checks what the torch runner checks."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from services.worker.engine.kv.kv_cache import PagedKVCache, bytes_per_block
from services.worker.engine.sim.sim_model import SimTiming
from services.worker.engine.sim.sim_runner import SIM_BLOCK_BYTES, SimRunner

GEOMETRY = SimpleNamespace(
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, hidden_size=32, num_hidden_layers=3
)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def filled_pool(dtype: torch.dtype, num_blocks: int = 10) -> PagedKVCache:
    with torch.inference_mode():
        pool = PagedKVCache(GEOMETRY, num_blocks, 4, dtype, torch.device("cpu"))
        gen = torch.Generator().manual_seed(0)
        pool.key.copy_(torch.randn(pool.key.shape, generator=gen))
        pool.value.copy_(torch.randn(pool.value.shape, generator=gen))
    return pool


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_blocks_written_into_other_ids_equal_the_ones_read(dtype):
    pool = filled_pool(dtype)
    payload = pool.read_blocks([3, 1, 7])
    assert payload.dtype == np.uint8 and payload.nbytes == 3 * pool.block_bytes
    pool.write_blocks([0, 5, 9], payload)
    for src, dst in zip([3, 1, 7], [0, 5, 9]):
        assert torch.equal(pool.key[:, dst], pool.key[:, src]) and torch.equal(pool.value[:, dst], pool.value[:, src])
    assert not torch.equal(pool.key[:, 2], pool.key[:, 3]), "blocks not written keep their contents"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_block_bytes_is_the_pool_sizing_figure(dtype):
    assert filled_pool(dtype).block_bytes == bytes_per_block(GEOMETRY, 4, dtype)


def test_a_read_only_payload_is_accepted():
    pool = filled_pool(torch.bfloat16)
    pool.write_blocks([4], pool.read_blocks([2]).tobytes())
    assert torch.equal(pool.key[:, 4], pool.key[:, 2])


def test_a_read_payload_does_not_follow_later_writes_to_the_pool():
    pool = filled_pool(torch.float32)
    payload = pool.read_blocks([1])
    kept = payload.copy()
    pool.write_blocks([1], pool.read_blocks([2]))
    assert np.array_equal(payload, kept)


@pytest.mark.parametrize(
    "ids, size_in_blocks",
    [([0, 1], 1), ([0], 2), ([0, 10], 2), ([-1], 1), ([2, 2], 2)],
    ids=["short", "long", "beyond-the-pool", "negative", "duplicate"],
)
def test_a_payload_or_ids_that_do_not_match_are_refused_and_nothing_is_written(ids, size_in_blocks):
    pool = filled_pool(torch.float32)
    before = pool.key.clone(), pool.value.clone()
    with pytest.raises(ValueError):
        pool.write_blocks(ids, np.zeros(size_in_blocks * pool.block_bytes, np.uint8))
    assert torch.equal(pool.key, before[0]) and torch.equal(pool.value, before[1])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_slabs_in_order_are_the_payload_of_read_blocks(dtype):
    pool = filled_pool(dtype)
    ids = [7, 2, 5]
    expected = torch.stack([pool.key[:, ids], pool.value[:, ids]]).contiguous().view(torch.uint8).reshape(-1).numpy()
    slabs = [bytes(s) for s in pool.read_slabs(ids)]  # each copied before the next is taken (one buffer)
    assert len(slabs) == 2 * GEOMETRY.num_hidden_layers
    assert b"".join(slabs) == expected.tobytes() == pool.read_blocks(ids).tobytes()


def test_slabs_of_a_smaller_read_after_a_larger_one_hold_only_its_blocks():
    pool = filled_pool(torch.float32)
    list(pool.read_slabs([0, 1, 2, 3]))
    first = next(iter(pool.read_slabs([6])))
    assert first.nbytes == pool.block_bytes // (2 * GEOMETRY.num_hidden_layers)
    assert bytes(first) == pool.key[0, 6].contiguous().view(torch.uint8).numpy().tobytes()


def test_reading_ids_outside_the_pool_is_refused():
    with pytest.raises(ValueError):
        filled_pool(torch.float32).read_blocks([10])
    with pytest.raises(ValueError):  # before a slab is taken: the tier never opens a file for it
        filled_pool(torch.float32).read_slabs([10])


def sim_runner() -> SimRunner:
    return SimRunner(SimTiming(0.0, 0.0, 0.0, 0.0), vocab=None, num_blocks=8, sleep=lambda s: None)


def test_the_simulator_swaps_a_small_zero_payload_per_block():
    runner = sim_runner()
    payload = runner.read_blocks([1, 2, 3])
    assert runner.block_bytes == SIM_BLOCK_BYTES and payload.nbytes == 3 * SIM_BLOCK_BYTES and not payload.any()
    runner.write_blocks([5, 6, 7], payload)


@pytest.mark.parametrize(
    "ids, size", [([0, 1], SIM_BLOCK_BYTES), ([9], SIM_BLOCK_BYTES), ([3, 3], 2 * SIM_BLOCK_BYTES)]
)
def test_the_simulator_refuses_what_the_torch_pool_refuses(ids, size):
    with pytest.raises(ValueError):
        sim_runner().write_blocks(ids, bytes(size))
