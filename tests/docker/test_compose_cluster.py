"""`docker compose up` for real: the repository's docker-compose.yml on a real Docker engine, Conveyor's image
built from this checkout. Phases in order (one cluster for the module): the cluster comes up healthy, serves
the README's example with the README's answer, exports every service's spans, spreads requests over scaled
workers, survives a worker container killed mid-request, and `down -v` leaves nothing behind.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.docker.engine import TIMINGS
from tests.docker.images import ROOT

SERVICES = ("gateway", "tokenizer", "scheduler", "worker")


def readme_example() -> tuple[dict, str]:
    """The README's first /generate request body and the text its answer shows."""
    text = (ROOT / "README.md").read_text()
    example = text[text.index("## Example") :]
    body = re.search(r"-d '(\{.*?\})'", example, re.S).group(1)
    answer = re.search(r"```json\n(.*?)```", example, re.S).group(1)
    return json.loads(body), re.search(r'"text": "(.*?)"', answer).group(1)


def worker_of(c, request_id: str) -> str:
    snap = c.client(c.admin_key).get(f"/v1/requests/{request_id}").json()
    assert snap["exec"].get("worker_id"), snap  # the worker it is (or was last) placed on
    return snap["exec"]["worker_id"]


def container_of(c, instance: str) -> dict:
    """The worker container whose hostname the instance id carries (worker-HOSTNAME-PID-RANDOM)."""
    (hit,) = [x for x in c.containers("worker") if instance.startswith(f"worker-{x['Config']['Hostname']}-")]
    return hit


def test_every_service_is_healthy_and_the_worker_runs_the_cpu_kernels(cluster):
    health = {
        x["Config"]["Labels"]["com.docker.compose.service"]: x["State"].get("Health", {}).get("Status")
        for x in cluster.containers()
    }
    assert all(health[s] == "healthy" for s in ("redis", *SERVICES)), health
    assert "CPU kernels loaded" in cluster.logs("worker")


def test_the_readmes_example_gets_the_readmes_answer(cluster):
    body, text = readme_example()
    r = cluster.client().post("/generate", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["text"] == text


def test_the_gateway_refuses_a_request_without_its_api_key(cluster):
    body, _ = readme_example()
    r = httpx.post(f"{cluster.url}/generate", json=body, timeout=30)
    assert r.status_code == 401


def test_published_ports_listen_on_this_machine_only(cluster):
    bound = [b for x in cluster.containers() for bs in (x["NetworkSettings"]["Ports"] or {}).values() for b in bs or []]
    assert bound and all(b["HostIp"] == "127.0.0.1" for b in bound), bound


def test_no_container_carries_the_redis_password_on_its_command_line(cluster):
    password = cluster.env["CONVEYOR_REDIS_PASSWORD"]
    for x in cluster.containers():
        assert password not in json.dumps(x["Config"]["Cmd"]) + json.dumps(x["Args"])
    top = cluster.docker("top", cluster.containers("redis")[0]["Id"])
    assert password not in top


def test_one_requests_trace_arrives_from_all_four_services(cluster):
    trace_id = os.urandom(16).hex()
    body, _ = readme_example()
    headers = {"traceparent": f"00-{trace_id}-{os.urandom(8).hex()}-01"}
    assert cluster.client().post("/generate", json=body, headers=headers).status_code == 200
    deadline, seen = time.monotonic() + 60, set()
    while time.monotonic() < deadline and len(seen) < len(SERVICES):
        spans = httpx.get(f"http://127.0.0.1:{cluster.sink_port}/spans", timeout=10).json()
        seen = {s["service"] for s in spans if s["trace_id"] == trace_id}
        time.sleep(1)
    assert seen == {f"conveyor-{s}" for s in SERVICES}


def test_scaled_workers_share_the_requests(cluster):
    started = time.monotonic()
    cluster("up", "-d", "--no-build", "--no-recreate", "--scale", "worker=2")
    cluster.wait_healthy({"worker": 2}, timeout_s=600)
    TIMINGS["second worker: scale to healthy"] = time.monotonic() - started
    # The KV-aware placement keeps a worker's cache warm until it holds CONVEYOR_ROUTING_BALANCE_ABS (16) more
    # requests than the idlest: a burst of 48 must spill onto the second worker.
    with cluster.client() as client, ThreadPoolExecutor(48) as pool:
        prompts = [{"prompt": f"Count to {i}:", "max_tokens": 8, "temperature": 0} for i in range(48)]
        answers = list(pool.map(lambda b: client.post("/generate", json=b), prompts))
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers if a.status_code != 200]
    workers = {worker_of(cluster, a.json()["request_id"]) for a in answers}
    assert len(workers) == 2, workers


def _stream(client: httpx.Client, body: dict, first_token: threading.Event, out: dict) -> None:
    with client.stream("POST", "/generate", json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                out.setdefault("request_id", event["request_id"])
                out.setdefault("tokens", []).extend(event.get("token_ids", []))
                out["final"] = event if "finish_reason" in event else None
                first_token.set()
    out["status"] = r.status_code


@pytest.mark.parametrize("max_tokens", [96])
def test_a_worker_container_killed_mid_request_restarts_and_its_request_completes(cluster, max_tokens):
    body = {
        "prompt": "Write a long story about a lighthouse keeper:",
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    reference = cluster.client().post("/generate", json=body).json()
    first_token, out = threading.Event(), {}
    t = threading.Thread(target=_stream, args=(cluster.client(), body, first_token, out))
    t.start()
    assert first_token.wait(120)
    victim = container_of(cluster, worker_of(cluster, out["request_id"]))
    os.kill(victim["State"]["Pid"], signal.SIGKILL)  # the container's PID 1: as an OOM kill would
    t.join(600)
    assert out["status"] == 200 and out["final"]["finish_reason"] == "length", out.get("final")
    assert out["tokens"] == reference["token_ids"]  # greedy: every token, none lost or repeated
    started = time.monotonic()
    cluster.wait_healthy({"worker": 2}, timeout_s=600)
    TIMINGS["killed worker container: back to healthy"] = time.monotonic() - started
    restarted = [x for x in cluster.containers("worker") if x["Id"] == victim["Id"]][0]
    assert restarted["RestartCount"] >= 1


def test_down_with_volumes_leaves_nothing_behind(cluster):
    cluster("down", "-v", "--remove-orphans", "-t", "30")
    label = f"label=com.docker.compose.project={cluster.project}"
    left = {kind: cluster.docker(kind, "ls", "-q", "--filter", label).split() for kind in ("volume", "network")}
    left["container"] = cluster.docker("ps", "-aq", "--filter", label).split()
    assert left == {"volume": [], "network": [], "container": []}
