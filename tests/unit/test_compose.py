"""docker-compose.yml, as far as it can be checked without a Docker engine."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from services.cli import parser
from shared import settings as s

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = {
    "gateway": s.GatewaySettings,
    "tokenizer": s.TokenizerSettings,
    "scheduler": s.SchedulerSettings,
    "worker": s.WorkerSettings,
}
OTEL_VARS = {"OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_PROTOCOL"}


def interpolate(value, shell: dict) -> str:
    """Compose's `${VAR:-default}` (and `${VAR}`) against the shell's variables, as `docker compose` does."""

    def sub(m):
        name, default = m.group(1), m.group(3) or ""
        return shell.get(name) or default

    return re.sub(r"\$\{(\w+)(:-([^}]*))?\}", sub, str(value))


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_compose_has_every_service(compose):
    assert set(compose["services"]) == {"redis", "jaeger", "gateway", "tokenizer", "scheduler", "worker"}


def test_redis_keeps_an_append_only_file_and_its_password_off_the_command_line(compose):
    redis = compose["services"]["redis"]
    cmd = " ".join(redis["command"])
    assert "--appendonly yes" in cmd and "requirepass" in cmd and "$$REDISCLI_AUTH" in cmd
    assert interpolate(redis["environment"]["REDISCLI_AUTH"], {}) not in cmd


def test_the_redis_probe_fails_on_an_error_reply(compose):
    assert "grep -qx PONG" in compose["services"]["redis"]["healthcheck"]["test"][-1]


def test_one_redis_password_for_the_server_and_every_service(compose):
    server = compose["services"]["redis"]["environment"]["REDISCLI_AUTH"]
    for service in SETTINGS:
        env = compose["services"][service]["environment"]
        assert env["CONVEYOR_REDIS_PASSWORD"] == server and "@" not in env["CONVEYOR_REDIS_URL"]


@pytest.mark.parametrize("service", sorted(SETTINGS))
def test_every_conveyor_service_has_its_own_healthcheck(compose, service):
    probe = ["CMD-SHELL", f'conveyor health {service} --dir "$$CONVEYOR_HEALTH_DIR"']
    assert compose["services"][service]["healthcheck"]["test"] == probe


@pytest.mark.parametrize("service", sorted(SETTINGS))
def test_every_conveyor_service_writes_the_health_file_its_probe_reads(compose, service):
    assert compose["services"][service]["environment"]["CONVEYOR_HEALTH_DIR"].startswith("/")


@pytest.mark.parametrize("service", sorted(SETTINGS))
def test_services_start_once_redis_is_healthy(compose, service):
    assert compose["services"][service]["depends_on"]["redis"]["condition"] == "service_healthy"


def _seconds(v: str) -> float:
    return float(v.removesuffix("s"))


def test_stop_grace_periods_outlast_the_drains(compose):
    svc = compose["services"]
    assert _seconds(svc["gateway"]["stop_grace_period"]) > s.GatewaySettings().shutdown_grace_s
    assert _seconds(svc["worker"]["stop_grace_period"]) > s.WorkerSettings().drain_timeout_s


def test_the_workers_cache_dir_is_a_named_volume(compose):
    (mount,) = compose["services"]["worker"]["volumes"]
    name, path = mount.split(":")
    assert name in compose["volumes"] and "CONVEYOR_CACHE_DIR=/cache" in (ROOT / "Dockerfile").read_text()
    assert path == "/cache"


def test_every_published_port_binds_loopback_unless_told_otherwise(compose):
    ports = [p for svc in compose["services"].values() for p in svc.get("ports", [])]
    assert ports and all(interpolate(p, {}).startswith("127.0.0.1:") for p in ports)
    assert all(interpolate(p, {"CONVEYOR_PUBLISH_ADDRESS": "0.0.0.0"}).startswith("0.0.0.0:") for p in ports)


@pytest.mark.parametrize("service", sorted(SETTINGS))
def test_service_command_is_a_real_conveyor_subcommand(compose, service):
    cmd = compose["services"][service]["command"]
    args = parser().parse_args(cmd)
    assert args.command == service


@pytest.mark.parametrize("service", sorted(SETTINGS))
def test_service_environment_names_real_settings(compose, service, monkeypatch):
    env = compose["services"][service]["environment"]
    fields = set(SETTINGS[service].model_fields)
    for var, value in env.items():
        if var in OTEL_VARS:
            continue
        assert var.startswith("CONVEYOR_"), var
        name = var.removeprefix("CONVEYOR_").lower()
        assert name in fields, f"{service}: {var} is not a setting"
        monkeypatch.setenv(var, interpolate(value, {}))
    SETTINGS[service]()  # the values validate


@pytest.mark.parametrize("shell, engine", [({}, "torch"), ({"CONVEYOR_ENGINE": "sim"}, "sim")])
def test_worker_engine_comes_from_the_shell_and_defaults_to_torch(compose, shell, engine, monkeypatch):
    monkeypatch.setenv(
        "CONVEYOR_ENGINE", interpolate(compose["services"]["worker"]["environment"]["CONVEYOR_ENGINE"], shell)
    )
    assert s.WorkerSettings().engine == engine


def test_gateway_port_is_published(compose):
    assert "127.0.0.1:8000:8000" in [interpolate(p, {}) for p in compose["services"]["gateway"]["ports"]]
    assert compose["services"]["gateway"]["environment"]["CONVEYOR_PORT"] == "8000"


def test_workers_can_scale_without_fixed_names_or_ports(compose):
    worker = compose["services"]["worker"]
    assert "container_name" not in worker and "ports" not in worker


def test_jaeger_is_v2_with_otlp_beyond_localhost_and_its_ui(compose):
    j = compose["services"]["jaeger"]
    assert interpolate(j["image"], {}).startswith("jaegertracing/jaeger:2")
    assert "receivers.otlp.protocols.http.endpoint=0.0.0.0:4318" in j["command"]
    assert {"127.0.0.1:16686:16686", "127.0.0.1:4318:4318"} <= {interpolate(p, {}) for p in j["ports"]}


def test_dockerfile_entrypoint_is_conveyor_with_the_cpu_torch_by_default():
    text = (ROOT / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["conveyor"]' in text and "torch==2.13.0" in text
    assert 'ARG TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"' in text
