"""Background responses (background=true): answered at once with status queued, driven to their end in a task of
this gateway detached from the client, each step written to the stored response while it still runs
(store.update_running: queued -> in_progress -> completed | incomplete | failed | cancelled). Any gateway's GET
sees it; POST .../cancel settles it cancelled first and then stops the work, so the task's later writes are no-ops.

The task holds the request's handle as a client's handler would, and releases it at the end. A gateway that dies
takes its tasks with it, and the scheduler cancels their requests as orphaned: a GET through any other gateway then
finds the record running under a gateway that is not live, and settles it failed (`gateway_lost`: send it again)
rather than leave it in_progress until its TTL (orphan_settled). Not yet (issue 27): another gateway taking the
work over, or resuming a background response's stream.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Awaitable, Callable

from services.gateway.edge.errors import GatewayError, RequestCancelled
from services.gateway.responses import store
from services.gateway.session.drive import drive, final_body
from shared.liveness import aread_live

if TYPE_CHECKING:
    from fastapi import Request

    from services.gateway.responses.output import Envelope, OutputBuilder
    from services.gateway.session.core import GatewayCore
    from services.gateway.session.handle import RequestHandle
    from services.gateway.responses.store import Stored

logger = logging.getLogger(__name__)

Save = Callable[[dict], Awaitable[bool]]  # write a Response object while the stored one still runs
_TASKS: set[asyncio.Task] = set()  # referenced until done: the loop keeps only weak references to tasks


def start(
    core: GatewayCore, request: Request, handle: RequestHandle, envelope: Envelope, out: OutputBuilder, save: Save
) -> None:
    task = asyncio.get_running_loop().create_task(
        _run(core, request, handle, envelope, out, save), name=f"background-{envelope.id}"
    )
    _TASKS.add(task)
    task.add_done_callback(_TASKS.discard)


async def _run(
    core: GatewayCore, request: Request, handle: RequestHandle, envelope: Envelope, out: OutputBuilder, save: Save
) -> None:
    try:
        await _drive(core, request, handle, envelope, out, save)
    except Exception:  # nobody awaits this task: what went wrong is logged here or never seen
        logger.exception("background response %s: its record may stay as it was until its TTL", envelope.id)
    finally:
        core.release(handle)


async def _drive(
    core: GatewayCore, request: Request, handle: RequestHandle, envelope: Envelope, out: OutputBuilder, save: Save
) -> None:
    try:
        started = False
        async for chunk in drive(core, handle, request, watch=False):  # no client to watch: it has its answer
            if not started:
                started = True
                await save(envelope.response("in_progress", []))
            if chunk.text:
                out.feed(chunk.text)
        body = await final_body(core, handle, with_logprobs=False)
        status, reason, _events = out.finish(body["finish_reason"])
        await save(envelope.response(status, out.output, body["usage"], reason))
    except RequestCancelled:
        await save(envelope.response("cancelled", out.output))
    except GatewayError as e:
        await save(envelope.response("failed", out.output) | {"error": {"code": e.code, "message": e.message}})


async def orphan_settled(core: GatewayCore, owner: str, stored: Stored) -> Stored:
    """stored, settled failed if it still runs under a gateway that is no longer live (nobody will end it)."""
    if stored.response["status"] not in store.RUNNING or stored.gateway in ("", core.id):
        return stored
    if stored.gateway in await aread_live(core.r, core.names, "gateway"):
        return stored
    error = {"code": "gateway_lost", "message": "the gateway driving this response stopped; send it again"}
    lost = stored.with_response(stored.response | {"status": "failed", "error": error})
    if await store.update_running(core, owner, lost):
        logger.warning(
            "background response %s: its gateway %s is gone; settled failed", lost.response["id"], stored.gateway
        )
        return lost
    return await store.get(core, owner, stored.response["id"])  # it changed meanwhile: what it is now
