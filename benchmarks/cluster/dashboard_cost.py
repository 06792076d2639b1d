"""What the live dashboard (issue 14) costs: per transition, and per connected dashboard.

`transitions`: a fresh redis-server; N requests created and moved through RECEIVED -> ... -> FINISHED (7
transitions each) by the real scripts, pipelined; reports Redis's own microseconds per EVALSHA (INFO
commandstats), the client's wall time per transition, and the feed's memory per record. Run it once on main's
tree and once on this one to see what the feed adds (it imports `shared` from whichever tree PYTHONPATH names):
  PYTHONPATH=/work/main      python benchmarks/cluster/dashboard_cost.py transitions
  PYTHONPATH=/work/dashboard python benchmarks/cluster/dashboard_cost.py transitions

`dashboards`: `conveyor up --engine sim` with --streams streaming clients kept in flight (each resubmits when
its request ends); the gateway's CPU seconds per second over a --window with 0, 1 and 10 lean SSE readers of
/dashboard/api/events connected, then with one headless Chromium showing the page (its snapshot load time and the
longest main-thread task while it updates), whose screenshot is docs/dashboard.png with --screenshot.
  python -m benchmarks.cluster.dashboard_cost dashboards [--streams 1000] [--screenshot docs/dashboard.png]
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid

PATH = ("PREPROCESSED", "QUEUED", "SCHEDULED", "PREFILLING", "DECODING", "FINISHED")


def transitions(n: int, batch: int) -> dict:
    import tempfile

    import redis

    import shared
    from shared.wire import constants
    from shared.state.context_store import ContextStore
    from shared.state.lifecycle import Lifecycle
    from shared.redis_io.redis_server import RedisServer

    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(f"{tmp}/redis").start()
        try:
            r = redis.Redis.from_url(server.url)
            names = constants.Names(f"b{uuid.uuid4().hex[:6]}")
            store, lc = ContextStore(r, names, 600), Lifecycle(r, names, "bench", 600)
            ids = [uuid.uuid4().hex for _ in range(n)]
            create_contexts(r, store, ids, batch)
            r.config_resetstat()
            wall = move_along(r, lc, ids, batch)
            stats = r.info("commandstats")
            evalsha = stats.get("cmdstat_evalsha", {})
            feed = getattr(names, "lifecycle_feed", None)
            feed_len = r.xlen(feed) if feed else 0
            feed_bytes = r.memory_usage(feed) if feed and feed_len else 0
            return {
                "tree": shared.__file__.rsplit("/shared/", 1)[0],
                "feed": bool(feed),
                "transitions": n * len(PATH),
                "redis_usec_per_transition": evalsha.get("usec_per_call"),
                "wall_usec_per_transition": wall / (n * len(PATH)) * 1e6,
                "feed_records": feed_len,
                "feed_bytes_per_record": feed_bytes / feed_len if feed_len else None,
            }
        finally:
            server.stop()


def create_contexts(r, store, ids: list[str], batch: int) -> None:
    """The requests' contexts created, batch to a pipeline (not timed: the same with and without the feed but its
    XADD)."""
    from shared.wire.events import RequestReceived, Sampling

    for i in range(0, len(ids), batch):
        pipe = r.pipeline(transaction=False)
        for rid in ids[i : i + batch]:
            ev = RequestReceived(
                request_id=rid,
                reply_to="x",
                prompt="p",
                sampling=Sampling(max_tokens=1),
                deadline=0,
                received_at=0,
            )
            keys, argv = store.create_args(rid, {"owner": "k"}, {"prompt": "p"}, ev)
            store._create(keys=keys, args=argv, client=pipe)
        pipe.execute()


def move_along(r, lc, ids: list[str], batch: int) -> float:
    """Every request moved through PATH, one state at a time, batch to a pipeline: the seconds it took."""
    from shared.state.lifecycle import Owner, State

    t0 = time.perf_counter()
    for to in PATH:
        for i in range(0, len(ids), batch):
            pipe = r.pipeline(transaction=False)
            for rid in ids[i : i + batch]:
                lc.queue(pipe, rid, State(to), owner=Owner("w", 1) if to == "SCHEDULED" else None)
            pipe.execute()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    t = sub.add_parser("transitions")
    t.add_argument("--requests", type=int, default=3000)
    t.add_argument("--batch", type=int, default=100)
    t.add_argument("--repeat", type=int, default=3)
    d = sub.add_parser("dashboards")
    d.add_argument("--streams", type=int, default=1000)
    d.add_argument("--max-tokens", type=int, default=16)
    d.add_argument("--window", type=float, default=20.0)
    d.add_argument("--levels", type=int, nargs="+", default=[0, 1, 10])
    d.add_argument("--screenshot", default="")
    d.add_argument("--sim-speedup", type=float, default=2.0)
    args = ap.parse_args()
    if args.what == "transitions":
        runs = [transitions(args.requests, args.batch) for _ in range(args.repeat)]
        for k, v in runs[0].items():  # a shared machine is noisy: the median of the runs, and each run
            if isinstance(v, float):
                print(
                    f"{k:>28}: {statistics.median(x[k] for x in runs):.2f}   (runs: {[round(x[k], 2) for x in runs]})"
                )
            else:
                print(f"{k:>28}: {v}")
    else:
        from benchmarks.cluster.dashboard_cost_cluster import run_dashboards

        run_dashboards(args)


if __name__ == "__main__":
    main()
