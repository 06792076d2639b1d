"""Every stream, consumer-group and key name, in one place.

All names live under a namespace (setting CONVEYOR_NAMESPACE), so tests and several
clusters can share one Redis without seeing each other. Request keys carry the request id
in a hash tag ({id}) so one request's layers would sit in one Redis Cluster slot.
"""

from __future__ import annotations

from dataclasses import dataclass

# Consumer groups: one per kind of consumer. Replicas of a service share their group.
GROUP_TOKENIZER = "tokenizer"
GROUP_SCHEDULER = "scheduler"
GROUP_WORKER = "worker"
GROUP_GATEWAY = "gateway"

# The five layers of a request's context, one Redis hash each.
LAYERS = ("meta", "input", "exec", "kv", "output")

# Field of a stream entry holding the msgpack-encoded event.
EVENT_FIELD = b"e"

# Streams are trimmed (approximately) to this many entries; consumers are far faster.
STREAM_MAXLEN = 100_000
HEARTBEAT_MAXLEN = 1_000
# Workers' KV events (one entry per engine step that changed a prefix cache). A reader that finds a gap in a
# worker's sequence (trimmed away before it read them) asks that worker for a full announcement instead.
KV_EVENTS_MAXLEN = 10_000
# A process's own stream (a worker's inbox, a gateway's replies) is refreshed to this TTL by its owner at every
# heartbeat and by every write to it, so the stream of a process that died disappears by itself this long after
# the last write; the shared streams (received, preprocessed, control) have no TTL.
PRIVATE_STREAM_TTL_S = 300
# The lifecycle change feed (issue 14): one record per transition, appended only by the scripts that make them
# (shared/context_store.py creates, shared/lifecycle.py moves), in the same atomic step. Readers (the dashboard)
# only follow its tail, so a few minutes of transitions at a high rate are plenty; older ones are trimmed.
LIFECYCLE_FEED_MAXLEN = 10_000
# Its flat fields, in the order the scripts write them (every record has all of them: Redis then stores the
# names once per listpack node, not once per record).
LIFECYCLE_FEED_FIELDS = ("rid", "from", "to", "reason", "service", "at", "owner", "worker", "attempt")

SERVICES = ("gateway", "tokenizer", "scheduler", "worker")


@dataclass(frozen=True)
class Names:
    """Stream and key names of one namespace."""

    ns: str = "conveyor"

    @property
    def received_stream(self) -> str:  # request_received: gateway -> tokenizer
        return f"{self.ns}:stream:received"

    @property
    def preprocessed_stream(self) -> str:  # preprocessed: tokenizer -> scheduler
        return f"{self.ns}:stream:preprocessed"

    @property
    def control_stream(self) -> str:  # cancel requests: gateway -> scheduler
        return f"{self.ns}:stream:control"

    @property
    def heartbeat_stream(self) -> str:  # worker heartbeats -> scheduler
        return f"{self.ns}:stream:heartbeat"

    @property
    def kv_events_stream(self) -> str:  # kv_events: workers -> every scheduler replica (plain XREAD)
        return f"{self.ns}:stream:kv"

    @property
    def lifecycle_feed(self) -> str:  # one record per transition, written only by the lifecycle scripts
        return f"{self.ns}:stream:lifecycle"

    @property
    def dead_letter_stream(self) -> str:  # events that failed max_deliveries times
        return f"{self.ns}:stream:dead"

    def worker_stream(self, worker_id: str) -> str:  # scheduled + cancel: scheduler -> one worker
        return f"{self.ns}:stream:worker:{worker_id}"

    def reply_stream(self, gateway_id: str) -> str:  # tokens and endings -> one gateway
        return f"{self.ns}:stream:reply:{gateway_id}"

    def is_private_stream(self, stream: str) -> bool:
        return stream.startswith((f"{self.ns}:stream:worker:", f"{self.ns}:stream:reply:"))

    def layer(self, request_id: str, layer: str) -> str:
        return f"{self.ns}:req:{{{request_id}}}:{layer}"

    def history(self, request_id: str) -> str:
        return f"{self.ns}:req:{{{request_id}}}:history"

    def tokens(self, request_id: str) -> str:  # list: every output token so far (a moved request resumes after it)
        return f"{self.ns}:req:{{{request_id}}}:tokens"

    def request_keys(self, request_id: str) -> list[str]:
        """meta, input, exec, kv, output, history, tokens: the order the lifecycle script expects."""
        return [self.layer(request_id, layer) for layer in LAYERS] + [self.history(request_id),
                                                                      self.tokens(request_id)]

    @property
    def requests_index(self) -> str:  # sorted set: request id -> creation time (listing, eviction)
        return f"{self.ns}:requests"

    @property
    def state_prefix(self) -> str:  # + STATE: sorted set of request ids in that state -> time they entered it
        return f"{self.ns}:state:"

    def state_set(self, state: str) -> str:
        return f"{self.state_prefix}{state}"

    @property
    def waiting(self) -> str:  # sorted set: requests not yet on a worker (RECEIVED..QUEUED) -> creation time
        return f"{self.ns}:waiting"

    @property
    def assigned(self) -> str:  # hash: request id -> its placement on a worker (scheduler's memory, in Redis)
        return f"{self.ns}:assigned"

    @property
    def queue(self) -> str:  # hash: request id -> preprocessed event, for every QUEUED request
        return f"{self.ns}:queue"

    def live_hash(self, service: str) -> str:  # hash: instance -> JSON {at, ...}; one per service kind (no SCAN)
        return f"{self.ns}:livehash:{service}"

    def owner_index(self, owner: str) -> str:  # sorted set: one API key's request ids -> creation time (listing)
        return f"{self.ns}:owner:{owner}:requests"

    def owner_waiting(self, owner: str) -> str:  # sorted set: one API key's waiting requests (per-key fairness)
        return f"{self.ns}:owner:{owner}:waiting"

    @property
    def request_owners(self) -> str:  # hash: request id -> owner, for requests with one (the janitor's reverse lookup)
        return f"{self.ns}:owners"

    @property
    def owner_waiting_prefix(self) -> str:  # lifecycle script: + owner + OWNER_WAITING_SUFFIX
        return f"{self.ns}:owner:"

    @property
    def epoch(self) -> str:  # random value set once per Redis dataset: a changed or missing one means data loss
        return f"{self.ns}:epoch"

    @property
    def counters(self) -> str:  # hash of cluster-wide counters (settlement no-ops, dead letters)
        return f"{self.ns}:counters"


def private_stream_ttl(names: Names, stream: str) -> int:
    """TTL a write to `stream` sets (0: none, a shared stream)."""
    return PRIVATE_STREAM_TTL_S if names.is_private_stream(stream) else 0
