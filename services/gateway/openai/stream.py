"""OpenAI's shapes of a choice's output (Shape: a JSON body, or stream chunks), and the stream of a request's
choices, for any n (session.drive.ChoiceRun drives them, as for /generate; only the shape differs).

A stream answers once the first output of any choice (or the end) is known, so a request whose choices fail before
any output (a prompt too long, timed out in the queue) gets that error's own HTTP status instead of a 200 followed
by an error event. Then each choice's text deltas as they come, interleaved, each chunk naming its choice's
`index`; a choice's finish_reason in a chunk of its own when it ends; the usage chunk
(stream_options.include_usage) once all have ended; [DONE]. An error after the start ends the stream with
`data: {"error": {...}}` (the official client raises it), its siblings cancelled, then `data: [DONE]` as always.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncIterator, Sequence

from services.gateway.edge.errors import GatewayError
from services.gateway.edge.sse import SseResponse, sse
from services.gateway.openai.prompt_facts import PromptFacts
from services.gateway.openai.tools import ToolShaper, message
from services.gateway.session.drive import ChoiceRun, chunk_weight, first_outcome, merged_usage, started_run
from services.gateway.text import logprobs as lp_shapes
from services.gateway.text.logprobs import CompletionLogprobs
from services.gateway.session.timing import queue_time_comment, queue_time_headers, queue_wait
from services.gateway.text.render import sse_events

if TYPE_CHECKING:
    from fastapi import Request

    from services.gateway.openai.structured_output import OutputPlan
    from services.gateway.session.core import GatewayCore
    from services.gateway.session.handle import Choices, Chunk
    from services.gateway.text.logprobs import TokenStrings
    from shared.wire.events import PromptLogprobs
    from shared.wire.logprobs import TokenLogprob

logger = logging.getLogger(__name__)


def openai_usage(usage: dict) -> dict:
    return {
        "prompt_tokens": usage["prompt_tokens"],
        "completion_tokens": usage["completion_tokens"],
        "total_tokens": usage["total_tokens"],
        "prompt_tokens_details": {"cached_tokens": usage.get("cached_tokens", 0)},
    }


@dataclass(frozen=True)
class Echo:
    """A completion's `echo`: its prompt goes before the output (text, and log probabilities when asked for)."""

    prompt: str
    only: bool = False  # max_tokens 0: the prompt alone (the one token generated is dropped, as vLLM)


