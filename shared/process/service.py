"""The parts every bus service (tokenizer, scheduler, worker) builds the same way, built once here.

A service subclasses BusService and names its kind; its own objects (an engine, a queue) come after. The gateway is
not one: it is asynchronous and answers HTTP (services/gateway/session/core.py builds its own async clients).
"""

from __future__ import annotations

from shared.wire.bus import Bus, DeadHandler
from shared.state.context_store import ContextStore
from shared.state.lifecycle import Lifecycle
from shared.redis_io.redis_client import sync_client
from shared.process.runtime import instance_id
from shared.settings import CommonSettings


class BusService:
    kind: str  # "tokenizer", "scheduler", "worker": its consumer names, its lifecycle writes' service field

    def __init__(self, settings: CommonSettings, on_dead: DeadHandler | None = None):
        self.s = settings
        self.names = settings.names()
        self.r = sync_client(settings)
        self.id = instance_id(settings, self.kind)
        self.bus = Bus(
            self.r,
            self.names,
            self.id,
            settings.read_block_ms,
            settings.claim_idle_ms,
            settings.max_deliveries,
            on_dead=on_dead,
        )
        self.lifecycle = Lifecycle(self.r, self.names, self.kind, settings.context_ttl_s)
        self.store = ContextStore(self.r, self.names, settings.context_ttl_s)
