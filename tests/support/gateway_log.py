"""The real gateway app under a real uvicorn in a thread, every record of uvicorn's loggers and of the app's captured
as it is made (tests of what the gateway's log says)."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator

import uvicorn

from services.gateway.app import create_app
from shared.settings import GatewaySettings
from tests.support.waiting import wait_for

LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access", "")  # "": the root, where the app's loggers propagate


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def lines(self) -> list[str]:
        """The gateway's lines: not those of the test's own HTTP client."""
        fmt = logging.Formatter("%(name)s %(message)s")
        return [fmt.format(r) for r in self.records if not r.name.startswith(("httpx", "httpcore"))]

    def access(self) -> list[str]:
        """uvicorn's access lines, as its formatter's arguments show them: `GET /ready 503`."""
        return [f"{r.args[1]} {r.args[2]} {r.args[4]}" for r in self.records if r.name == "uvicorn.access"]


@contextlib.contextmanager
def logged_gateway(settings: GatewaySettings) -> Iterator[tuple[str, Records]]:
    """(its URL, its records) while it runs; stopped after."""
    server = uvicorn.Server(
        uvicorn.Config(create_app(settings), host="127.0.0.1", port=settings.port, log_level="debug")
    )
    records = Records()
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started, 60, what="the gateway started")
    for name in LOGGERS:  # after uvicorn configured its loggers
        logging.getLogger(name).addHandler(records)
    try:
        yield f"http://127.0.0.1:{settings.port}", records
    finally:
        for name in LOGGERS:
            logging.getLogger(name).removeHandler(records)
        server.should_exit = True
        thread.join(30)
