"""The services, written once: their names in start order, their settings, how each is run.

The launcher starts them in this order, the CLI names its commands (and the health probe its services) after
them, the gateway's readiness check reads which it judges by their liveness entries. Entry points are named, not
imported: running one service never imports another's code (a tokenizer never loads torch), and shared/ never
imports services/. Importing the table imports no settings either (`settings` resolves a class by name when
read): the container healthcheck (`conveyor health`) names services without paying pydantic's import.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class ServiceSpec:
    name: str
    settings_class: str  # its settings class's name in shared.settings
    entry: str = ""  # "module:class" of a bus service, built from its settings and run(); "" for the HTTP gateway
    http: bool = False  # serves HTTP (the gateway, whose /ready counts the others' liveness entries)

    @property
    def settings(self) -> type:
        return getattr(importlib.import_module("shared.settings"), self.settings_class)


# Start order: the gateway last, as its /ready waits for the others.
SERVICES: dict[str, ServiceSpec] = {
    spec.name: spec
    for spec in (
        ServiceSpec("tokenizer", "TokenizerSettings", "services.tokenizer.service:TokenizerService"),
        ServiceSpec("scheduler", "SchedulerSettings", "services.scheduler.service:SchedulerService"),
        ServiceSpec("worker", "WorkerSettings", "services.worker.service:WorkerService"),
        ServiceSpec("gateway", "GatewaySettings", http=True),
    )
}

# Those without an HTTP port: /ready wants a live entry of each.
BUS_SERVICES = tuple(name for name, spec in SERVICES.items() if not spec.http)
