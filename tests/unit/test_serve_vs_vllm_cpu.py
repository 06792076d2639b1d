"""benchmarks.peer.serve_vs_vllm's CPU accounting around a round: the server measured, the other one idling beside it
and the client, each apart, read from real processes."""

import subprocess
import sys

import psutil
import pytest

from benchmarks.peer.serve_vs_vllm import measured

pytestmark = pytest.mark.unit

BURN = [sys.executable, "-c", "sum(range(20_000_000))"]  # ~0.5 s of one core: a client's work


class Server:
    """What measured() reads of a server: its processes by role."""

    def __init__(self, code: str):
        self.proc = subprocess.Popen([sys.executable, "-c", code])

    def processes(self) -> dict[str, psutil.Process]:
        return {"main": psutil.Process(self.proc.pid)}


@pytest.fixture
def servers():
    out = {"conveyor": Server("import time; time.sleep(600)"), "vllm": Server("while True: pass")}
    yield out
    for s in out.values():
        s.proc.kill()
        s.proc.wait()


def client() -> dict:
    subprocess.run(BURN, check=True)
    return {"completed": 1}


def test_a_round_counts_the_cpu_of_the_server_idling_beside_it(servers):
    res = measured("conveyor", servers, client)
    assert res["idle_peer_cpu_s"] >= 0.1, res  # the spinning one, idle for this round's purposes
    assert res["cpu_s"]["main"] < res["idle_peer_cpu_s"], res


def test_a_round_counts_its_clients_cpu(servers):
    res = measured("conveyor", servers, client)
    assert res["client_cpu_s"] >= 0.1, res


def test_a_vllm_round_counts_vllms_processes_in_all(servers):
    res = measured("vllm", servers, client)
    assert res["cpu_s"] >= 0.1 and res["idle_peer_cpu_s"] < res["cpu_s"], res
