"""An SSE comment (the queue time that opens a stream) goes out in one write with the event after it: vLLM's
benchmark client strips every read it gets, so a comment read alone lost its blank line and every later event was
joined to it (the whole stream read as one comment: "Never received a valid chunk", 18 of 64 requests failed)."""

from __future__ import annotations

import asyncio

import pytest

from services.gateway.edge.sse import SseResponse

pytestmark = pytest.mark.unit


async def _events():
    yield b": queue_time=0.250000\n\n"
    yield b'data: {"choices": [{"text": "Hi"}]}\n\n'
    yield b"data: [DONE]\n\n"


def _bodies(response: SseResponse) -> list[bytes]:
    sent: list[bytes] = []

    async def send(message):
        if message["type"] == "http.response.body" and message.get("body"):
            sent.append(message["body"])

    asyncio.run(response.stream_response(send))
    return sent


def test_a_comment_is_written_together_with_the_event_after_it():
    writes = _bodies(SseResponse(_events(), write_timeout_s=5))
    assert writes[0] == b': queue_time=0.250000\n\ndata: {"choices": [{"text": "Hi"}]}\n\n'
    assert writes[1:] == [b"data: [DONE]\n\n"]
