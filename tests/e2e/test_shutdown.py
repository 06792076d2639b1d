"""SIGTERM: the gateway drains, then cancels with reason shutdown; every client gets a final answer."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading

import httpx

from services.gateway.edge.server import EXIT_STUCK
from tests.support.sim_reference import SIM
from tests.e2e.test_request_paths import worker_idle
from tests.support.waiting import wait_for


def test_gateway_sigterm_with_requests_in_flight(start_cluster):
    # Simulated workers: what is checked is the gateway's drain, whatever computes the tokens. The grace is long
    # enough for the short request (8 tokens, decoding already) to finish, and far shorter than the long one.
    c = start_cluster(env={**SIM, "CONVEYOR_SHUTDOWN_GRACE_S": "5"})
    box: dict = {}

    def send(name, body):
        box[name] = httpx.post(f"{c.url}/generate", json=body, timeout=120)

    long = threading.Thread(target=send, args=("long", {"prompt": "Count:", "max_tokens": 3000, "ignore_eos": True}))
    long.start()
    wait_for(lambda: httpx.get(f"{c.url}/v1/requests", params={"state": "DECODING"}).json()["data"], 60)
    short = threading.Thread(target=send, args=("short", {"prompt": "Hi", "max_tokens": 8, "ignore_eos": True}))
    short.start()
    wait_for(
        lambda: len(httpx.get(f"{c.url}/v1/requests", params={"state": "DECODING"}).json()["data"]) == 2,
        60,
        what="both decoding",
    )
    gateway = c.procs["gateway"]
    gateway.send_signal(signal.SIGTERM)
    wait_for(lambda: httpx.get(f"{c.url}/ready", timeout=5).status_code == 503, 10, what="not ready")
    late = httpx.post(f"{c.url}/generate", json={"prompt": "Late", "max_tokens": 2}, timeout=10)
    assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down"
    short.join(60)
    long.join(60)
    assert box["short"].status_code == 200 and len(box["short"].json()["token_ids"]) == 8
    err = box["long"].json()["error"]
    assert box["long"].status_code == 499 and err["code"] == "shutdown" and err["partial"]["token_ids"]
    try:
        rc = gateway.wait(45)
    except subprocess.TimeoutExpired:
        rc = None
    assert rc == 0, f"gateway exit status {rc}\n{c.logs('gateway', 30000)}"
    wait_for(lambda: worker_idle(c), 30, what="worker idle")


def test_stuck_gateway_shutdown_is_ended_by_the_watchdog_with_stacks_in_the_log():
    code = (
        "import asyncio, threading\n"
        "from services.gateway.edge.server import GracefulServer\n"
        "async def main():\n"
        "    GracefulServer._arm_watchdog(asyncio.get_running_loop(), 0.5)\n"
        "    await asyncio.Event().wait()  # a shutdown that never ends\n"
        "asyncio.run(main())\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == EXIT_STUCK
    assert "shutdown still not finished" in proc.stderr and "Stack for <Task" in proc.stderr, proc.stderr


def test_gateway_sigterm_while_redis_is_down_still_gives_clients_their_final_answer(start_cluster):
    """The drain cancels what is left after the grace; with Redis away those cancels fail. Each client must
    still get a final answer (cancelled: shutdown) and the process exit 0, not a reset from the watchdog."""
    c = start_cluster(env={**SIM, "CONVEYOR_SHUTDOWN_GRACE_S": "1", "CONVEYOR_SOCKET_TIMEOUT_S": "2"})
    box: dict = {}

    def send():
        box["long"] = httpx.post(
            f"{c.url}/generate", json={"prompt": "Count:", "max_tokens": 3000, "ignore_eos": True}, timeout=120
        )

    long = threading.Thread(target=send)
    long.start()
    wait_for(lambda: httpx.get(f"{c.url}/v1/requests", params={"state": "DECODING"}).json()["data"], 60)
    c.redis.stop()
    gateway = c.procs["gateway"]
    gateway.send_signal(signal.SIGTERM)
    long.join(90)
    assert box["long"].status_code == 499 and box["long"].json()["error"]["code"] == "shutdown", box["long"].text
    try:
        rc = gateway.wait(45)
    except subprocess.TimeoutExpired:
        rc = None
    assert rc == 0, f"gateway exit status {rc}\n{c.logs('gateway', 30000)}"
    # The other services' stop with Redis away is not this test's subject: each would wait out Cluster.stop's 20 s
    # before it is killed (22 s of every run's teardown), so they are killed now.
    for name, proc in c.procs.items():
        if name != "gateway":
            proc.kill()
