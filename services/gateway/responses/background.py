"""Background responses (background=true): answered at once with status queued, driven to their end in a task of
this gateway detached from the client, each step written to the stored response while it still runs
(store.update_running: queued -> in_progress -> completed | incomplete | failed | cancelled). Any gateway's GET
sees it; POST .../cancel settles it cancelled first and then stops the work, so the task's later writes are no-ops.
Created with stream=true, its events are also appended to its event log in Redis (store.append_events), from which
any gateway streams them, from the start or after a sequence_number (responses.stream.replay).

The task holds the request's handle as a client's handler would, and releases it at the end. A gateway that dies
takes its tasks with it, and the scheduler cancels their requests as orphaned: a GET through any other gateway then
finds the record running under a gateway that is not live, and settles it failed (`gateway_lost`: send it again)
rather than leave it in_progress until its TTL (store.orphan_settled). Not yet (issue 27): another gateway taking
the work over.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Awaitable, Callable

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


@dataclass
class Job:
    core: GatewayCore
    request: Request
    handle: RequestHandle
    envelope: Envelope
    out: OutputBuilder
    save: Callable[[dict], Awaitable[bool]]  # write a Response object while the stored one still runs
    owner: str
    streamed: bool  # created with stream=true: its events go to its log
    renamed: Callable[[InvalidRequest], InvalidRequest]  # a refused prompt's error, naming the Responses field
    _next: int = field(default=0)  # the next event's sequence_number

    async def log(self, events: list[dict]) -> None:
        if not self.streamed or not events:
            return
        for event in events:
            event["sequence_number"] = self._next
            self._next += 1
        await store.append_events(
            self.core, self.owner, self.envelope.id, events, first=events[0]["sequence_number"] == 0
        )

    async def end(self, response: dict) -> None:
        """The last word: the record (if it still runs), then the log's terminal event."""
        await self.save(response)
        await self.log([{"type": store.terminal_event(response["status"]), "response": response}])


async def start(job: Job) -> None:
    """Log its creation (a stream of it may be asked for from now on), then drive it in a task of its own."""
    await job.log([{"type": "response.created", "response": job.envelope.response("queued", [])}])
    task = asyncio.get_running_loop().create_task(_run(job), name=f"background-{job.envelope.id}")
    _TASKS.add(task)
    task.add_done_callback(_TASKS.discard)


async def _run(job: Job) -> None:
    try:
        await _drive(job)
    except Exception:  # nobody awaits this task: what went wrong is logged here or never seen
        logger.exception("background response %s: its record may stay as it was until its TTL", job.envelope.id)
    finally:
        job.core.release(job.handle)


async def _drive(job: Job) -> None:
    envelope, out = job.envelope, job.out
    try:
        started = False
        async for chunk in drive(job.core, job.handle, job.request, watch=False):  # no client: it has its answer
            if not started:
                started = True
                running = envelope.response("in_progress", [])
                await job.save(running)
                await job.log([{"type": "response.in_progress", "response": running}])
            if chunk.text:
                await job.log(out.feed(chunk.text))
        body = await final_body(job.core, job.handle, with_logprobs=False)
        status, reason, closing = out.finish(body["finish_reason"])
        await job.log(closing)
        await job.end(envelope.response(status, out.output, body["usage"], reason))
    except RequestCancelled:
        await job.end(envelope.response("cancelled", out.output))
    except GatewayError as e:
        if isinstance(e, InvalidRequest):  # the prompt refused (too long...): named as the client sent it
            e = job.renamed(e)
        await job.end(envelope.response("failed", out.output) | {"error": {"code": e.code, "message": e.message}})
