"""/generate's Server-Sent Events for any n (session.drive.ChoiceRun drives the choices).

n = 1: one event per text delta ({"request_id", "index", "text", "token_ids"}, with "logprobs" when asked for),
then one final event (its finish_reason, usage and metrics, or its error), then [DONE].
n > 1: each choice's deltas and final event as n = 1's with "choice": its index; once every choice ended,
{"request_id", "usage"} for the request (prompt once, completions summed); then [DONE]. A choice that fails ends the
stream with its final event (its error), its siblings cancelled.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, AsyncIterator

from services.gateway.edge.errors import GatewayError
from services.gateway.edge.sse import sse
from services.gateway.session.drive import ChoiceRun, chunk_weight, final_body, merged_usage, prompt_fields
from services.gateway.session.timing import queue_time_comment, queue_wait
from services.gateway.session.outcome import ending
from services.gateway.text import logprobs as lp_shapes
from services.gateway.text.render import sse_events

if TYPE_CHECKING:
    from fastapi import Request

    from services.gateway.session.core import GatewayCore
    from services.gateway.session.handle import Choices, Chunk, RequestHandle


def delta_event(core: GatewayCore, handle: RequestHandle, chunk: Chunk) -> dict:
    """/generate's SSE event of one text delta: its text, token ids and (when asked for) their log probabilities."""
    event = {"request_id": handle.request_id, "index": chunk.index, "text": chunk.text, "token_ids": chunk.token_ids}
    if chunk.logprobs is not None:
        event["logprobs"] = lp_shapes.native_sliced(core.token_strings, chunk.token_ids, chunk.logprobs)
    if chunk.prompt is not None:  # with the first tokens
        event.update(prompt_fields(core, chunk.prompt))
    return event


async def final_event(core: GatewayCore, handle: RequestHandle, chunk: Chunk) -> dict:
    out = {"request_id": handle.request_id, "index": chunk.index, "text": chunk.text, "token_ids": []}
    try:
        body = await final_body(core, handle, with_logprobs=False)
    except GatewayError as e:
        return {**out, "finish_reason": ending(handle.ended).finish_reason, "error": e.body()["error"]}
    return {**out, "finish_reason": body["finish_reason"], "usage": body["usage"], "metrics": body["metrics"]}


def _of(event: dict, index: int, n: int) -> dict:
    """A choice's event: with n > 1 it names its choice."""
    return {**event, "choice": index} if n > 1 else event


async def stream(core: GatewayCore, choices: Choices, request: Request) -> AsyncIterator[bytes]:
    """The request's events as its choices' chunks come (the module's docstring has their order)."""
    run = ChoiceRun(core, choices, request)
    n, finals = len(choices.handles), {}
    failed, started = False, False
    try:
        while len(finals) < n:
            index, chunk = await run.next()
            if not started:  # the stream's first event: its queue wait is known now (headers went out at once)
                started = True
                if comment := queue_time_comment(await queue_wait(core, choices.primary.request_id)):
                    yield comment
            handle = choices.handles[index]
            if chunk.end is None:
                if chunk.token_ids or chunk.text:
                    yield await sse_events(
                        lambda: [_of(delta_event(core, handle, chunk), index, n)], chunk_weight(chunk)
                    )
                continue
            final = _of(await final_event(core, handle, chunk), index, n)
            yield sse(final)
            if "error" in final:  # one outcome for the request: close() cancels the siblings
                failed = True
                break
            finals[index] = final
        if n > 1 and len(finals) == n:
            yield sse(
                {
                    "request_id": choices.primary.request_id,
                    "usage": merged_usage([finals[i] for i in range(n)], choices.per_prompt),
                }
            )
        yield sse("[DONE]")
    finally:
        run.close(failed)  # before any await: a cancelled handler's next await raises at once
