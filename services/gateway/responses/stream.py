"""A response streamed: the Responses API's Server-Sent Events, each `event: <type>` with its `sequence_number`.

response.created and response.in_progress, then the output items as the text arrives (output_item.added,
content_part.added, output_text.delta... or a function call's function_call_arguments.delta...), each item closed
at the end (output_text.done, content_part.done / function_call_arguments.done, output_item.done), and last
response.completed (response.incomplete when max_output_tokens cut it) carrying the whole Response, stored first.
As chat completions' stream (openai.stream.start_stream), the answer waits for the first output: a request that
fails before any gets its own HTTP status; one that fails later ends with response.failed.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, AsyncIterator, Awaitable, Callable

from services.gateway.edge.errors import GatewayError, NotFound
from services.gateway.edge.sse import SseResponse
from services.gateway.responses import store
from services.gateway.session.drive import ChoiceRun, first_outcome, started_run

if TYPE_CHECKING:
    from fastapi import Request

    from services.gateway.responses.output import Envelope, OutputBuilder
    from services.gateway.session.core import GatewayCore
    from services.gateway.session.handle import Choices, Chunk

logger = logging.getLogger(__name__)

REPLAY_BLOCK_MS = 1000  # a replay's longest wait for its log before it looks whether the response still runs
Finished = Callable[[dict], Awaitable[None]]  # what to do with the final Response before it is sent (store it)


class Numbered:
    """The events of one stream, numbered from 0 in the order they are sent."""

    def __init__(self) -> None:
        self.next = 0

    def sse(self, event: dict) -> bytes:
        event["sequence_number"] = self.next
        self.next += 1
        return _sse(event)


def _sse(event: dict) -> bytes:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n".encode()


async def start_stream(
    request: Request,
    core: GatewayCore,
    choices: Choices,
    envelope: Envelope,
    out: OutputBuilder,
    finished: Finished,
    headers: dict,
) -> SseResponse:
    """Wait for the first output (or end), then answer with the stream (or raise the request's error)."""
    run, first = await started_run(core, choices, request)
    events = _events(core, run, first[1], envelope, out, finished)
    return SseResponse(events, core.s.sse_write_timeout_s, headers=headers)


async def _events(
    core: GatewayCore, run: ChoiceRun, chunk: Chunk, envelope: Envelope, out: OutputBuilder, finished: Finished
) -> AsyncIterator[bytes]:
    seq = Numbered()
    failed = False
    try:
        for kind in ("response.created", "response.in_progress"):
            yield seq.sse({"type": kind, "response": envelope.response("in_progress", [])})
        while True:
            if chunk.text and (events := out.feed(chunk.text)):  # none while a call's name is still incomplete
                yield b"".join(seq.sse(e) for e in events)
            try:
                body = await first_outcome(core, run, 0, chunk, with_logprobs=False)
                if body is not None:
                    status, reason, closing = out.finish(body["finish_reason"])
                    response = envelope.response(status, out.output, body["usage"], reason)
                    await finished(response)  # stored before the client hears it is complete
            except GatewayError as e:  # after the start: the stream ends with the failure, as OpenAI's does
                failed = True
                failure = envelope.response("failed", out.output) | {"error": {"code": e.code, "message": e.message}}
                yield seq.sse({"type": "response.failed", "response": failure})
                return
            if body is not None:
                yield b"".join(seq.sse(e) for e in closing)
                yield seq.sse({"type": f"response.{status}", "response": response})
                return
            _, chunk = await run.next()
    finally:
        run.close(failed)  # before any await: a cancelled handler's next await raises at once


async def replay(core: GatewayCore, owner: str, response_id: str, after: int) -> AsyncIterator[bytes]:
    """A background response's events from its log, those after sequence_number `after`, until its terminal event;
    followed as they come, from any gateway (one whose driver died is taken over meanwhile, and its log goes on). A
    response ended with no terminal event in its log (cancelled before its task heard of it, settled failed because
    its request was gone) ends the replay with one made from its record."""
    last, seq = "0-0", -1
    try:
        while True:
            entries = await store.read_events(core, owner, response_id, last, REPLAY_BLOCK_MS)
            for entry_id, event in entries:
                last, seq = entry_id, event["sequence_number"]
                if seq > after:
                    yield _sse(event)
                if event["type"] in store.TERMINAL_EVENTS:
                    return
            if entries:
                continue
            stored = await store.get(core, owner, response_id)
            status = stored.response["status"]
            if status in store.RUNNING or await store.read_events(core, owner, response_id, last, None):
                continue  # still running, or its end was logged meanwhile
            yield _sse({"type": store.terminal_event(status), "response": stored.response, "sequence_number": seq + 1})
            return
    except NotFound:  # deleted while followed: nothing more will come
        logger.info("response %s: deleted while its events were followed", response_id)
