"""`conveyor up` restarts a dead child after a delay that grows while it keeps dying at once (a crash loop), and
starts over once it had run a while: a process killed once a day must not wait 30 s on its tenth day."""

from __future__ import annotations

import subprocess
import time

from services.launcher import Child, Launcher


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
