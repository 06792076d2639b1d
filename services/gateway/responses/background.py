"""Background responses (background=true): answered at once with status queued, driven to their end in a task of
this gateway detached from the client, each step written to the stored response while it still runs
(store.update_running: queued -> in_progress -> completed | incomplete | failed | cancelled). Any gateway's GET
sees it; POST .../cancel settles it cancelled first and then stops the work, so the task's later writes are no-ops.
Created with stream=true, its events are also appended to its event log in Redis (store.append_events), from which
any gateway streams them, from the start or after a sequence_number (responses.stream.replay).

The task holds the request's handle as a client's handler would, and releases it at the end. A gateway that dies
takes its tasks with it, not their requests: a background request is detached (its meta says so), so the scheduler
does not cancel it as orphaned, and it runs on. Another gateway takes the response over (responses.takeover: a
fenced claim, then a Job of its own on the request's context, resumed here with the log's next sequence_number and
the text its builder has already been fed); the stale driver's writes are refused by the fence.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from services.gateway.edge.errors import GatewayError, InvalidRequest, RequestCancelled
from services.gateway.responses import store
from services.gateway.session.drive import drive, final_body

if TYPE_CHECKING:
    from fastapi import Request

    from services.gateway.responses.output import Envelope, OutputBuilder
    from services.gateway.session.core import GatewayCore
    from services.gateway.session.handle import RequestHandle

logger = logging.getLogger(__name__)

_TASKS: set[asyncio.Task] = set()  # referenced until done: the loop keeps only weak references to tasks


class TakenOver(Exception):
    """Its log refused this driver's write: another gateway drives it now (or it was deleted). This one stops."""


@dataclass
class Job:
    core: GatewayCore
    request: Request | None  # None for a takeover's (no client: drive does not watch one)
    handle: RequestHandle
    envelope: Envelope
    out: OutputBuilder
    record: Callable[[dict], store.Stored]  # the stored record of a Response object
    owner: str
    streamed: bool  # created with stream=true: its events go to its log
    renamed: Callable[[InvalidRequest], InvalidRequest]  # a refused prompt's error, naming the Responses field
    fence: int = 0  # what its writes carry: a takeover raises the record's, and these are then refused
    started: bool = False  # response.in_progress is out (a takeover of a response that had started)
    skip: int = 0  # characters of text the previous driver fed its builder: fed to this one, their events not logged
    ids: list[tuple[str, str | None]] = field(default_factory=list)  # its items' (id, call_id) as logged before
    fed: int = 0  # characters of text fed to the builder so far
    next_seq: int = 0  # the next event's sequence_number

    def feed(self, text: str) -> list[dict]:
        """The events of the next text; those of what the previous driver had logged already are dropped."""
        if self.skip:
            head, text = text[: self.skip], text[self.skip :]
            self.out.feed(head)
            self.skip, self.fed = self.skip - len(head), self.fed + len(head)
            if not self.skip:
                self.caught_up()
        self.fed += len(text)
        return self.out.feed(text) if text else []

    def caught_up(self) -> None:
        """The builder has been fed what the previous driver had logged (or all there is, should the text fall short
        of it): its items are given the ids the stream announced."""
        self.skip = 0
        self.out.adopt_ids(self.ids)

    async def save(self, response: dict) -> bool:
        """Write a Response object while the stored one still runs, and is still this driver's."""
        return await store.update_running(self.core, self.owner, self.record(response), self.fence)

    async def log(self, events: list[dict]) -> None:
        if not self.streamed or not events:
            return
        for event in events:
            event["sequence_number"] = self.next_seq
            self.next_seq += 1
        first = events[0]["sequence_number"] == 0
        if not await store.append_events(self.core, self.owner, self.envelope.id, events, first, self.fence, self.fed):
            raise TakenOver(self.envelope.id)

    async def end(self, response: dict) -> None:
        """The last word: the record (if it still runs), the log's terminal event, its entry out of the index."""
        await self.save(response)
        await self.log([{"type": store.terminal_event(response["status"]), "response": response}])
        await store.unindex(self.core, self.core.id, self.owner, self.envelope.id)


async def start(job: Job) -> None:
    """Log its creation (a stream of it may be asked for from now on), then drive it in a task of its own."""
    await job.log([{"type": "response.created", "response": job.envelope.response("queued", [])}])
    spawn(job)


def spawn(job: Job) -> None:
    """Drive it to its end in a task of its own (a takeover's job starts here: its creation was logged before)."""
    job.handle.detached = True  # a shutdown of this gateway leaves it running, for another to take over
    task = asyncio.get_running_loop().create_task(_run(job), name=f"background-{job.envelope.id}")
    _TASKS.add(task)
    task.add_done_callback(_TASKS.discard)


async def _run(job: Job) -> None:
    try:
        await _drive(job)
    except TakenOver:  # its request runs on for the gateway that drives it now: released here, not cancelled
        logger.warning(
            "response %s: taken over by another gateway (or deleted); no longer driven here", job.envelope.id
        )
        await store.unindex(job.core, job.core.id, job.owner, job.envelope.id)  # a deleted one's entry goes too
    except Exception:  # nobody awaits this task: what went wrong is logged here or never seen
        logger.exception("background response %s: its record may stay as it was until its TTL", job.envelope.id)
        await store.unindex(job.core, job.core.id, job.owner, job.envelope.id)  # nobody will drive it on
    finally:
        job.core.release(job.handle)


async def _drive(job: Job) -> None:
    envelope, out = job.envelope, job.out
    try:
        async for chunk in drive(job.core, job.handle, job.request, watch=False):  # no client: it has its answer
            if not job.started:
                job.started = True
                running = envelope.response("in_progress", [])
                await job.save(running)
                await job.log([{"type": "response.in_progress", "response": running}])
            if chunk.text:
                await job.log(job.feed(chunk.text))
        body = await final_body(job.core, job.handle, with_logprobs=False)
        if job.skip:
            job.caught_up()
        status, reason, closing = out.finish(body["finish_reason"])
        await job.log(closing)
        await job.end(envelope.response(status, out.output, body["usage"], reason))
    except RequestCancelled:
        await job.end(envelope.response("cancelled", out.output))
    except GatewayError as e:
        if isinstance(e, InvalidRequest):  # the prompt refused (too long...): named as the client sent it
            e = job.renamed(e)
        await job.end(envelope.response("failed", out.output) | {"error": {"code": e.code, "message": e.message}})
