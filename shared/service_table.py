"""The services, written once: their names in start order, their settings, how each is run and judged healthy.

The launcher starts them in this order, the CLI names its commands after them, the health probe and the
gateway's readiness check read which are judged by their liveness entries. Entry points are named, not
imported: running one service never imports another's code (a tokenizer never loads torch), and shared/ never
imports services/.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared import settings as s


@dataclass(frozen=True)
class ServiceSpec:
    name: str
    settings: type[s.CommonSettings]
    entry: str = ""  # "module:class" of a bus service, built from its settings and run(); "" for the HTTP gateway
    http: bool = False  # judged by its own /health; the others by their liveness entries in Redis


# Start order: the gateway last, as its /ready waits for the others.
SERVICES: dict[str, ServiceSpec] = {
    spec.name: spec
    for spec in (
        ServiceSpec("tokenizer", s.TokenizerSettings, "services.tokenizer.service:TokenizerService"),
        ServiceSpec("scheduler", s.SchedulerSettings, "services.scheduler.service:SchedulerService"),
        ServiceSpec("worker", s.WorkerSettings, "services.worker.service:WorkerService"),
        ServiceSpec("gateway", s.GatewaySettings, http=True),
    )
}

# Those without an HTTP port: live while their liveness entries are fresh.
BUS_SERVICES = tuple(name for name, spec in SERVICES.items() if not spec.http)
