"""A prompt's KV blocks read out of the real model's pool, through the disk tier, and written into other blocks:
the tensors come back equal, and an engine that finds them in its prefix cache continues the prompt exactly as
recomputing it does."""

from __future__ import annotations

import torch
from tests.support.engine import PASSAGE, run_to_completion

from services.worker.engine import EngineRequest, LLMEngine, SamplingOptions
from services.worker.engine.kv.kv_tier import DiskTier, SwappedKV
from shared.wire.block_hash import block_hashes

N = 16
GREEDY = SamplingOptions(temperature=0, max_tokens=N)
SYSTEM = "You are a careful assistant. Use this background text when it helps: " + PASSAGE


def computed_prompt(engine: LLMEngine, prompt: list[int]) -> tuple[list[bytes], list[int]]:
    """Run the prompt (greedy, N tokens) -> (its full blocks' hashes, the blocks of the pool caching them)."""
    engine.add_request(EngineRequest("computed", prompt, GREEDY))
    run_to_completion(engine)
    hashes = list(block_hashes(prompt, engine.blocks.block_size))
    blocks = engine.blocks.lookup_prefix(hashes, len(hashes))
    assert len(blocks) == len(hashes) > 4, "every full prompt block is in the prefix cache"
    return hashes, blocks


def swap_in(engine: LLMEngine, swapped: SwappedKV, write: bool = True) -> list[int]:
    """What a worker does with a session's KV back from the tier: fresh blocks, the K/V written into them, their
    hashes registered, then left to the prefix cache. Blocks are taken from past the pool's first ones, so the ids
    differ from those the KV was read from. write=False registers the hashes over blocks never written (zeros)."""
    filler = engine.blocks.allocate(5)
    blocks = engine.blocks.allocate(len(swapped.block_hashes))
    if write:
        engine.runner.write_blocks(blocks, swapped.payload)
    for b, h in zip(blocks, swapped.block_hashes):
        engine.blocks.register(b, h)
    engine.blocks.release(blocks)
    engine.blocks.release(filler)
    return blocks


def test_blocks_read_and_written_into_other_ids_hold_equal_tensors(make_engine, chat, tmp_path):
    engine = make_engine()
    _, blocks = computed_prompt(engine, chat("Who invented the printing press?", system=SYSTEM))
    targets = engine.blocks.allocate(len(blocks))
    assert not set(targets) & set(blocks)
    with DiskTier(tmp_path / "tier", 1 << 30) as tier:
        assert tier.put("session", [], engine.runner.read_blocks(blocks))
        engine.runner.write_blocks(targets, tier.get("session").payload)
    kv = engine.runner.kv_cache
    assert torch.equal(kv.key[:, targets], kv.key[:, blocks])
    assert torch.equal(kv.value[:, targets], kv.value[:, blocks])
    assert kv.key[:, targets].abs().sum() > 0, "the prompt's K is not all zeros"
    engine.blocks.release(targets)
    engine.check_no_leak()


def test_a_continuation_from_swapped_in_blocks_equals_recomputation(make_engine, chat, hf_reference, tmp_path):
    prompt = chat("How fast could the press print?", system=SYSTEM)
    first = make_engine()
    hashes, blocks = computed_prompt(first, prompt)
    with DiskTier(tmp_path / "tier", 1 << 30) as tier:
        assert tier.put("session", hashes, first.runner.read_blocks(blocks))
        swapped = tier.get("session")
    served = min(len(hashes), (len(prompt) - 1) // 16) * 16  # the block of the last token is always computed
    for write in (True, False):
        engine = make_engine()
        swap_in(engine, swapped, write)
        engine.add_request(EngineRequest("next-turn", prompt, GREEDY))
        runs, _ = run_to_completion(engine)
        assert runs["next-turn"].cached_tokens == served
        if write:
            assert runs["next-turn"].tokens == hf_reference(prompt, N), "swapped-in KV continues as recomputed KV"
        else:  # the control: the same cache hits over blocks never written change the continuation
            assert runs["next-turn"].tokens != hf_reference(prompt, N), "the continuation must read the swapped KV"
        engine.check_no_leak()