@dataclass(frozen=True)
class Shape:
    """How one request's answer looks: completion or chat, its id, time and model."""

    chat: bool
    id: str
    created: int
    model: str
    include_usage: bool = False  # stream_options.include_usage
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: every chunk carries the usage so far
    return_token_ids: bool = False  # vLLM's: each choice's token ids (and its prompt's) with its text
    token_strings: TokenStrings | None = None  # set when the request asked for log probabilities
    plan: OutputPlan | None = None  # a chat answer's tools and constraint (None: plain text)
    echo: Echo | None = None  # a completion's echo (None: the output alone)
    chat_echo: str = ""  # chat's echo: the last message's text, which the answer's content starts with

    def __post_init__(self) -> None:
        # completions' text_offset runs on across a stream's chunks: one formatter per request
        wanted = self.token_strings is not None and not self.chat
        object.__setattr__(self, "_completion_logprobs", CompletionLogprobs(self.token_strings) if wanted else None)
        object.__setattr__(self, "_echo_due", self.echo is not None)  # a stream's echo: on its first chunk

    def _echoed(
        self,
        text: str,
        token_ids: Sequence[int],
        entries: Sequence[TokenLogprob | None] | None,
        prompt: PromptLogprobs | None,
    ) -> tuple[str, Sequence[int], Sequence[TokenLogprob | None] | None]:
        """(text, token ids, log probabilities) with the echoed prompt first (a stream: on its first chunk only)."""
        if self.echo is None:
            return text, token_ids, entries
        if self.echo.only:
            text, token_ids, entries = "", [], entries if entries is None else []
        if not self._echo_due:
            return text, token_ids, entries
        object.__setattr__(self, "_echo_due", False)
        if entries is not None and prompt is not None:
            token_ids, entries = [*prompt.token_ids, *token_ids], [*lp_shapes.prompt_entries(prompt), *entries]
        return self.echo.prompt + text, token_ids, entries

    def _prompt_field(self, choice: dict, prompt: PromptLogprobs | None) -> dict:
        if prompt is not None and self.token_strings is not None:
            choice["prompt_logprobs"] = lp_shapes.prompt_vllm(self.token_strings, prompt)
        return choice

    @property
    def echo_due(self) -> bool:
        """Whether a stream's echo is still to be sent (with its next chunk, even an empty one)."""
        return self._echo_due

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

    def body(
        self, native: dict, logprobs: Sequence[TokenLogprob | None] | None = None, prompt: PromptLogprobs | None = None
    ) -> dict:
        """The non-stream answer, from the native body (text, token_ids, finish_reason, usage) and the output's
        log probabilities (the handle's, one per token id) when the request asked for them; prompt: the handle's
        prompt log probabilities (shared.wire.events.PromptLogprobs), when asked for."""
        text, ids, logprobs = self._echoed(native["text"], native["token_ids"], logprobs, prompt)
        native = {**native, "text": text}
        lp = self._logprobs(ids, logprobs)
        if self.with_tools:
            msg, finish = message(self.plan, native["text"], native["finish_reason"])
            choice = {"index": 0, "message": msg, "logprobs": lp, "finish_reason": finish}
        elif self.chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": self.chat_echo + native["text"]},
                "logprobs": lp,
                "finish_reason": native["finish_reason"],
            }
        else:
            choice = {"index": 0, "text": native["text"], "logprobs": lp, "finish_reason": native["finish_reason"]}
        if self.return_token_ids:
            choice["token_ids"] = list(native["token_ids"])
        obj = "chat.completion" if self.chat else "text_completion"
        self._prompt_field(choice, prompt)
        return {**self._head(obj), "choices": [choice], "usage": openai_usage(native["usage"])}

    def chunk(
        self,
        text: str | None = None,
        finish_reason: str | None = None,
        role: bool = False,
        token_ids: Sequence[int] = (),
        logprobs: Sequence[TokenLogprob | None] | None = None,
        delta: dict | None = None,
        prompt: PromptLogprobs | None = None,
    ) -> dict:
        """One stream chunk; logprobs: those of token_ids, the tokens this chunk's text came from; delta: a chat
        delta made elsewhere (a tool call's pieces) instead of the text's; prompt: the prompt log probabilities,
        on the chunk they arrived with."""
        output_ids = token_ids  # return_token_ids: the output's only, an echoed prompt's are not among them
        if not self.chat and finish_reason is None:
            text, token_ids, logprobs = self._echoed(text or "", token_ids, logprobs, prompt)
        lp = self._logprobs(token_ids, logprobs)
        if self.chat:
            if delta is None:
                delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}
            out = {**self._head("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": lp, "finish_reason": finish_reason}
            out = {**self._head("text_completion"), "choices": [choice]}
        if self.return_token_ids and not role:
            choice["token_ids"] = list(output_ids)
        self._prompt_field(out["choices"][0], prompt)
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
        if not (
            chunk.text
            or chunk.logprobs
            or chunk.prompt
            or shape.echo_due
            or (shape.return_token_ids and chunk.token_ids)
        ):
            return []
        return [shape.chunk(text=chunk.text, token_ids=chunk.token_ids, logprobs=chunk.logprobs, prompt=chunk.prompt)]
    out = [shape.chunk(delta=delta) for delta in tools.feed(chunk.text)] if chunk.text else []
    if chunk.logprobs or (shape.return_token_ids and chunk.token_ids):  # on the first of them, or on an empty
        # delta of their own
        own = shape.chunk(delta={}, token_ids=chunk.token_ids, logprobs=chunk.logprobs)["choices"][0]
        if out:
            out[0]["choices"][0]["logprobs"] = own["logprobs"]
            if shape.return_token_ids:
                out[0]["choices"][0]["token_ids"] = own["token_ids"]
                for later in out[1:]:
                    later["choices"][0]["token_ids"] = []
        else:
            out = [shape.chunk(delta={}, token_ids=chunk.token_ids, logprobs=chunk.logprobs)]
    return out


def end_chunks(shape: Shape, tools: ToolShaper | None, finish: str) -> list[dict]:
    """The last chunk of an output: its finish_reason (tool_calls when it answered with them)."""
    if tools is not None:
        finish = tools.finish_reason(finish)
    return [shape.chunk(finish_reason=finish)]


def at_index(out: dict, index: int) -> dict:
    """A one-choice body or chunk built by Shape, for choice `index`."""
    for choice in out["choices"]:
        choice["index"] = index
    return out


async def start_stream(
    request: Request, core: GatewayCore, choices: Choices, shapes: list[Shape], headers: dict
) -> SseResponse:
    """Wait for the first output (or end) of any choice, then answer with the stream (or raise the error)."""
    run, first = await started_run(core, choices, request)
    wait = await queue_wait(core, choices.primary.request_id)
    headers = {**headers, **queue_time_headers(wait)}
    return SseResponse(_events(core, run, shapes, first, wait), core.s.sse_write_timeout_s, headers=headers)


def _opening(shape: Shape, n: int, facts: PromptFacts) -> list[dict]:
    """A chat stream's first chunks: each choice's role chunk (and its echo)."""
    outs = []
    for i in range(n):
        opening = [at_index(shape.chunk(role=True), i)]
        if shape.chat_echo:
            opening.append(at_index(shape.chunk(text=shape.chat_echo), i))
        facts.stamp(opening, i, 0, shape, first=True)
        outs += opening
    return outs


async def _events(
    core: GatewayCore, run: ChoiceRun, shapes: list[Shape], first: tuple[int, Chunk], wait: float | None
) -> AsyncIterator[bytes]:
    n, shape = len(run.choices.handles), shapes[0]
    tools = [ToolShaper(s.plan) if s.with_tools else None for s in shapes]  # each choice's tool call, if any
    bodies: dict[int, dict] = {}
    failed = False
    facts = PromptFacts(core, run.choices, shape.continuous_usage or shape.return_token_ids)
    try:
        if comment := queue_time_comment(wait):
            yield comment
        index, chunk = first
        await facts.learn(index)
        for out in _opening(shape, n, facts) if shape.chat else ():
            yield sse(out)
        while True:
            await facts.learn(index)

            def pieces(index=index, chunk=chunk) -> list[dict]:
                outs = [at_index(out, index) for out in text_chunks(shapes[index], tools[index], chunk)]
                facts.stamp(outs, index, chunk.index + len(chunk.token_ids), shapes[index])
                return outs

            if data := await sse_events(pieces, chunk_weight(chunk)):
                yield data
            try:
                body = await first_outcome(core, run, index, chunk, with_logprobs=False)
            except GatewayError as e:  # one outcome for the request: its siblings are cancelled by close()
                failed = True
                yield sse(e.body())
                break
            if body is not None:
                bodies[index] = body
                ends = [at_index(out, index) for out in end_chunks(shapes[index], tools[index], body["finish_reason"])]
                facts.stamp(ends, index, body["usage"]["completion_tokens"], shapes[index])
                for out in ends:
                    yield sse(out)
                if len(bodies) == n:
                    if shape.include_usage:
                        yield sse(
                            shape.usage_chunk(merged_usage([bodies[i] for i in range(n)], run.choices.per_prompt))
                        )
                    break
            index, chunk = await run.next()
        yield sse("[DONE]")
    finally:
        run.close(failed)  # before any await: a cancelled handler's next await raises at once
