"""The gateway's per-request handle: waiting for output never swallows a cancellation."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.gateway.session.handle import RequestHandle
from services.gateway.text.stop_strings import TextStream
from shared.wire.events import TokenDelta
from tests.support.factories import completed


def test_cancel_landing_as_output_arrives_still_cancels_and_keeps_the_output_queued(tokenizer):
    """Python 3.11's asyncio.wait_for returns the result instead of raising when a cancel and the
    result land together (gh-86296): a request handler cancelled at shutdown would run on."""

    async def main():
        handle = RequestHandle("r", "reply", TextStream(tokenizer), time.time() + 60, time.perf_counter())
        waiting = asyncio.create_task(handle.next_chunk(10.0))
        await asyncio.sleep(0)  # it now waits on the queue
        handle.deliver(TokenDelta("r", 0, (42,)))  # the output arrives ...
        waiting.cancel()  # ... in the same loop iteration as the cancel
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert handle.queue.qsize() == 1, "the delta stays queued for the next reader"

    asyncio.run(main())


def test_nothing_arriving_within_the_timeout_gives_none(tokenizer):
    async def main():
        handle = RequestHandle("r", "reply", TextStream(tokenizer), time.time() + 60, time.perf_counter())
        assert await handle.next_chunk(0.05) is None
        handle.deliver(TokenDelta("r", 0, (42,)))
        chunk = await handle.next_chunk(0.05)
        assert chunk is not None and chunk.token_ids == [42] and chunk.index == 0

    asyncio.run(main())


def test_deltas_queued_together_come_out_as_one_chunk_then_the_end(tokenizer):
    """A client (or gateway) that fell behind gets the tokens waiting for it in one SSE event, not one each."""

    async def main():
        handle = RequestHandle("r", "reply", TextStream(tokenizer), time.time() + 60, time.perf_counter())
        for i, token in enumerate((42, 43, 44)):
            handle.deliver(TokenDelta("r", i, (token,)))
        handle.deliver(completed("r", "length", prompt_tokens=1, output_tokens=3, worker_id="w"))
        chunk = await handle.next_chunk(0.05)
        assert (chunk.token_ids, chunk.index, chunk.end) == ([42, 43, 44], 0, None)
        assert chunk.text == tokenizer.decode([42, 43, 44])
        last = await handle.next_chunk(0.05)
        assert last.end is not None and last.index == 3 and handle.token_ids == [42, 43, 44]

    asyncio.run(main())


def _lp(*values: float):
    """A delta's packed log probabilities: one token per value, each with itself as its one alternative."""
    from shared.wire.logprobs import TokenLogprob, pack

    return pack([TokenLogprob(v, (i,), (v,)) for i, v in enumerate(values)])


def test_logprobs_follow_their_tokens_through_duplicates_and_a_stop_string_cut(tokenizer):
    """A delta seen twice (redelivery, a request moved to another worker) adds its log probabilities once; a stop
    string that completes inside a delta cuts them with the tokens."""
    ids = tokenizer.encode(" alpha beta gamma delta")

    async def main():
        handle = RequestHandle("r", "reply", TextStream(tokenizer, [" gam"]), time.time() + 60, time.perf_counter())
        handle.logprobs = []
        handle.deliver(TokenDelta("r", 0, tuple(ids[:2]), _lp(-0.5, -1.5)))
        handle.deliver(TokenDelta("r", 0, tuple(ids[:2]), _lp(-0.5, -1.5)))  # the same again
        handle.deliver(TokenDelta("r", 1, tuple(ids[1:]), _lp(-1.5, -2.5, -3.5)))  # overlaps by one
        chunk = await handle.next_chunk(0.05)
        assert handle.stop_matched == " gam"
        assert chunk.token_ids == handle.token_ids == ids[:3], "cut at the token that completed the stop string"
        assert [e.logprob for e in chunk.logprobs] == [e.logprob for e in handle.logprobs] == [-0.5, -1.5, -2.5]
        assert chunk.logprobs[2].top_logprobs == (-2.5,)

    asyncio.run(main())


def test_a_request_that_did_not_ask_keeps_no_logprobs(tokenizer):
    async def main():
        handle = RequestHandle("r", "reply", TextStream(tokenizer), time.time() + 60, time.perf_counter())
        handle.deliver(TokenDelta("r", 0, (42, 43), _lp(-1.0, -2.0)))
        chunk = await handle.next_chunk(0.05)
        assert chunk.logprobs is None and handle.logprobs is None

    asyncio.run(main())
