"""A request's choices (OpenAI's `n`), driven together: one request of its own per choice, the n tied by a group id.

Every request is driven here, n = 1 as a group of one (created without a group: its context is a plain request's).

Each choice lives a request's whole life: its own id, context, dashboard row, metrics and trace (its spans under the
first choice's root span, so one trace holds the request). The first choice's id is the request's: the response
id, X-Request-Id, and what DELETE /v1/requests/{id} takes; cancelling any choice's id cancels every choice
(`members`). The group id (the first choice's id) travels with each choice: the scheduler places the choices on one
worker (services/scheduler/affinity.py), whose engine computes their prompt once (the other choices wait for its
blocks and reuse them from the prefix cache).

Seeds: choice i samples with seed + i, so a seed gives reproducible choices that differ from each other (choice 0
is what n = 1 gives with that seed). Without a seed each choice draws its own randomness; greedy choices are equal.
Limits: each choice is a waiting request for CONVEYOR_MAX_WAITING_REQUESTS (and the per-key bound): a request whose
choices do not all fit is refused whole (429), the choices already created cancelled; the HTTP request takes one
open-request slot (CONVEYOR_MAX_OPEN_REQUESTS), whatever n.
One outcome: a choice that fails, times out or is cancelled ends its siblings (CANCELLED, reason choice_failed,
unless the client left: client_disconnect) and its error is the answer (a stream that has started ends with it).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator

from fastapi import Request

from services.gateway.session.core import GatewayCore
from services.gateway.edge.errors import GatewayError
from services.gateway.session.handle import Chunk, RequestHandle
from services.gateway.session.intake import accept
from services.gateway.session.drive import drive, final_body, watch_disconnect
from services.gateway.session.request import GenerateRequest

logger = logging.getLogger(__name__)

SEED_SPACE = 2**63  # seeds are 0..2**63-1 (schemas.py): choice i's seed + i wraps within them
SIBLING_FAILED = "choice_failed"  # why a choice is cancelled when a sibling ended the request


@dataclass
class Choices:
    """The handles of one request's choices, index i = choice i."""

    handles: list[RequestHandle]

    @property
    def primary(self) -> RequestHandle:
        return self.handles[0]


def choice_body(body: GenerateRequest, index: int) -> GenerateRequest:
    """Choice `index`'s own request: the same but for its seed."""
    if body.seed is None:
        return body
    return body.model_copy(update={"seed": (body.seed + index) % SEED_SPACE})


async def accept_choices(request: Request, body: GenerateRequest, n: int, default_max_tokens: int | None = None,
                         extra_meta: dict | None = None, **output) -> Choices:
    """Create the n choices, the first first (its trace holds the others'); all or none (raises GatewayError).
    output: intake.accept's constraint and tools, the same for every choice."""
    if n == 1:  # a group of one: no group id, no seed offset
        return Choices([await accept(request, body, default_max_tokens, extra_meta, **output)])
    core: GatewayCore = request.app.state.core
    ids = [uuid.uuid4().hex for _ in range(n)]
    handles: list[RequestHandle] = []
    try:
        for i, rid in enumerate(ids):
            meta = {**(extra_meta or {}), "group_id": ids[0], "choice_index": i, "n": n}
            if i == 0:
                meta["group_members"] = ids  # what a cancel of any choice reads (members)
            tp = handles[0].trace.traceparent if handles else None
            handles.append(await accept(request, choice_body(body, i), default_max_tokens, meta, request_id=rid,
                                        group_id=ids[0], group_size=n, traceparent=tp, **output))
    except BaseException:
        for h in handles:  # refused whole: what was created is cancelled (in tasks: this may be a cancellation)
            core.abandon(h, SIBLING_FAILED)
        raise
    return Choices(handles)


