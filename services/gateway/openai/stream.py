"""Shaping one choice's output as OpenAI answers: a JSON body, or chunks over Server-Sent Events.

The request is driven by the same code as /generate (choices.ChoiceRun, responses.final_body); only the shape
differs. openai_serve puts a request's choices together.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence


from services.gateway.session.handle import Chunk
from services.gateway.text import logprobs as lp_shapes
from services.gateway.text.logprobs import CompletionLogprobs, TokenStrings
from services.gateway.openai.tools import ToolShaper, message
from services.gateway.openai.structured_output import OutputPlan
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
    plan: OutputPlan | None = None  # a chat answer's tools and constraint (None: plain text)

    def __post_init__(self) -> None:
        # completions' text_offset runs on across a stream's chunks: one formatter per request
        wanted = self.token_strings is not None and not self.chat
        object.__setattr__(self, "_completion_logprobs", CompletionLogprobs(self.token_strings) if wanted else None)

    @property
    def with_tools(self) -> bool:
        return self.chat and self.plan is not None and self.plan.tool_mode != "none"

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _logprobs(self, token_ids: Sequence[int], entries: Sequence[TokenLogprob | None] | None) -> dict | None:
        if self.token_strings is None or entries is None:
            return None
        if self.chat:
            return lp_shapes.chat_sliced(self.token_strings, token_ids, entries)
        return self._completion_logprobs.sliced(token_ids, entries)

    def body(self, native: dict, logprobs: Sequence[TokenLogprob | None] | None = None) -> dict:
        """The non-stream answer, from the native body (text, token_ids, finish_reason, usage) and the output's
        log probabilities (the handle's, one per token id) when the request asked for them."""
        lp = self._logprobs(native["token_ids"], logprobs)
        if self.with_tools:
            msg, finish = message(self.plan, native["text"], native["finish_reason"])
            choice = {"index": 0, "message": msg, "logprobs": lp, "finish_reason": finish}
        elif self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": native["text"]}, "logprobs": lp,
                      "finish_reason": native["finish_reason"]}
        else:
            choice = {"index": 0, "text": native["text"], "logprobs": lp, "finish_reason": native["finish_reason"]}
        obj = "chat.completion" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [choice], "usage": openai_usage(native["usage"])}

    def chunk(self, text: str | None = None, finish_reason: str | None = None, role: bool = False,
              token_ids: Sequence[int] = (), logprobs: Sequence[TokenLogprob | None] | None = None,
              delta: dict | None = None) -> dict:
        """One stream chunk; logprobs: those of token_ids, the tokens this chunk's text came from; delta: a chat
        delta made elsewhere (a tool call's pieces) instead of the text's."""
        lp = self._logprobs(token_ids, logprobs)
        if self.chat:
            if delta is None:
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


def text_chunks(shape: Shape, tools: ToolShaper | None, chunk: Chunk) -> list[dict]:
    """The stream chunks of one piece of output: its text (or, answering with tools, the tool-call deltas it
    completes) with the log probabilities of its tokens (whose text may still be held back)."""
    if tools is None:
        if not (chunk.text or chunk.logprobs):
            return []
        return [shape.chunk(text=chunk.text, token_ids=chunk.token_ids, logprobs=chunk.logprobs)]
    out = [shape.chunk(delta=delta) for delta in tools.feed(chunk.text)] if chunk.text else []
    if chunk.logprobs:  # on the first of them, or on an empty delta of their own
        lp = shape.chunk(delta={}, token_ids=chunk.token_ids, logprobs=chunk.logprobs)["choices"][0]["logprobs"]
        if out:
            out[0]["choices"][0]["logprobs"] = lp
        else:
            out = [shape.chunk(delta={}, token_ids=chunk.token_ids, logprobs=chunk.logprobs)]
    return out


def end_chunks(shape: Shape, tools: ToolShaper | None, finish: str) -> list[dict]:
    """The last chunk of an output: its finish_reason (tool_calls when it answered with them)."""
    if tools is not None:
        finish = tools.finish_reason(finish)
    return [shape.chunk(finish_reason=finish)]
