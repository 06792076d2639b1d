"""Running the gateway: uvicorn with a graceful SIGTERM.

On the first SIGTERM/SIGINT the gateway stops accepting (503 on /ready and on new requests),
lets requests in flight finish for up to `shutdown_grace_s`, then cancels the rest with
reason `shutdown` so every client still gets a final answer, and only then lets uvicorn exit.
A second signal exits at once.
"""

from __future__ import annotations

import asyncio
import logging
import time

import uvicorn

from shared.settings import GatewaySettings

logger = logging.getLogger(__name__)


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, grace_s: float):
        super().__init__(config)
        self.grace_s = grace_s
        self._draining = False

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
        asyncio.get_running_loop().create_task(self._drain(core))

    async def _drain(self, core) -> None:
        deadline = time.monotonic() + self.grace_s
        while core.handles and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for handle in list(core.handles.values()):
            await core.cancel(handle.request_id, "shutdown", handle.reply_to)
        settle = time.monotonic() + 5.0  # the cancelled requests' final answers go out
        while core.handles and time.monotonic() < settle:
            await asyncio.sleep(0.05)
        self.should_exit = True


def serve(app, settings: GatewaySettings) -> None:
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level.lower(),
                            timeout_graceful_shutdown=5)
    GracefulServer(config, settings.shutdown_grace_s).run()