async def members(core: GatewayCore, meta: dict, request_id: str) -> list[str]:
    """Every request id of the request `request_id` belongs to (itself alone unless it is a choice of n > 1)."""
    group = meta.get("group_id")
    if not group:
        return [request_id]
    if group != request_id:
        primary = await core.store.aread(core.r, group)
        meta = primary.layers["meta"] if primary is not None else {}
    ids = meta.get("group_members") or [request_id]
    return ids if request_id in ids else [request_id, *ids]


@dataclass
class ChoiceRun:
    """The choices driven together: one task per choice puts its chunks on one queue, read in arrival order (a
    group of one is read straight from its drive: no task, no queue). One watcher of the client for all
    (receive() answers the disconnect once): it wakes every choice, whose drive loop then cancels it."""

    core: GatewayCore
    choices: Choices
    request: Request
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    tasks: list[asyncio.Task] = field(default_factory=list)
    only: AsyncIterator[Chunk] | None = None  # the drive of a group of one

    def __post_init__(self) -> None:
        handles = self.choices.handles
        if len(handles) == 1:
            self.only = drive(self.core, handles[0], self.request, watch=False)
        else:
            self.tasks = [asyncio.ensure_future(self._pump(i, h)) for i, h in enumerate(handles)]
        self.tasks.append(asyncio.ensure_future(watch_disconnect(self.request, handles)))

    async def _pump(self, index: int, handle: RequestHandle) -> None:
        try:
            async for chunk in drive(self.core, handle, self.request, watch=False):
                self.queue.put_nowait((index, chunk))
        except Exception as e:  # to the reader, who raises it; a cancellation (close) just ends the task
            self.queue.put_nowait((index, e))

    async def next(self) -> tuple[int, Chunk]:
        """The next chunk of any choice, with the choice's index."""
        if self.only is not None:
            return 0, await anext(self.only)
        index, item = await self.queue.get()
        if isinstance(item, Exception):
            raise item
        return index, item

    def close(self, failed: bool) -> None:
        """Stop driving; choices not ended are cancelled (in tasks of their own), every handle released. failed: a
        choice ended the request (else the handler was cancelled or errored: the client left). No
        await: this runs in a handler that may be being cancelled."""
        for t in self.tasks:
            t.cancel()
        gone = not failed or any(h.client_gone for h in self.choices.handles)
        for h in self.choices.handles:
            if h.ended is None:
                self.core.abandon(h, "client_disconnect" if gone else SIBLING_FAILED)
            self.core.release(h)


async def first_outcome(core: GatewayCore, run: ChoiceRun, index: int, chunk: Chunk,
                        with_logprobs: bool = True) -> dict | None:
    """A choice's native body once it ended (None while it has not); raises the GatewayError of one that did not
    complete (the caller then closes the run, which cancels its siblings). with_logprobs: responses.final_body's."""
    if chunk.end is None:
        return None
    return await final_body(core, run.choices.handles[index], with_logprobs)  # raises unless it completed


async def collect_choices(core: GatewayCore, choices: Choices, request: Request,
                          with_logprobs: bool = True) -> list[dict]:
    """Every choice's native body (text, finish_reason, usage), in choice order; or the first error."""
    run = ChoiceRun(core, choices, request)
    bodies: dict[int, dict] = {}
    failed = False
    try:
        while len(bodies) < len(choices.handles):
            index, chunk = await run.next()
            try:
                body = await first_outcome(core, run, index, chunk, with_logprobs)
            except GatewayError:
                failed = True
                raise
            if body is not None:
                bodies[index] = body
        return [bodies[i] for i in range(len(choices.handles))]
    finally:
        run.close(failed)


def merged_usage(bodies: list[dict]) -> dict:
    """The request's usage: its prompt once, the completion tokens of every choice (as OpenAI and vLLM count
    them); cached tokens are the prompt's that the first prefill of it found cached (the smallest of the choices:
    the others reuse what that prefill computed)."""
    prompt = bodies[0]["usage"]["prompt_tokens"]
    completion = sum(b["usage"]["completion_tokens"] for b in bodies)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "cached_tokens": min(b["usage"].get("cached_tokens", 0) for b in bodies)}
