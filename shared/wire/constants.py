"""Every stream, consumer-group and key name, in one place.

All names live under a namespace (setting CONVEYOR_NAMESPACE), so tests and several
clusters can share one Redis without seeing each other. Request keys carry their partition's
hash tag, so a request's keys and the indexes its transitions update sit in one Redis Cluster slot.
"""

from __future__ import annotations

import binascii
import zlib
from dataclasses import dataclass
from functools import cached_property

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
# (shared/state/context_store.py creates, shared/state/lifecycle.py moves), in the same atomic step. Readers (the dashboard)
# only follow its tail, so a few minutes of transitions at a high rate are plenty; older ones are trimmed.
LIFECYCLE_FEED_MAXLEN = 10_000
# Its flat fields, in the order the scripts write them (every record has all of them: Redis then stores the
# names once per listpack node, not once per record).
# `session`: set on a conversation session's move only (shared.state.sessions; its from/to are session states), "" on a
# request's transition.
LIFECYCLE_FEED_FIELDS = ("rid", "from", "to", "reason", "service", "at", "owner", "worker", "attempt", "session")


# Redis Cluster (issue 16): a multi-key command or script may only touch keys of one hash slot. Everything a
# request's transitions touch together therefore lives under one hash tag: that of its PARTITION (a stable hash
# of the request id, see Names.partition). A partition holds its requests' keys and the indexes and streams
# their scripts update in the same atomic step (state sets, waiting set, lifecycle feed, received and
# preprocessed streams, counters...). A process's own streams (a worker's inbox, a gateway's replies) and the
# low-rate shared ones (control, heartbeats, KV events, dead letters) each sit on a slot of their own. On a
# single Redis there is one partition and nothing changes but the names.
SLOTS = 16384
# Partitions on a cluster when the setting leaves it to us: enough to spread over a few masters evenly.
CLUSTER_PARTITIONS = 16


def _crc16_slot(tag: str) -> int:
    return binascii.crc_hqx(tag.encode(), 0) % SLOTS


def key_slot(key: str) -> int:
    """The Redis Cluster slot of a key (its hash tag's, when it has a non-empty one)."""
    start = key.find("{")
    if start >= 0:
        end = key.find("}", start + 1)
        if end > start + 1:
            key = key[start + 1 : end]
    return _crc16_slot(key)


def partition_tags(n: int) -> tuple[str, ...]:
    """One hash tag per partition, partition k's slot in the k-th n-th of the slot space: a cluster whose
    masters own equal contiguous slot ranges (what `redis-cli --cluster create` makes) gets an equal share of
    partitions on each master, where tags like p0..p15 would fall where their CRC16 happens to."""
    tags = []
    for k in range(n):
        lo, hi = k * SLOTS // n, (k + 1) * SLOTS // n
        i = 0
        while not lo <= _crc16_slot(f"{k}.{i}") < hi:
            i += 1
        tags.append(f"{k}.{i}")
    return tuple(tags)


