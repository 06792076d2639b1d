"""Running the gateway: uvicorn with a graceful SIGTERM.

On the first SIGTERM/SIGINT the gateway stops accepting (503 on /ready and on new requests),
lets requests in flight finish for up to `shutdown_grace_s`, then cancels the rest with
reason `shutdown` so every client still gets a final answer, and only then lets uvicorn exit.
A background response's request (a detached handle) has no client here: it is neither waited for nor
cancelled, and once this gateway's liveness entry is gone another gateway takes it over (responses.takeover).
A second signal exits at once. A watchdog bounds the whole shutdown: if the process is still
alive well after the drain should have ended, it writes every thread's and task's stack to the
log and exits hard, so a stuck shutdown is never silent and never hangs a deployment.
"""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import os
import sys
import threading
import time

import uvicorn

from shared.wire.events import Cancelled
from shared.settings import GatewaySettings

logger = logging.getLogger(__name__)

SETTLE_S = 5.0  # after cancelling, time for the cancelled requests' final answers to go out
GRACEFUL_CLOSE_S = 5  # uvicorn: time for open connections to finish before their tasks are cancelled
WATCHDOG_MARGIN_S = 20.0  # beyond drain + settle + close: lifespan shutdown and interpreter exit
EXIT_STUCK = 3  # exit status when the watchdog had to end the process


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, grace_s: float):
        super().__init__(config)
        self.grace_s = grace_s
        self._draining = False
        self._drain_task: asyncio.Task | None = None  # the loop keeps only weak references to tasks

    def handle_exit(self, sig, frame) -> None:
        app = self.config.loaded_app if self.config.loaded else None
        core = getattr(getattr(getattr(app, "app", app), "state", None), "core", None)
        if self._draining or core is None:  # a second signal, or nothing to drain: exit now
            self.force_exit = self._draining
            self.should_exit = True
            return
        self._draining = True
        core.draining = True
        logger.info("signal %s: draining %d requests for up to %.0f s", sig, len(core.handles), self.grace_s)
        loop = asyncio.get_running_loop()
        self._arm_watchdog(loop, self.grace_s + SETTLE_S + GRACEFUL_CLOSE_S + WATCHDOG_MARGIN_S)
        self._drain_task = loop.create_task(self._drain(core), name="drain")

    async def _drain(self, core) -> None:
        try:
            deadline = time.monotonic() + self.grace_s
            while _attached(core) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            left = _attached(core)
            if left:
                logger.info("grace over: cancelling %d requests with reason shutdown", len(left))
            for handle in left:
                await self._cancel(core, handle)
            settle = time.monotonic() + SETTLE_S
            while _attached(core) and time.monotonic() < settle:
                await asyncio.sleep(0.05)
            logger.info("drain done (%d requests still open); stopping the server", len(core.handles))
        finally:  # whatever failed above, the server stops now, not when the watchdog kills it
            self.should_exit = True

    @staticmethod
    async def _cancel(core, handle) -> None:
        """Settle CANCELLED (shutdown) in Redis; when Redis cannot be reached, answer the client all the same (its
        work is cancelled by the scheduler once this gateway's liveness expires)."""
        try:
            async with asyncio.timeout(core.s.socket_timeout_s):
                await core.cancel(handle.request_id, "shutdown", handle.reply_to)
            return
        except Exception as e:  # noqa: BLE001 - any failure: the client still gets its final answer below
            logger.warning("request %s: cancel not recorded (%r); answering its client anyway", handle.request_id, e)
        handle.deliver(Cancelled(request_id=handle.request_id, reason="shutdown", service="gateway"))

    @staticmethod
    def _arm_watchdog(loop: asyncio.AbstractEventLoop, after_s: float) -> None:
        def expire() -> None:
            logger.error("shutdown still not finished %.1f s after the signal: dumping stacks, exiting", after_s)
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            for task in list(asyncio.all_tasks(loop)):  # read-only peek from another thread: diagnostics only
                task.print_stack(file=sys.stderr)
            sys.stderr.flush()
            os._exit(EXIT_STUCK)

        timer = threading.Timer(after_s, expire)
        timer.daemon = True  # never keeps a finished process alive
        timer.start()


def _attached(core) -> list:
    """The handles of requests with a client here (a detached one's is another gateway's to take over)."""
    return [h for h in core.handles.values() if not h.detached]


def config_for(app, settings: GatewaySettings) -> uvicorn.Config:
    """uvicorn's settings for the gateway. uvloop and httptools by name, not uvicorn's "auto" (which falls back to
    asyncio's loop and the pure-Python h11 without a word when they are missing): they are what the gateway's
    per-token cost was measured with (docs/benchmarks.md), so an install without them fails at start."""
    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        loop="uvloop",
        http="httptools",
        log_level=settings.log_level.lower(),
        timeout_graceful_shutdown=GRACEFUL_CLOSE_S,
        timeout_keep_alive=settings.keep_alive_s,
        backlog=settings.listen_backlog,
    )


def serve(app, settings: GatewaySettings) -> None:
    GracefulServer(config_for(app, settings), settings.shutdown_grace_s).run()
    logger.info("gateway stopped")
