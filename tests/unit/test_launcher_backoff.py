"""`conveyor up` restarts a dead child after a delay that grows while it keeps dying at once (a crash loop), and
starts over once it had run a while: a process killed once a day must not wait 30 s on its tenth day; while the
cluster starts it waits for /ready cheaply."""

from __future__ import annotations

import http.server
import subprocess
import threading
import time
from types import SimpleNamespace

import httpx

from services import launcher as launcher_module
from services.launcher import Child, Launcher
from shared.process.runtime import StopFlag


def _launcher_with(child: Child) -> Launcher:
    launcher = Launcher.__new__(Launcher)  # only its supervision, not a cluster
    launcher.children = [child]
    return launcher


def _dead_child(restarts: int, ran_s: float) -> Child:
    c = Child("tokenizer", {}, proc=subprocess.Popen(["true"]), restarts=restarts)
    c.proc.wait()
    c.started_at = time.monotonic() - ran_s
    return c


def test_a_child_that_dies_at_once_again_and_again_waits_longer_each_time():
    c = _dead_child(restarts=4, ran_s=0.5)
    _launcher_with(c)._restart_dead()
    assert c.next_start - time.monotonic() > 10  # 2**4 s


def test_a_child_that_ran_a_while_before_dying_is_restarted_at_once_whatever_its_past():
    c = _dead_child(restarts=4, ran_s=600)
    _launcher_with(c)._restart_dead()
    assert c.next_start - time.monotonic() <= 1.0


def test_waiting_for_the_cluster_polls_ready_through_one_http_client(monkeypatch):
    """Each new client loads the CA bundle for TLS (~35 ms of CPU): a fresh one per poll, twice a second, kept
    ~8 % of a core busy beside the worker measuring its GEMM plans at start. One client serves every poll."""
    answers = iter([503, 503, 503, 200])

    class Ready(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(next(answers))
            self.end_headers()

        def log_message(self, *args):
            return None  # the test's server answers quietly

    server = http.server.HTTPServer(("127.0.0.1", 0), Ready)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    made = []
    real_init = httpx.Client.__init__

    def counted_init(self, *args, **kwargs):
        made.append(self)
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(httpx.Client, "__init__", counted_init)
    monkeypatch.setattr(launcher_module, "READY_POLL_S", 0.01, raising=False)
    launcher = Launcher.__new__(Launcher)  # only its wait, no children to start or restart
    launcher.children = []
    launcher.args = SimpleNamespace(host="127.0.0.1", port=server.server_address[1], ready_timeout=30.0)
    try:
        assert launcher._wait_ready(StopFlag())
    finally:
        server.shutdown()
    assert len(made) == 1
