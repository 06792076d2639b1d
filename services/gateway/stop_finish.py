"""Ending a request at a stop string: the gateway settles it FINISHED and the worker stops.

Only the gateway sees text, so only it can tell that a stop string completed. It settles the
request FINISHED ("stop_string") and, in the same atomic step, asks the scheduler to stop
the worker, which frees the request's blocks; the worker's own later FINISHED is refused as
already settled. The client's response ends right there, with finish_reason "stop".
"""

from __future__ import annotations

import asyncio
import logging

from services.gateway.handle import Chunk, RequestHandle
from shared.events import CancelRequested, Completed
from shared.lifecycle import Publish, State

logger = logging.getLogger(__name__)

# A worker publishes a step's tokens before that step's state changes land (same pipeline, not
# atomic), so the first tokens can arrive while the request still reads PREFILLING.
SETTLE_ATTEMPTS = 5
SETTLE_BACKOFF_S = 0.01


async def finish_at_stop(core, handle: RequestHandle) -> Chunk:
    """Settle the request as stopped and return the terminal chunk for the client."""
    rid = handle.request_id
    await _settle(core, handle)
    prompt_tokens, cached = await _prompt_counts(core, rid)
    end = Completed(request_id=rid, worker_id="", finish_reason="stop", prompt_tokens=prompt_tokens,
                    output_tokens=len(handle.token_ids), cached_tokens=cached, num_preemptions=0)
    await core.store.update(core.r, rid, "output", {
        "token_ids": handle.token_ids, "finish_reason": "stop", "stop_string": handle.stop_matched,
        "output_tokens": len(handle.token_ids)})
    return handle.finish(end)


async def _settle(core, handle: RequestHandle) -> None:
    rid = handle.request_id
    stop_worker = [Publish(core.names.control_stream, CancelRequested(request_id=rid, reason="stop_string"))]
    for attempt in range(SETTLE_ATTEMPTS):
        res = await core.lifecycle.atransition(rid, State.FINISHED, "stop_string", stop_worker)
        if res.refused:  # not DECODING yet (or any more): wait for the worker's state change
            await asyncio.sleep(SETTLE_BACKOFF_S * (attempt + 1))
            continue
        if not res.applied:  # it ended on its own meanwhile (length, eos): nothing left to stop
            logger.info("request %s matched a stop string but was already %s", rid,
                        res.previous.value if res.previous else "gone")
        return
    # Still not DECODING (preempted, or being moved to another worker): FINISHED is not allowed
    # from there, so stop the work as a cancel; the client still gets its text and "stop".
    logger.info("request %s matched a stop string while not decoding; cancelling the rest", rid)
    await core.cancel(rid, "stop_string", handle.reply_to)


async def _prompt_counts(core, rid: str) -> tuple[int, int]:
    """Prompt tokens (written by the tokenizer) and prefix-cache hits (by the worker)."""
    pipe = core.r.pipeline(transaction=False)
    pipe.hget(core.names.layer(rid, "input"), "prompt_tokens")
    pipe.hget(core.names.layer(rid, "kv"), "cached_tokens")
    prompt, cached = await pipe.execute()
    return int(prompt or 0), int(cached or 0)
