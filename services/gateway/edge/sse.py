"""Server-Sent Events responses whose every write has a deadline.

A client that stops reading (a stalled proxy, a laptop closed mid-stream) fills the socket's buffers; from then
on each write waits for it, and without a deadline the request would hold its sequence slot, its handle and its
whole output for as long as TCP keeps the connection. Past CONVEYOR_SSE_WRITE_TIMEOUT_S of one write waiting, the
client is dropped: the stream's generator is closed (its `finally` cancels the request and releases the handle,
as for a client that disconnected) and the connection is closed by the server.
"""

from __future__ import annotations

import asyncio
import json
import logging

from starlette.responses import StreamingResponse
from starlette.types import Message, Send

logger = logging.getLogger(__name__)


class _TooSlow(Exception):
    pass


class SseResponse(StreamingResponse):
    def __init__(self, content, write_timeout_s: float, headers: dict | None = None):
        super().__init__(_comments_joined(content), media_type="text/event-stream", headers=headers)
        self.write_timeout_s = write_timeout_s

    async def stream_response(self, send: Send) -> None:
        async def timed(message: Message) -> None:
            try:
                async with asyncio.timeout(self.write_timeout_s):
                    await send(message)
            except TimeoutError:
                raise _TooSlow from None

        try:
            await super().stream_response(timed)
        except _TooSlow:
            logger.warning(
                "an SSE client read nothing for %.0f s: dropping it (request %s)",
                self.write_timeout_s,
                dict(self.raw_headers).get(b"x-request-id", b"-").decode(),
            )
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                await close()  # its finally cancels the request and releases everything it held


async def _comments_joined(events):
    """The events, each SSE comment (": ...", the queue time that opens a stream) joined to the event after it in
    one write: vLLM's benchmark client strips each read it gets, so a comment read alone lost its blank line and
    every later event was joined to it (its whole stream read as one comment, the request counted failed)."""
    held = b""
    try:
        async for event in events:
            if event.startswith(b":"):
                held += event
                continue
            yield held + event
            held = b""
        if held:
            yield held
    finally:  # closed (a client too slow, gone): the stream's own finally cancels the request and releases it
        close = getattr(events, "aclose", None)
        if close is not None:
            await close()


def sse(data: dict | str) -> bytes:
    """One light SSE event (a heavy one goes through text.render.sse_events, which writes the same bytes)."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n".encode()
