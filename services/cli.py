"""The `conveyor` command: `conveyor up` runs a local cluster; `conveyor <service>` runs one service.

Each command imports what it needs when it runs: `conveyor health`, a container's healthcheck every 10 s, imports
the standard library and two small modules (shared.process.health_file), not redis-py nor the settings (0.4-0.6 s of CPU).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from shared.process.service_table import SERVICES

logger = logging.getLogger(__name__)

SERVICE_NAMES = tuple(SERVICES)


def run_service(name: str, restart: bool = False) -> int:
    """Run one service in this process; restart: first start the process again with the variables read at a start
    that its environment lacks (settings.start_environment), as a command line does (not a caller in a test)."""
    from shared.process import telemetry
    from shared.process.runtime import setup_logging
    from shared.settings import restart_with, set_library_environment

    spec = SERVICES[name]
    cfg = spec.settings()
    if restart and (missing := cfg.start_environment()):
        restart_with(missing)
    set_library_environment(cfg.library_environment())  # before the service's module loads torch (the worker's)
    if spec.http:
        from services.gateway.app import create_app
        from services.gateway.edge.server import serve

        setup_logging(cfg.log_level)
        telemetry.setup(name, cfg)
        try:
            serve(create_app(cfg), cfg)
        finally:
            telemetry.shutdown()  # flush the spans still buffered
        return 0
    module, cls = spec.entry.split(":")
    Service = getattr(importlib.import_module(module), cls)
    setup_logging(cfg.log_level)
    telemetry.setup(name, cfg)
    try:
        Service(cfg).run()
    finally:
        telemetry.shutdown()  # flush the spans still buffered
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="conveyor", description="Conveyor: an LLM inference server on an event bus")
    sub = p.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="run a whole local cluster in the foreground")
    up.add_argument("--port", type=int, default=8000, help="gateway HTTP port (default 8000)")
    up.add_argument("--host", default="127.0.0.1", help="gateway bind address")
    up.add_argument("--workers", type=int, default=1, help="number of worker processes")
    up.add_argument(
        "--engine",
        choices=("torch", "sim"),
        default=None,
        help="the workers' engine: torch runs the model, sim simulates its steps without weights "
        "(sets CONVEYOR_ENGINE for the workers; default: CONVEYOR_ENGINE, else torch)",
    )
    up.add_argument("--redis-url", default=None, help="use this Redis instead of starting one")
    up.add_argument(
        "--redis-cluster",
        action="store_true",
        help="the Redis at --redis-url is one node of a Redis Cluster (sets CONVEYOR_REDIS_CLUSTER for "
        "every service; `conveyor up` does not start a cluster, so --redis-url is required)",
    )
    up.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for /ready")
    for name in SERVICE_NAMES:
        sub.add_parser(name, help=f"run one {name} (settings from CONVEYOR_* environment variables)")
    health = sub.add_parser(
        "health",
        help="exit 0 while this host's SERVICE has a live liveness entry (a container healthcheck; reads "
        "the health file its process writes in --dir)",
    )
    health.add_argument("service", choices=SERVICE_NAMES)
    health.add_argument("--dir", required=True, help="the services' health_dir setting (CONVEYOR_HEALTH_DIR)")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.command == "up":
        if args.redis_cluster and not args.redis_url:
            p.error(
                "--redis-cluster needs --redis-url: the address of one node of a running Redis Cluster "
                "(conveyor up does not start a cluster)"
            )
        from services.launcher import Launcher

        return Launcher(args).run()
    if args.command == "health":
        from shared.process.health_file import check

        ok, why = check(args.service, args.dir)
        sys.stdout.write(why + "\n")  # what `docker inspect` shows as the probe's output
        return 0 if ok else 1
    return run_service(args.command, restart=argv is None)


if __name__ == "__main__":
    sys.exit(main())
