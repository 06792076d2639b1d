"""Reading a Server-Sent Events stream in a background thread, for tests that wait on its events."""

from __future__ import annotations

import json
import queue
import threading
import time

import httpx


class SseReader:
    """Connects at construction; every event lands in `events` as (receipt time, name, data)."""

    def __init__(self, url: str, headers: dict | None = None):
        self.events: queue.Queue = queue.Queue()
        self.seen: list[tuple[float, str, object]] = []
        self.status: int | None = None
        self._client = httpx.Client(timeout=httpx.Timeout(5.0, read=None))
        self._stop = threading.Event()
        self._opened = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(url, headers or {}), daemon=True)
        self._thread.start()
        assert self._opened.wait(10), "the event stream did not open"

    def _run(self, url: str, headers: dict) -> None:
        try:
            with self._client.stream("GET", url, headers=headers) as r:
                self.status = r.status_code
                self._opened.set()
                name = "message"
                for line in r.iter_lines():
                    if self._stop.is_set():
                        return
                    if line.startswith("event: "):
                        name = line[len("event: ") :]
                    elif line.startswith("data: "):
                        self.events.put((time.time(), name, json.loads(line[len("data: ") :])))
                        name = "message"
        except (httpx.HTTPError, RuntimeError):
            pass  # closed by close(): the reader's thread just ends
        finally:
            self._opened.set()

    def next(self, name: str, match=lambda data: True, timeout: float = 30.0):
        """The next event called `name` whose data matches, as (receipt time, data); others are kept in `seen`."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no {name} event matching within {timeout} s")
            try:
                at, got, data = self.events.get(timeout=left)
            except queue.Empty:
                continue
            self.seen.append((at, got, data))
            if got == name and match(data):
                return at, data

    def record(self, rid: str, to: str, timeout: float = 30.0) -> tuple[float, dict]:
        """The feed record of request `rid` entering state `to`, as (receipt time, record). The gateway batches its
        feed, so the record may have come in an event already read for another record: those are looked at first."""
        for at, name, data in self.seen:
            hit = [r for r in data if r["rid"] == rid and r["to"] == to] if name == "feed" else []
            if hit:
                return at, hit[0]
        found: list = []

        def has(batch) -> bool:
            found[:] = [r for r in batch if r["rid"] == rid and r["to"] == to]
            return bool(found)

        at, _batch = self.next("feed", has, timeout)
        return at, found[0]

    def rids(self) -> set[str]:
        """Every request id this stream mentioned so far (snapshot rows and feed records)."""
        while not self.events.empty():
            self.seen.append(self.events.get_nowait())
        out: set[str] = set()
        for _at, name, data in self.seen:
            if name == "feed":
                out |= {r["rid"] for r in data}
            elif name == "snapshot":
                out |= {r["rid"] for r in data["rows"]}
        return out

    def close(self) -> None:
        self._stop.set()
        self._client.close()
        self._thread.join(5)
