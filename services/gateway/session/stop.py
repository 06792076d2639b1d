"""Ending a request at a stop string: the gateway settles it FINISHED and the worker stops.

Only the gateway sees text, so only it can tell that a stop string completed. It settles the
request FINISHED ("stop_string") and, in the same atomic step, asks the scheduler to stop
the worker, which frees the request's blocks; the worker's own later FINISHED is refused as
already settled. The client's response ends right there, with finish_reason "stop".

FINISHED is allowed from DECODING only. A request the worker preempted (or is moving) after the
step that completed the stop string is left to run on until it decodes again, and is settled
then: cancelling it instead left it CANCELLED in Redis while the client got "stop" and
Prometheus a success (services/gateway/session/outcome.py: one ending, one row, for everyone). Its
tokens after the stop string are never shown; its deadline still bounds the wait.
"""

from __future__ import annotations

import asyncio
import logging

from typing import TYPE_CHECKING

from shared.wire.events import CancelRequested, Completed
from shared.state.lifecycle import Publish, State

if TYPE_CHECKING:
    from services.gateway.session.handle import Chunk, RequestHandle

logger = logging.getLogger(__name__)

# A worker publishes a step's tokens before that step's state changes land (same pipeline, not
# atomic), so the first tokens can arrive while the request still reads PREFILLING.
SETTLE_ATTEMPTS = 5
SETTLE_BACKOFF_S = 0.01


async def finish_at_stop(core, handle: RequestHandle) -> Chunk | None:
    """Settle the request as stopped and return the terminal chunk for the client; None while it cannot be settled
    yet (not decoding): the caller drives it on and calls again with its next output (or gets its ending)."""
    rid = handle.request_id
    if not await _settle(core, handle):
        return None
    prompt_tokens, cached = await _prompt_counts(core, rid)
    end = Completed(
        request_id=rid,
        worker_id="",
        finish_reason="stop",
        prompt_tokens=prompt_tokens,
        output_tokens=len(handle.token_ids),
        cached_tokens=cached,
        num_preemptions=0,
    )
    await core.store.update(
        core.r,
        rid,
        "output",
        {
            "token_ids": handle.token_ids,
            "finish_reason": "stop",
            "stop_string": handle.stop_matched,
            "output_tokens": len(handle.token_ids),
        },
    )
    return handle.finish(end)


async def _settle(core, handle: RequestHandle) -> bool:
    """True once the request is settled (by this FINISHED, or by its own ending just before)."""
    rid = handle.request_id
    stop_worker = [Publish(core.names.control_stream, CancelRequested(request_id=rid, reason="stop_string"))]
    for attempt in range(SETTLE_ATTEMPTS):
        res = await core.lifecycle.atransition(rid, State.FINISHED, "stop_string", stop_worker)
        if res.refused:  # not DECODING yet (or any more): wait for the worker's state change
            await asyncio.sleep(SETTLE_BACKOFF_S * (attempt + 1))
            continue
        if not res.applied:  # it ended on its own meanwhile (length, eos): nothing left to stop
            logger.info(
                "request %s matched a stop string but was already %s",
                rid,
                res.previous.value if res.previous else "gone",
            )
        return True
    logger.info(
        "request %s matched a stop string while not decoding (preempted or moving): settled once it decodes again", rid
    )
    return False


async def _prompt_counts(core, rid: str) -> tuple[int, int]:
    """Prompt tokens (written by the tokenizer) and prefix-cache hits (by the worker)."""
    pipe = core.r.pipeline(transaction=False)
    pipe.hget(core.names.layer(rid, "input"), "prompt_tokens")
    pipe.hget(core.names.layer(rid, "kv"), "cached_tokens")
    prompt, cached = await pipe.execute()
    return int(prompt or 0), int(cached or 0)
