"""`dashboard_cost.py dashboards`: the gateway's CPU per connected dashboard, with --streams requests in flight.

A sim cluster (`conveyor up --engine sim`, no API keys: every dashboard sees every request) and --streams client
loops from benchmarks/scale/control_plane.py, each streaming one request after another, so the in-flight count stays
near --streams and transitions keep flowing. Then, one window each: 0, 1, 10 ... lean dashboard readers (raw
sockets reading /dashboard/api/events and counting what arrives), and last one headless Chromium on the page.
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time
from pathlib import Path

import redis

from benchmarks.common import ROOT, ConveyorUp, raise_fd_limit, stamp, write_json
from benchmarks.scale.control_plane import client_loop, prompts
from services.gateway.session.metrics import LIVE_STATES
from shared.wire.constants import Names

CLUSTER_ENV = {
    "CONVEYOR_ENGINE": "sim",
    "CONVEYOR_MAX_NUM_SEQS": "2048",  # every stream runs at once on the one worker
    "CONVEYOR_MAX_NUM_BATCHED_TOKENS": "65536",
    "CONVEYOR_KV_CACHE_BYTES": str(8 << 30),  # only counted by the simulator
    "CONVEYOR_MAX_OPEN_REQUESTS": "10000",
    "CONVEYOR_MAX_WAITING_REQUESTS": "10000",
}


class Readers:
    """k dashboards as raw SSE readers: bytes and feed records received."""

    def __init__(self, port: int):
        self.port, self.bytes, self.records, self.tasks = port, 0, 0, []

    async def _one(self) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port, limit=1 << 22)
        writer.write(b"GET /dashboard/api/events HTTP/1.1\r\nHost: bench\r\nAccept: text/event-stream\r\n\r\n")
        try:
            while data := await reader.read(1 << 16):
                self.bytes += len(data)
                self.records += data.count(b'"rid":')
        finally:
            writer.close()

    def start(self, k: int) -> None:
        self.tasks = [asyncio.create_task(self._one()) for _ in range(k)]

    async def stop(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


def in_flight(r: redis.Redis) -> int:
    names = Names()
    pipe = r.pipeline(transaction=False)
    for s in LIVE_STATES:
        pipe.zcard(names.state_set(0, s.value))
    return sum(pipe.execute())


def gateway_cpu(cluster: ConveyorUp) -> float:
    t = cluster.processes()["gateway"].cpu_times()
    return t.user + t.system


async def level(cluster: ConveyorUp, r: redis.Redis, k: int, window: float) -> dict:
    readers = Readers(cluster.port)
    readers.start(k)
    await asyncio.sleep(3.0)  # connected, snapshots sent: measure the steady state
    c0, b0, n0, t0 = gateway_cpu(cluster), readers.bytes, readers.records, time.monotonic()
    await asyncio.sleep(window)
    c1, b1, n1, t1 = gateway_cpu(cluster), readers.bytes, readers.records, time.monotonic()
    flying = in_flight(r)
    await readers.stop()
    dt = t1 - t0
    return {
        "dashboards": k,
        "in_flight": flying,
        "gateway_cpu_s_per_s": (c1 - c0) / dt,
        "records_per_s_per_dashboard": (n1 - n0) / dt / k if k else None,
        "bytes_per_s_per_dashboard": (b1 - b0) / dt / k if k else None,
    }


def browser_window(url: str, window: float, screenshot: str) -> dict:
    """Chromium on the page: time to the first full table, and the longest main-thread task while it updates."""
    from tests.support.browser import headless_page, unavailable_reason

    if reason := unavailable_reason():
        return {"skipped": reason}
    with headless_page() as page:
        page.add_init_script("""window.__long = []; window.__frames = 0;
            new PerformanceObserver(l => l.getEntries().forEach(e => window.__long.push(e.duration)))
              .observe({type: 'longtask', buffered: true});
            const f = () => { window.__frames++; requestAnimationFrame(f); }; requestAnimationFrame(f);""")
        t0 = time.monotonic()
        page.goto(f"{url}/dashboard")
        page.wait_for_function("document.querySelectorAll('#rows .row').length > 10", timeout=60_000)
        loaded = time.monotonic() - t0
        page.evaluate("window.__long = []; window.__frames = 0")
        time.sleep(window)
        got = page.evaluate(
            "({long: window.__long, frames: window.__frames, "
            "shown: document.querySelector('#shown').textContent, "
            "dom_rows: document.querySelectorAll('#rows .row').length, "
            "live: [...S.rows.values()].filter(r => !r.endedAt).map(r => [r.rid, r.state]), "
            "at: now()})"
        )
        got["blank_top"] = blank_rows_on_screen(page)
        page.evaluate("document.getElementById('scroller').scrollTop = 1e9")  # the newest rows
        time.sleep(3.0)  # two refreshes of the rows on screen (ROWS_REFRESH_MS)
        got["blank_bottom"] = blank_rows_on_screen(page)
        page.evaluate("document.getElementById('scroller').scrollTop = 0")
        if screenshot:
            page.click("#rows .row >> nth=3")
            page.wait_for_selector("#detail:not([hidden]) #timeline .bar", timeout=30_000)
            time.sleep(1.0)
            page.screenshot(path=screenshot)
    return {
        "snapshot_to_table_s": loaded,
        "frames_per_s": got["frames"] / window,
        "long_tasks": len(got["long"]),
        "longest_task_ms": max(got["long"], default=0.0),
        "shown": got["shown"],
        "dom_rows": got["dom_rows"],
        "page_live": got["live"],
        "page_at": got["at"],
        "rows_on_screen_without_counts": {"top": got["blank_top"], "bottom": got["blank_bottom"]},
    }


def blank_rows_on_screen(page) -> int:
    """Rows on screen still without their prompt length (the page fetches it for the rows shown): should be 0."""
    return page.evaluate("""(() => { const sc = document.getElementById('scroller'), first = Math.floor(sc.scrollTop / ROW_H);
        return S.order.slice(first, first + Math.ceil(sc.clientHeight / ROW_H)).filter(r => r.prompt == null).length; })()""")


def stale_rows(r: redis.Redis, page_live: list, page_at: float) -> int:
    """Rows the page shows in flight whose request had ended over a second before the page looked: a transition
    the page missed."""
    names = Names()
    pipe = r.pipeline(transaction=False)
    for rid, _state in page_live:
        pipe.hget(names.layer(rid, "meta"), "ended_at")
    return sum(1 for ended in pipe.execute() if ended is not None and float(ended) < page_at - 1.0)


async def measure(cluster: ConveyorUp, args) -> dict:
    r = redis.Redis.from_url(cluster.find_redis_url())
    texts = prompts(256)
    ns = argparse.Namespace(api="generate", max_tokens=args.max_tokens)
    clients = [asyncio.create_task(client_loop(i, cluster.port, float("inf"), ns, texts)) for i in range(args.streams)]
    t0 = time.monotonic()
    while in_flight(r) < 0.9 * args.streams and time.monotonic() - t0 < 120:
        await asyncio.sleep(1.0)
    levels = [await level(cluster, r, k, args.window) for k in args.levels]
    c0, f0 = gateway_cpu(cluster), in_flight(r)
    loop, box = asyncio.get_running_loop(), {}
    done = asyncio.Event()

    def run_browser():
        box["browser"] = browser_window(cluster.url, args.window, args.screenshot)
        loop.call_soon_threadsafe(done.set)

    t_b = time.monotonic()
    threading.Thread(target=run_browser, daemon=True).start()
    await done.wait()
    browser = box["browser"]
    if "page_live" in browser:
        browser["stale_rows"] = stale_rows(r, browser.pop("page_live"), browser.pop("page_at"))
    browser = {
        **browser,
        "in_flight": f0,
        "gateway_cpu_s_per_s": (gateway_cpu(cluster) - c0) / (time.monotonic() - t_b),
    }
    # A client loop stops at its first failed request: what stopped them (none should have).
    stopped: dict[str, int] = {}
    for t in clients:
        if t.done() and not t.cancelled() and t.exception() is None:
            why = (t.result()[-1].error or "")[:120]
            stopped[why] = stopped.get(why, 0) + 1
        t.cancel()
    await asyncio.gather(*clients, return_exceptions=True)
    return {
        "streams": args.streams,
        "max_tokens": args.max_tokens,
        "sim_speedup": args.sim_speedup,
        "window_s": args.window,
        "levels": levels,
        "browser": browser,
        "clients_stopped_by": stopped,
    }


def run_dashboards(args) -> None:
    raise_fd_limit()
    env = {**CLUSTER_ENV, "CONVEYOR_SIM_SPEEDUP": str(args.sim_speedup)}
    run_id = stamp()
    with ConveyorUp(ROOT / "benchmarks" / "results" / f"dashboard_cost-{run_id}.log", env=env) as cluster:
        res = asyncio.run(measure(cluster, args))
    prev = res["levels"][0]
    for lv in res["levels"]:
        # What each dashboard beyond the previous level's added (the first one also starts the feed reader).
        added = lv["dashboards"] - prev["dashboards"]
        extra = (lv["gateway_cpu_s_per_s"] - prev["gateway_cpu_s_per_s"]) / added if added else 0.0
        lv["gateway_cpu_s_per_s_per_added_dashboard"] = extra
        print(
            f"{lv['dashboards']:>3} dashboards, {lv['in_flight']} in flight: gateway {lv['gateway_cpu_s_per_s']:.3f}"
            f" CPU-s/s, +{extra:.4f} per dashboard added; {lv['records_per_s_per_dashboard'] or 0:.0f} records/s, "
            f"{(lv['bytes_per_s_per_dashboard'] or 0) / 1024:.1f} KiB/s per dashboard"
        )
        prev = lv
    print("browser:", res["browser"])
    print("client loops stopped by a failed request:", res["clients_stopped_by"] or "none")
    path = write_json(ROOT / "docs" / "results", "dashboard_cost", res, run_id)
    print(f"results: {path}")
    if args.screenshot:
        print(f"screenshot: {Path(args.screenshot).resolve()}")
