"""The gateway's per-request handle: waiting for output never swallows a cancellation."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.gateway.handle import RequestHandle
from services.gateway.stop_strings import TextStream
from shared.events import Completed, TokenDelta
from shared.tokenization import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return load_tokenizer(model_dir)


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
        handle.deliver(Completed(request_id="r", worker_id="w", finish_reason="length", prompt_tokens=1,
                                 output_tokens=3, cached_tokens=0, num_preemptions=0))
        chunk = await handle.next_chunk(0.05)
        assert (chunk.token_ids, chunk.index, chunk.end) == ([42, 43, 44], 0, None)
        assert chunk.text == tokenizer.decode([42, 43, 44])
        last = await handle.next_chunk(0.05)
        assert last.end is not None and last.index == 3 and handle.token_ids == [42, 43, 44]
    asyncio.run(main())
