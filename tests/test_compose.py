"""docker-compose.yml, as far as it can be checked without a Docker engine."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from services.cli import parser
from shared import settings as s

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = {"gateway": s.GatewaySettings, "tokenizer": s.TokenizerSettings, "scheduler": s.SchedulerSettings,
            "worker": s.WorkerSettings}
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


def test_redis_has_append_only_file_and_password(compose):
    cmd = compose["services"]["redis"]["command"]
    assert cmd[cmd.index("--appendonly") + 1] == "yes" and "--requirepass" in cmd


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
    monkeypatch.setenv("CONVEYOR_ENGINE", interpolate(compose["services"]["worker"]["environment"]["CONVEYOR_ENGINE"],
                                                      shell))
    assert s.WorkerSettings().engine == engine


def test_gateway_port_is_published(compose):
    assert "8000:8000" in compose["services"]["gateway"]["ports"]
    assert compose["services"]["gateway"]["environment"]["CONVEYOR_PORT"] == "8000"


def test_workers_can_scale_without_fixed_names_or_ports(compose):
    worker = compose["services"]["worker"]
    assert "container_name" not in worker and "ports" not in worker


def test_jaeger_is_v2_with_otlp_and_ui(compose):
    j = compose["services"]["jaeger"]
    assert j["image"].startswith("jaegertracing/jaeger:2")
    assert {"16686:16686", "4317:4317", "4318:4318"} <= set(j["ports"])


def test_dockerfile_entrypoint_is_conveyor():
    text = (ROOT / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["conveyor"]' in text and "torch==2.13.0" in text
