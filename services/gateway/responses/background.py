"""Background responses (background=true): answered at once with status queued, driven to their end in a task of
this gateway detached from the client, each step written to the stored response while it still runs
(store.update_running: queued -> in_progress -> completed | incomplete | failed | cancelled). Any gateway's GET
sees it; POST .../cancel settles it cancelled first and then stops the work, so the task's later writes are no-ops.

The task holds the request's handle as a client's handler would, and releases it at the end. What it does not do
yet (issue 27): take over a response whose gateway died (the stored record then stays in_progress until its TTL),
or resume a background response's stream.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Awaitable, Callable

from services.gateway.edge.errors import GatewayError, RequestCancelled
from services.gateway.session.drive import drive, final_body

if TYPE_CHECKING:
    from fastapi import Request

    from services.gateway.responses.output import Envelope, OutputBuilder
    from services.gateway.session.core import GatewayCore
    from services.gateway.session.handle import RequestHandle

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
