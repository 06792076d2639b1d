"""Chaos: kill -9 one kind of Conveyor process every few seconds under a steady load; nothing may be lost.

For each service in --services, three phases of --phase-s seconds each, as Dynamo's fault tests do: baseline
(no fault), fault (SIGKILL of that service every --kill-every seconds; `conveyor up` restarts it), recovery
(no fault). Steady load throughout: --clients loops, each streaming /generate with --tokens output tokens
(ignore_eos, so every answer's length is known) on simulated workers (CONVEYOR_ENGINE=sim: the control plane is
the subject, not the model). Every request is classified by the phase it started in and by what its client got:
  ok          a final event with finish_reason, every token, then [DONE]
  http_NNN    an error answer (status NNN) -- 504 is a timeout, the one a fault must never cause
  refused     the connection was refused: the gateway was down (being restarted); nothing was created
  conn_lost   the connection died mid-request: the gateway serving it was killed (its clients see that; the
              scheduler cancels the orphaned work once the gateway's liveness expires)
  broken      the stream ended without its final event or with tokens missing: a lost request
  hung        no answer within --request-timeout seconds: a request left hanging
Prints one table row per service and phase (requests, outcomes, completed/s, p50/p99 latency of ok ones) and
writes JSON to --out. The promise (docs/reliability.md): 0 broken, 0 hung, no 504 in any phase; refused and conn_lost
only when the gateway itself is killed.
Run: flock /tmp/conveyor-bench.lock .venv/bin/python -m benchmarks.cluster.chaos [--phase-s 40] [--kill-every 10]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

from benchmarks.common import DEFAULT_OUT, ConveyorUp, percentile, print_table, write_json
from shared.process.ready import wait_ok

PHASES = ("baseline", "fault", "recovery")
OUTCOMES = ("ok", "http_504", "http_other", "refused", "conn_lost", "broken", "hung")


async def one_request(client: httpx.AsyncClient, tokens: int, timeout_s: float) -> tuple[str, float]:
    body = {"prompt": "Tell me a story:", "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    t0 = time.monotonic()
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", "/generate", json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    return ("http_504" if r.status_code == 504 else "http_other"), time.monotonic() - t0
                got, final, done = 0, None, False
                async for line in r.aiter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: {"):
                        event = json.loads(line[6:])
                        got += len(event.get("token_ids", []))
                        final = event if "finish_reason" in event else final
                ok = done and final is not None and got == tokens
                return ("ok" if ok else "broken"), time.monotonic() - t0
    except TimeoutError:
        return "hung", time.monotonic() - t0
    except httpx.ConnectError:
        return "refused", time.monotonic() - t0
    except httpx.HTTPError:
        return "conn_lost", time.monotonic() - t0


async def load(url: str, clients: int, tokens: int, timeout_s: float, until: float, out: list) -> None:
    async def loop():
        async with httpx.AsyncClient(base_url=url, timeout=timeout_s + 5) as client:
            while time.monotonic() < until:
                started = time.monotonic()
                outcome, latency = await one_request(client, tokens, timeout_s)
                out.append((started, outcome, latency))
                if outcome in ("refused", "conn_lost"):
                    await asyncio.sleep(0.2)  # the gateway is restarting: do not spin on refused connections

    await asyncio.gather(*[loop() for _ in range(clients)])


def kill_loop(up: ConveyorUp, service: str, start: float, stop: float, every: float, kills: list) -> None:
    next_kill = start + every / 2
    while time.monotonic() < stop:
        if time.monotonic() >= next_kill:
            procs = up.processes()
            victims = sorted(k for k in procs if k.split("#")[0] == service)
            if victims:
                name = victims[len(kills) % len(victims)]
                os.kill(procs[name].pid, signal.SIGKILL)
                kills.append((time.monotonic(), name))
            next_kill += every
        time.sleep(0.2)


def summarize(service: str, records: list, bounds: dict, kills: int) -> list[dict]:
    rows = []
    for phase in PHASES:
        lo, hi = bounds[phase]
        mine = [r for r in records if lo <= r[0] < hi]
        counts = Counter(o for _t, o, _l in mine)
        ok = [lat for _t, o, lat in mine if o == "ok"]
        rows.append(
            {
                "service": service,
                "phase": phase,
                "requests": len(mine),
                **{o: counts.get(o, 0) for o in OUTCOMES},
                "ok_per_s": len(ok) / (hi - lo),
                "p50_s": percentile(ok, 50),
                "p99_s": percentile(ok, 99),
                "kills": kills if phase == "fault" else 0,
            }
        )
    return rows


def run_service(up: ConveyorUp, service: str, args) -> list[dict]:
    records, kills = [], []
    t0 = time.monotonic()
    bounds = {p: (t0 + i * args.phase_s, t0 + (i + 1) * args.phase_s) for i, p in enumerate(PHASES)}
    killer = threading.Thread(target=kill_loop, args=(up, service, *bounds["fault"], args.kill_every, kills))
    killer.start()
    asyncio.run(load(up.url, args.clients, args.tokens, args.request_timeout, bounds["recovery"][1], records))
    killer.join()
    return summarize(service, records, bounds, len(kills))


def wait_ready(url: str, timeout_s: float = 120) -> None:
    if not wait_ok(f"{url}/ready", timeout_s, 0.5):
        raise RuntimeError(f"the cluster was not ready again within {timeout_s} s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--services", default="worker,tokenizer,scheduler,gateway")
    p.add_argument("--phase-s", type=float, default=40.0)
    p.add_argument("--kill-every", type=float, default=10.0)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args()
    env = {"CONVEYOR_ENGINE": "sim"}
    rows = []
    with tempfile.TemporaryDirectory() as tmp, ConveyorUp(Path(tmp) / "cluster.log", args.workers, env=env) as up:
        for service in args.services.split(","):
            wait_ready(up.url)
            rows += run_service(up, service, args)
            print_table(
                ["service", "phase", "requests", *OUTCOMES, "ok/s", "p50 s", "p99 s", "kills"],
                [
                    [
                        r["service"],
                        r["phase"],
                        r["requests"],
                        *[r[o] for o in OUTCOMES],
                        f"{r['ok_per_s']:.1f}",
                        f"{r['p50_s'] or 0:.2f}",
                        f"{r['p99_s'] or 0:.2f}",
                        r["kills"],
                    ]
                    for r in rows[-3:]
                ],
            )
    path = write_json(args.out, "chaos", {"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows})
    print(f"results: {path}")


if __name__ == "__main__":
    main()
