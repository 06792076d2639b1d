"""The health file's reader, and the setting that names its folder."""

from __future__ import annotations

from shared.process import health_file
from shared.wire.constants import Names
from shared.process.runtime import Liveness
from shared.settings import CommonSettings


def test_the_health_dir_setting_is_the_variable_the_compose_probes_pass_on(monkeypatch, tmp_path):
    monkeypatch.setenv("CONVEYOR_HEALTH_DIR", str(tmp_path))
    assert CommonSettings().health_dir == str(tmp_path)


def test_a_file_with_a_time_ahead_is_healthy_and_one_behind_is_not(tmp_path):
    health_file.write(str(tmp_path), "worker", 100.0)
    assert health_file.check("worker", str(tmp_path), now=99.0)[0]
    ok, why = health_file.check("worker", str(tmp_path), now=101.5)
    assert not ok and "lapsed 1.5 s ago" in why


def test_a_file_that_is_not_a_number_is_unhealthy_saying_so(tmp_path):
    (tmp_path / "scheduler").write_text("")
    ok, why = health_file.check("scheduler", str(tmp_path))
    assert not ok and "unreadable" in why


def test_a_health_folder_that_cannot_be_written_never_fails_the_service(tmp_path, caplog):
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    live = Liveness(Names("t", 1, False), "tokenizer", "tok-1", 1.0, 5.0, str(blocked))
    live.written()
    live.written()
    assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1  # said once, not per beat
    assert "cannot write its health file" in caplog.records[0].message
