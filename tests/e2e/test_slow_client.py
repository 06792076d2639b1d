"""A streaming client that stops reading is dropped after one write waited CONVEYOR_SSE_WRITE_TIMEOUT_S: its
request is cancelled and the gateway keeps nothing of it (no slot, no handle, no buffered output)."""

from __future__ import annotations

import json
import socket
from urllib.parse import urlparse

import httpx

from tests.support.cluster import cluster_fixture
from tests.support.sim_reference import SIM
from tests.support.waiting import wait_for

WRITE_TIMEOUT_S = 2


cluster = cluster_fixture(
    "slowclient", env={**SIM, "CONVEYOR_SIM_SPEEDUP": "50", "CONVEYOR_SSE_WRITE_TIMEOUT_S": str(WRITE_TIMEOUT_S)}
)


def _stream_and_stop_reading(url: str) -> tuple[socket.socket, str]:
    """Send a streaming request whose events are large (20 log probabilities per token) from a socket with a
    tiny receive buffer; read its response head, then nothing more. Returns the socket and the request id."""
    u = urlparse(url)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((u.hostname, u.port))
    body = json.dumps(
        {
            "prompt": "Tell me everything:",
            "max_tokens": 4096,
            "ignore_eos": True,
            "logprobs": 20,
            "stream": True,
            "temperature": 0,
        }
    )
    sock.sendall(
        f"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n{body}".encode()
    )
    head = b""
    while b"\r\n\r\n" not in head:
        head += sock.recv(1)
    rid = next(
        line.split(":", 1)[1].strip()
        for line in head.decode().split("\r\n")
        if line.lower().startswith("x-request-id:")
    )
    return sock, rid


def _open_requests(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return float(
        next(line.split()[-1] for line in text.splitlines() if line.startswith("conveyor:gateway_open_requests "))
    )


def test_a_streaming_client_that_stops_reading_is_dropped_and_its_request_cancelled(cluster):
    sock, rid = _stream_and_stop_reading(cluster.url)
    try:
        state = wait_for(lambda: _ended(cluster.url, rid), 120, 0.2, "the request ended")
        assert state == "CANCELLED"
        wait_for(lambda: _open_requests(cluster.url) == 0, 30, 0.2, "the gateway released the request")
    finally:
        sock.close()


def _ended(url: str, rid: str) -> str | None:
    state = httpx.get(f"{url}/v1/requests/{rid}", timeout=10).json()["state"]
    return state if state in ("FINISHED", "CANCELLED", "FAILED", "TIMED_OUT") else None
