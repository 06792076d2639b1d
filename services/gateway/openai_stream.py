"""Shaping one request's output as OpenAI answers: a JSON body, or chunks over Server-Sent Events.

The request is driven by the same code as /generate (responses.drive, final_body); only the
shape differs. A stream starts once the first output (or the end) is known, so a request that
fails before producing anything (prompt too long, timed out in the queue) gets its own HTTP
status instead of a 200 followed by an error event. After that, an error ends the stream with
`data: {"error": {...}}` (the official client raises it), then `data: [DONE]` as always.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import AsyncIterator, Sequence

from fastapi import Request
from fastapi.responses import StreamingResponse

from services.gateway.core import GatewayCore
from services.gateway.errors import GatewayError
from services.gateway.handle import Chunk, RequestHandle
from services.gateway.logprobs import CompletionLogprobs, TokenStrings, chat as chat_logprobs
from services.gateway.responses import drive, final_body, sse
from shared.events import Completed
from shared.logprobs import TokenLogprob

logger = logging.getLogger(__name__)


def openai_usage(usage: dict) -> dict:
    return {"prompt_tokens": usage["prompt_tokens"], "completion_tokens": usage["completion_tokens"],
            "total_tokens": usage["total_tokens"],
            "prompt_tokens_details": {"cached_tokens": usage.get("cached_tokens", 0)}}


@dataclass(frozen=True)
class Shape:
    """How one request's answer looks: completion or chat, its id, time and model."""

    chat: bool
    id: str
    created: int
    model: str
    include_usage: bool = False  # stream_options.include_usage
    token_strings: TokenStrings | None = None  # set when the request asked for log probabilities

    def __post_init__(self) -> None:
        # completions' text_offset runs on across a stream's chunks: one formatter per request
        wanted = self.token_strings is not None and not self.chat
        object.__setattr__(self, "_completion_logprobs", CompletionLogprobs(self.token_strings) if wanted else None)

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _logprobs(self, token_ids: Sequence[int], entries: Sequence[TokenLogprob | None] | None) -> dict | None:
        if self.token_strings is None or entries is None:
            return None
        if self.chat:
            return chat_logprobs(self.token_strings, token_ids, entries)
        return self._completion_logprobs(token_ids, entries)

    def body(self, native: dict, logprobs: Sequence[TokenLogprob | None] | None = None) -> dict:
        """The non-stream answer, from the native body (text, token_ids, finish_reason, usage) and the output's
        log probabilities (the handle's, one per token id) when the request asked for them."""
        lp = self._logprobs(native["token_ids"], logprobs)
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": native["text"]}, "logprobs": lp,
                      "finish_reason": native["finish_reason"]}
        else:
            choice = {"index": 0, "text": native["text"], "logprobs": lp, "finish_reason": native["finish_reason"]}
        obj = "chat.completion" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [choice], "usage": openai_usage(native["usage"])}

    def chunk(self, text: str | None = None, finish_reason: str | None = None, role: bool = False,
              token_ids: Sequence[int] = (), logprobs: Sequence[TokenLogprob | None] | None = None) -> dict:
        """One stream chunk; logprobs: those of token_ids, the tokens this chunk's text came from."""
        lp = self._logprobs(token_ids, logprobs)
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}
            out = {**self._head("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": lp, "finish_reason": finish_reason}
            out = {**self._head("text_completion"), "choices": [choice]}
        if self.include_usage:
            out["usage"] = None  # as OpenAI: every chunk but the last carries "usage": null
        return out

    def usage_chunk(self, usage: dict) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [], "usage": openai_usage(usage)}


async def start_stream(request: Request, core: GatewayCore, handle: RequestHandle, shape: Shape,
                       headers: dict) -> StreamingResponse:
    """Wait for the first output or the end, then answer with an SSE stream (or raise the error)."""
    chunks = drive(core, handle, request)
    try:
        first = await chunks.__anext__()
        if first.end is not None and not isinstance(first.end, Completed):
            await final_body(core, handle, with_logprobs=False)  # raises the GatewayError this ending calls for
    except BaseException:
        _close(core, handle)
        await chunks.aclose()
        raise
    return StreamingResponse(_events(core, handle, shape, first, chunks), media_type="text/event-stream",
                             headers=headers)


async def _events(core: GatewayCore, handle: RequestHandle, shape: Shape, first: Chunk,
                  rest: AsyncIterator[Chunk]) -> AsyncIterator[bytes]:
    try:
        if shape.chat:
            yield sse(shape.chunk(role=True))
        chunk = first
        while True:
            if chunk.text or chunk.logprobs:  # tokens whose text is held back still bring their log probabilities
                yield sse(shape.chunk(text=chunk.text, token_ids=chunk.token_ids, logprobs=chunk.logprobs))
            if chunk.end is not None:
                break
            chunk = await rest.__anext__()
        try:
            body = await final_body(core, handle, with_logprobs=False)
        except GatewayError as e:
            yield sse(e.body())
        else:
            yield sse(shape.chunk(finish_reason=body["finish_reason"]))
            if shape.include_usage:
                yield sse(shape.usage_chunk(body["usage"]))
        yield sse("[DONE]")
    finally:
        _close(core, handle)  # before any await: a cancelled handler's next await raises at once
        await rest.aclose()


def _close(core: GatewayCore, handle: RequestHandle) -> None:
    if handle.ended is None:  # the client went away before the end: stop the work (in a task of its own)
        core.abandon(handle, "client_disconnect")
    core.release(handle)
