"""Factories for requests and events used across the tests."""

from __future__ import annotations

import time
import uuid

from shared.wire.events import ChatMessage, Completed, RequestReceived, Sampling


def request_received(reply_to: str = "reply", prompt: str = "Hello", max_tokens: int = 8, **kw) -> RequestReceived:
    now = time.time()
    return RequestReceived(
        request_id=kw.pop("request_id", uuid.uuid4().hex),
        reply_to=reply_to,
        prompt=prompt,
        sampling=Sampling(max_tokens=max_tokens, temperature=0.0),
        deadline=now + 60,
        received_at=now,
        **kw,
    )


def chat_received(messages: list[tuple[str, str]], **kw) -> RequestReceived:
    """A chat request of (role, content) turns, as the gateway publishes it (no raw prompt)."""
    return request_received(prompt=None, messages=tuple(ChatMessage(r, c) for r, c in messages), **kw)


def completed(
    request_id: str = "r", finish_reason: str = "length", prompt_tokens: int = 1, output_tokens: int = 0, worker_id="w"
) -> Completed:
    """A request's ending as its worker publishes it, nothing cached, never preempted."""
    return Completed(
        request_id=request_id,
        worker_id=worker_id,
        finish_reason=finish_reason,
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        cached_tokens=0,
        num_preemptions=0,
    )