@dataclass(frozen=True)
class Names:
    """Stream and key names of one namespace split into `partitions` partitions (1 on a single Redis)."""

    ns: str = "conveyor"
    partitions: int = 1
    # On a Redis Cluster a script may only write keys of its own slot: events to a stream of another slot are
    # published right after the transition instead of inside it (see shared.state.lifecycle).
    cluster: bool = False

    def __post_init__(self):
        if self.partitions < 1:
            raise ValueError(f"partitions must be >= 1, got {self.partitions}")

    @cached_property
    def _tags(self) -> tuple[str, ...]:
        return partition_tags(self.partitions)

    def partition(self, request_id: str) -> int:
        """The partition a request belongs to, for its whole life (a stable hash of its id)."""
        return zlib.crc32(request_id.encode()) % self.partitions if self.partitions > 1 else 0

    @property
    def all_partitions(self) -> range:
        return range(self.partitions)

    def _p(self, p: int) -> str:  # the partition's prefix: namespace + hash tag
        return f"{self.ns}:{{{self._tags[p]}}}"

    def slot_groups(self, keys: list[str]) -> list[list[str]]:
        """keys grouped so that one multi-key command may take each group: all of them on a single Redis, one
        group per hash slot on a cluster."""
        if not self.cluster:
            return [keys] if keys else []
        groups: dict[int, list[str]] = {}
        for key in keys:
            groups.setdefault(key_slot(key), []).append(key)
        return list(groups.values())

    def colocated(self, key: str, p: int) -> bool:
        """Whether one script may touch `key` together with partition p's keys: always on a single Redis; on
        a cluster, when the key hashes to the partition's slot."""
        return not self.cluster or key_slot(key) == _crc16_slot(self._tags[p])

    # --- per partition (one slot each): a request's scripts touch these with its own keys -------------------
    def received_stream(self, p: int) -> str:  # request_received: gateway -> tokenizer
        return f"{self._p(p)}:stream:received"

    def preprocessed_stream(self, p: int) -> str:  # preprocessed: tokenizer -> scheduler
        return f"{self._p(p)}:stream:preprocessed"

    def lifecycle_feed(self, p: int) -> str:  # one record per transition, written only by the lifecycle scripts
        return f"{self._p(p)}:stream:lifecycle"

    def requests_index(self, p: int) -> str:  # sorted set: request id -> creation time (listing, eviction)
        return f"{self._p(p)}:requests"

    def state_set(self, p: int, state: str) -> str:  # sorted set of request ids in that state -> time they entered
        return f"{self._p(p)}:state:{state}"

    def waiting(self, p: int) -> str:  # sorted set: requests not yet on a worker (RECEIVED..QUEUED) -> creation time
        return f"{self._p(p)}:waiting"

    def owner_waiting(self, p: int) -> str:
        """Sorted set, all scores 0, members `owner NUL request id`: each API key's waiting requests (per-key
        bounds count them with ZLEXCOUNT). One key per partition, not per owner: a script only touches keys
        passed in KEYS, and the caller of a transition does not know the request's owner; the script does."""
        return f"{self._p(p)}:ownerwaiting"

    def owner_index(self, p: int, owner: str) -> str:  # sorted set: one API key's request ids -> creation time
        return f"{self._p(p)}:owner:{owner}:requests"

    def request_owners(self, p: int) -> str:  # hash: request id -> owner, for requests with one (janitor's lookup)
        return f"{self._p(p)}:owners"

    def queue(self, p: int) -> str:  # hash: request id -> preprocessed event, for every QUEUED request
        return f"{self._p(p)}:queue"

    def queue_changes(self, p: int) -> str:  # stream: ids whose queue record a scheduler wrote (replicas' sync)
        return f"{self._p(p)}:queue:changes"

    def assigned(self, p: int) -> str:
        """Hash: request id -> its placement on a worker (the schedulers' memory, in Redis). Per partition, in the
        slot of its requests' keys: recording a placement, dropping its queue record and checking its attempt are
        one script (services/scheduler/assignments.py)."""
        return f"{self._p(p)}:assigned"

    def assigned_changes(self, p: int) -> str:  # stream: ids whose placement a scheduler wrote (replicas' sync)
        return f"{self._p(p)}:assigned:changes"

    def counters(self, p: int) -> str:  # hash of counters (settlement no-ops, dead letters): sum the partitions
        return f"{self._p(p)}:counters"

    # --- one request's keys: its partition's hash tag, so they share a slot with the partition's indexes -------
    def layer(self, request_id: str, layer: str) -> str:
        return f"{self._p(self.partition(request_id))}:req:{request_id}:{layer}"

    def history(self, request_id: str) -> str:
        return self.layer(request_id, "history")

    def tokens(self, request_id: str) -> str:  # list: every output token so far (a moved request resumes after it)
        return self.layer(request_id, "tokens")

    def request_keys(self, request_id: str) -> list[str]:
        """meta, input, exec, kv, output, history, tokens: the order the lifecycle script expects."""
        return [self.layer(request_id, layer) for layer in LAYERS] + [self.history(request_id), self.tokens(request_id)]

    # --- one slot each ---------------------------------------------------------------------------------------
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
    def dead_letter_stream(self) -> str:  # events that failed max_deliveries times
        return f"{self.ns}:stream:dead"

    def worker_stream(self, worker_id: str) -> str:  # scheduled + cancel: scheduler -> one worker
        return f"{self.ns}:stream:worker:{{{worker_id}}}"

    def reply_stream(self, gateway_id: str) -> str:  # tokens and endings -> one gateway
        return f"{self.ns}:stream:reply:{{{gateway_id}}}"

    def is_private_stream(self, stream: str) -> bool:
        return stream.startswith((f"{self.ns}:stream:worker:", f"{self.ns}:stream:reply:"))

    def live_hash(self, service: str) -> str:  # hash: instance -> JSON {at, ...}; one per service kind (no SCAN)
        return f"{self.ns}:livehash:{service}"

    # --- conversation sessions: one slot per owner (an API key), its sessions and their index together ---------
    def session(self, owner: str, session_id: str) -> str:
        """Hash: one session (shared.state.sessions). Keyed by its owner too: two API keys' sessions never collide, and
        another key cannot even name it."""
        return f"{self._session_prefix(owner)}:s:{session_id}"

    def sessions_index(self, owner: str) -> str:  # sorted set: the owner's session ids -> time of their last move
        return f"{self._session_prefix(owner)}:index"

    @staticmethod
    def index_of_session(session_key: str) -> str:
        """The index key of the owner a session key belongs to (a worker has the key only)."""
        return session_key[: session_key.rindex(":s:")] + ":index"

    @staticmethod
    def owner_of_session(session_key: str) -> str:
        """The owner (API key id, "" without keys) a session key belongs to."""
        owner = session_key[session_key.index("{sess:") + 6 : session_key.rindex("}:s:")]
        return "" if owner == "-" else owner

    def _session_prefix(self, owner: str) -> str:
        return f"{self.ns}:{{sess:{owner or '-'}}}"

    # --- stored responses (/v1/responses): one slot per owner, as its sessions ---------------------------------
    def response(self, owner: str, response_id: str) -> str:
        """String: one stored response (services/gateway/responses/store.py). Keyed by its owner: another API key
        cannot even name it, so for that key it does not exist (404)."""
        return f"{self.ns}:{{resp:{owner or '-'}}}:r:{response_id}"

    def response_events(self, owner: str, response_id: str) -> str:  # stream: a background response's events
        return f"{self.response(owner, response_id)}:events"

    def responses_driving(self) -> str:
        """Sorted set, every score 0 (read by lex): `gateway\\0owner\\0response_id` of each background response
        running, under the gateway that drives it: what a gateway's takeover sweep reads, a range per dead gateway."""
        return f"{self.ns}:responses:driving"

    @property
    def epoch(self) -> str:  # random value set once per Redis dataset: a changed or missing one means data loss
        return f"{self.ns}:epoch"


def private_stream_ttl(names: Names, stream: str) -> int:
    """TTL a write to `stream` sets (0: none, a shared stream)."""
    return PRIVATE_STREAM_TTL_S if names.is_private_stream(stream) else 0
