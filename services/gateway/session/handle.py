"""One in-flight request as the gateway sees it: token deltas in, text chunks out.

Token deltas carry their index in the output, so a delta seen twice (a redelivery, or a
request moved to another worker that recomputed) is dropped, never shown twice.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from shared.wire.events import AnyEvent, PromptLogprobs, TokenDelta
from shared.wire.logprobs import TokenLogprob, unpack

if TYPE_CHECKING:
    from services.gateway.text.stop_strings import TextStream

logger = logging.getLogger(__name__)

_WAKE = object()  # queued by wake(): the waiting reader returns with no chunk, as on a timeout


@dataclass
class Chunk:
    text: str  # newly complete text
    token_ids: list[int]  # new token ids
    index: int  # position of token_ids[0] in the output
    end: AnyEvent | None = None  # the terminal event, on the last chunk
    logprobs: list[TokenLogprob | None] | None = None  # one per token_ids, when the request asked for them
    prompt: PromptLogprobs | None = None  # the prompt's log probabilities, on the chunk they arrived with


@dataclass
class RequestHandle:
    request_id: str
    reply_to: str
    detok: TextStream  # detokenizer + stop strings
    deadline: float  # epoch seconds
    t0: float  # perf_counter at receipt: every client-side interval is measured from it
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    token_ids: list[int] = field(default_factory=list)
    # One per token_ids when the request asked for log probabilities (None: it did not); cut with token_ids.
    logprobs: list[TokenLogprob | None] | None = None
    text: list[str] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)  # perf_counter per delivered delta
    first_token_at: float | None = None
    ended: AnyEvent | None = None
    ended_at: float | None = None
    metrics: dict | None = None  # per-request metrics, computed once the terminal event arrived
    trace: object = None  # its spans (services.gateway.session.tracing.RequestTrace)
    epoch: str | None = None  # Redis dataset it was created in (services fail it if that dataset is lost)
    client_gone: bool = False  # its client closed the connection (set by the handler's disconnect watcher)
    _backlog: deque = field(default_factory=deque)  # taken from the queue, not yet returned as a chunk
    # Order of delivery (a Redis Cluster can skip tokens: services.gateway.session.reconcile): the output index the next
    # delta should start at; what arrived after a gap, held until the gap is filled; whether a fill runs.
    expected: int = 0
    held: list = field(default_factory=list)
    filling: bool = False
    # Wall time of the latest delivery (or of the creation), compared with how far the reply stream has been read
    # (reconcile); whether the request exists in Redis yet (the handle is registered before its creation).
    last_event_at: float = field(default_factory=time.time)
    exists: bool = False
    session: str = ""  # its conversation session's key ("" = none): its turn is ended when it ends (conversation/)
    detached: bool = False  # a background response's: a gateway shutting down leaves it to another (no cancel)
    prompt: PromptLogprobs | None = None  # its prompt log probabilities (prompt_logprobs), once they arrived

    def created(self) -> None:
        """The request was created in Redis: from now on its silence means something."""
        self.exists, self.last_event_at = True, time.time()

    def deliver(self, item: TokenDelta | AnyEvent) -> None:
        self.last_event_at = time.time()
        if self.held or (isinstance(item, TokenDelta) and item.index > self.expected):
            self.held.append(item)  # after a gap: waits until the tokens before it are read (fill_gap)
            return
        if isinstance(item, TokenDelta):
            self.expected = max(self.expected, item.index + len(item.token_ids))
        self.queue.put_nowait(item)

    def hold(self, item: TokenDelta) -> None:
        self.held.append(item)

    def release(self, fill: TokenDelta) -> None:
        """Deliver the tokens that filled the first gap, then what was held, up to the next gap if any."""
        held, self.held = self.held, []
        for item in (fill, *held):
            self.deliver(item)

    def wake(self) -> None:
        """Make a reader waiting in next_chunk return None now (something besides output needs its attention)."""
        self.queue.put_nowait(_WAKE)

    def _accept(self, delta: TokenDelta) -> list[int]:
        have = len(self.token_ids)
        if delta.index > have:
            logger.error("request %s: token gap (have %d, got index %d)", self.request_id, have, delta.index)
        skip = max(0, have - delta.index)
        new = list(delta.token_ids[skip:])
        self.token_ids.extend(new)
        if delta.prompt is not None and self.prompt is None:  # (a recomputing worker sends them again)
            self.prompt = delta.prompt
        if self.logprobs is not None:
            entries = unpack(delta.logprobs) if delta.logprobs is not None else []
            if len(entries) != len(delta.token_ids):  # a worker that does not know them (an older version)
                logger.error(
                    "request %s: %d log probabilities for %d tokens",
                    self.request_id,
                    len(entries),
                    len(delta.token_ids),
                )
                entries = [None] * len(delta.token_ids)
            self.logprobs.extend(entries[skip:])
        return new

    async def next_chunk(self, timeout: float) -> Chunk | None:
        """The next piece of output; None when nothing came within `timeout` seconds. Token deltas already queued
        together come out as one chunk: a client that fell behind (or a gateway under load) then gets them in one
        event and one socket write instead of one each."""
        if not self._backlog:
            try:
                # asyncio.timeout, not wait_for: on Python 3.11 wait_for swallows a cancellation that lands
                # as the item arrives (gh-86296), and a cancelled request's handler would then run on.
                async with asyncio.timeout(max(0.0, timeout)):
                    self._backlog.append(await self.queue.get())
            except TimeoutError:
                return None
        while not self.queue.empty():  # no await from here on: a cancellation cannot lose these
            self._backlog.append(self.queue.get_nowait())
        if _WAKE in self._backlog:
            self._backlog = deque(x for x in self._backlog if x is not _WAKE)
            if not self._backlog:
                return None
        deltas = []
        while self._backlog and isinstance(self._backlog[0], TokenDelta):
            deltas.append(self._backlog.popleft())
        return self._tokens(deltas) if deltas else self.finish(self._backlog.popleft())

    def _tokens(self, deltas: list[TokenDelta]) -> Chunk:
        index, had_prompt = len(self.token_ids), self.prompt is not None
        new = [t for delta in deltas for t in self._accept(delta)]
        prompt = self.prompt if not had_prompt else None
        if not new:
            return Chunk("", [], index, prompt=prompt)
        now = time.perf_counter()
        self.first_token_at = self.first_token_at or now
        self.token_times.append(now)
        text, used = self.detok.push(new)
        if used < len(new):  # a stop string completed inside these deltas: the later tokens are not output
            del self.token_ids[index + used :]
            if self.logprobs is not None:
                del self.logprobs[index + used :]
            new = new[:used]
        self.text.append(text)
        logprobs = None if self.logprobs is None else self.logprobs[index:]
        return Chunk(text, new, index, logprobs=logprobs, prompt=prompt)

    def finish(self, end: AnyEvent) -> Chunk:
        tail = self.detok.flush()
        self.text.append(tail)
        self.ended, self.ended_at = end, time.perf_counter()
        return Chunk(tail, [], len(self.token_ids), end=end)

    @property
    def stop_matched(self) -> str | None:
        """The stop string that ended the output (the request must then be settled by the gateway)."""
        return self.detok.stop_matched

    def remaining(self) -> float:
        return self.deadline - time.time()

    @property
    def full_text(self) -> str:
        return "".join(self.text)


@dataclass
class Choices:
    """The handles of one request's choices, index i = choice i (one, unless the request asked for n > 1 or gave a
    prompt list: then choice j of prompt i is at i * per_prompt + j)."""

    handles: list[RequestHandle]
    per_prompt: int = 0  # choices per prompt (0: all of them are one prompt's)

    @property
    def primary(self) -> RequestHandle:
        return self.handles[0]
