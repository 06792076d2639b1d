"""Validated settings, read once from the environment (prefix CONVEYOR_).

Every service has exactly one settings class here (a subclass of CommonSettings; the worker's in worker.py); nothing
outside this package reads the environment (environment.py: the raw variables a process passes on or that other libraries read).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AliasChoices, Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from shared.settings.environment import (  # noqa: F401 - re-exported: shared.settings is where the environment is read
    LIBRARY_ISA_VARIABLES,
    child_environment,
    library_isa_limits,
    omp_environment,
    restart_with,
    set_library_environment,
    start_environment,
    this_pythons_bin_on_path,
)


# An instance id is part of stream names and, in braces, of a hash tag: ':' ends the part the scheduler reads a
# gateway's id back from, '{' or '}' move the tag. It was read as a gateway gone, and its requests cancelled.
INSTANCE_ID = re.compile(r"[A-Za-z0-9._-]{1,128}")


# The engine's C++ CPU kernel variants, best first (services/worker/engine/cpu/cpu_ops.py builds and picks one).
CPU_ISAS = ("avx512", "avx2", "portable")
CpuIsa = Literal["auto", "avx512", "avx2", "portable"]


def _default_cache_dir() -> Path:
    return Path.home() / ".cache" / "conveyor"


class CommonSettings(BaseSettings):
    """Settings every service shares."""

    model_config = SettingsConfigDict(env_prefix="CONVEYOR_", extra="ignore")

    redis_url: str = Field("redis://127.0.0.1:6379/0", description="Redis holding the streams and contexts")
    redis_password: SecretStr = Field(
        SecretStr(""), description="Redis AUTH password when redis_url has none (kept out of URLs, logs); empty = none"
    )
    redis_cluster: bool = Field(
        False,
        description="the Redis at redis_url is one node of a Redis Cluster; every "
        "service uses redis-py's cluster clients, which discover the other nodes from it",
    )
    redis_partitions: int = Field(
        0,
        ge=0,
        le=1024,
        description="streams and indexes are split into this many "
        "partitions, each on its own hash slot; 0 = auto: 1 on a single Redis, 16 on a "
        "cluster",
    )
    namespace: str = Field("conveyor", description="prefix of every stream and key; tests use a fresh one")
    model: str = Field("", description="local HF model folder or .gguf file; empty = bundled SmolLM2-135M GGUF")
    model_name: str = Field("", description="name reported to clients; empty = derived from the model path")
    cache_dir: Path = Field(default_factory=_default_cache_dir, description="where converted models are cached")
    log_level: str = Field("INFO", description="logging level of the process")
    malloc_huge_pages: bool = Field(
        True,
        description="glibc's malloc advises its memory for transparent huge pages (GLIBC_TUNABLES="
        "glibc.malloc.hugetlb=1; a service started without it starts itself again with it, unless GLIBC_TUNABLES "
        "names glibc.malloc.hugetlb): fewer TLB misses in a process woken after idling",
    )
    instance_id: str = Field(
        "",
        description="consumer/instance name: letters, digits, '.', '_', '-' (a "
        "gateway's unique among live gateways: another under it is refused at start); "
        "empty = host-pid-random",
    )
    liveness_ttl_s: float = Field(5.0, gt=0, description="a process is dead when its liveness entry is older")
    heartbeat_interval_s: float = Field(1.0, gt=0, description="how often liveness entries are refreshed")
    health_dir: str = Field(
        "",
        description="folder where each process writes, after each liveness write, until when it is live "
        "(<health_dir>/<service>, read by `conveyor health`: shared/process/health_file.py); empty = none",
    )
    read_block_ms: int = Field(100, ge=1, le=5000, description="XREADGROUP BLOCK; must stay below socket timeout")
    socket_timeout_s: float = Field(10.0, gt=0, description="Redis client socket timeout")
    claim_idle_ms: int = Field(10_000, ge=100, description="pending entries idle this long are claimed")
    max_deliveries: int = Field(5, ge=1, description="deliveries before an event goes to the dead-letter stream")
    context_ttl_s: int = Field(3600, ge=1, description="seconds an ended request's context stays readable")
    otel_enabled: bool = Field(True, description="export spans when OTEL_EXPORTER_OTLP_ENDPOINT is set")
    otlp_endpoint: str = Field(
        "",
        validation_alias=AliasChoices("CONVEYOR_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"),
        description="OTLP/HTTP base URL spans are exported to; empty = tracing off (no-op)",
    )
    otlp_protocol: str = Field(
        "http/protobuf",
        validation_alias=AliasChoices("CONVEYOR_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"),
        description="OTLP protocol; http/protobuf is the one supported",
    )
    otel_schedule_delay_ms: int = Field(2000, ge=1, description="batch span processor export interval")
    otel_capture_content: bool = Field(False, description="put prompt and output text into spans")
    # Common: the worker's KV blocks, and the tokenizer's block hashes the scheduler matches against them.
    block_size: int = Field(
        16,
        ge=1,
        le=256,
        description="tokens per KV cache block (workers) and per "
        "block hash attached to a request (tokenizer): the same value everywhere",
    )
    session_ttl_s: int = Field(
        3600,
        ge=1,
        description="a conversation session's record lasts this long after its last move (its KV goes earlier: "
        "session_idle_ttl_s); a turn after it starts a new session under the same id",
    )

    @field_validator("instance_id")
    @classmethod
    def _check_instance_id(cls, v: str) -> str:
        if v and not INSTANCE_ID.fullmatch(v):
            raise ValueError(
                f"CONVEYOR_INSTANCE_ID {v!r} may hold only letters, digits, '.', '_' and '-' (1 to 128 "
                "of them): it is part of stream and key names (empty: one is made up)"
            )
        return v

    def names(self):
        """The deployment's stream and key names (shared.wire.constants.Names)."""
        from shared.wire.constants import Names

        return Names(self.namespace, self.partitions, self.redis_cluster)

    @property
    def partitions(self) -> int:
        """redis_partitions, with 0 (auto) resolved: 1 on a single Redis, 16 on a cluster."""
        from shared.wire.constants import CLUSTER_PARTITIONS

        return self.redis_partitions or (CLUSTER_PARTITIONS if self.redis_cluster else 1)

    def start_environment(self) -> dict[str, str]:
        """Variables read as the process starts, that it lacks (services/cli.py starts the service again with them;
        the launcher gives them to its children)."""
        return start_environment(self.malloc_huge_pages)

    def library_environment(self) -> dict[str, str]:
        """Variables the libraries this service loads read once, at their load: set before its module imports them
        (services/cli.py run_service). Empty for most services."""
        return {}


class GatewaySettings(CommonSettings):
    host: str = Field("127.0.0.1", description="address the HTTP server binds")
    port: int = Field(8000, ge=0, le=65535, description="HTTP port")
    max_body_bytes: int = Field(1 << 20, ge=1024, description="largest accepted request body")
    max_tokens_limit: int = Field(4096, ge=1, description="largest max_tokens a request may ask for")
    default_max_tokens: int = Field(256, ge=1, description="max_tokens when a request gives none")
    request_timeout_s: float = Field(300.0, gt=0, description="timeout when a request gives none")
    shutdown_grace_s: float = Field(20.0, ge=0, description="on SIGTERM, time requests in flight get to finish")
    keep_alive_s: float = Field(
        75.0, ge=1, description="idle HTTP connections kept this long: past clients' pool time (aiohttp 15 s)"
    )
    sse_write_timeout_s: float = Field(
        30.0,
        gt=0,
        description="longest one write to a streaming client may wait "
        "(it stopped reading); then it is dropped and its request cancelled",
    )
    listen_backlog: int = Field(
        8192,
        ge=1,
        description="connections the kernel queues for the gateway to accept "
        "(capped by net.core.somaxconn); beyond it a connecting client's SYN is dropped "
        "and retried after 1 s, then 3 s",
    )
    api_keys: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="accepted API keys (Authorization: Bearer), comma-separated; empty = open"
    )
    max_waiting_requests: int = Field(
        1024, ge=1, description="requests waiting cluster-wide (not yet on a worker) beyond which new ones get 429"
    )
    max_open_requests: int = Field(2048, ge=1, description="HTTP requests this gateway serves at once; more get 429")
    max_waiting_requests_per_key: int = Field(
        512, ge=1, description="waiting requests (cluster-wide) of one API key beyond which its new ones get 429"
    )
    max_open_requests_per_key: int = Field(
        1024, ge=1, description="HTTP requests of one API key this gateway serves at once; more get 429"
    )
    priority_floor: int = Field(
        0,
        ge=-1000,
        le=1000,
        description="with API keys: the most urgent priority (lowest "
        "value) a key that is not an admin key may ask for; more urgent ones are clamped to "
        "it. Admin keys, and every caller of a gateway without keys, may use -1000..1000",
    )
    retry_after_s: int = Field(1, ge=1, description="Retry-After (seconds) sent with 429 and 503")
    max_sessions_per_key: int = Field(
        1024, ge=1, description="conversation sessions one API key (or, without keys, everyone) may have at once"
    )
    responses_ttl_s: int = Field(
        30 * 24 * 3600,
        ge=60,
        description="how long a stored response (/v1/responses with store=true) is kept, from its creation; "
        "30 days by default, as OpenAI keeps them",
    )
    redis_pool_size: int = Field(
        64,
        ge=2,
        le=10_000,
        description="Redis connections of the gateway's pool; under a burst requests wait for one instead of failing",
    )
    redis_pool_timeout_s: float = Field(30.0, gt=0, description="longest wait for a pooled Redis connection")
    admin_api_keys: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="API keys that may see and cancel every request (the dashboard, "
        "/v1/requests), comma-separated; accepted in addition to api_keys",
    )
    trace_url_template: str = Field(
        "",
        description="link from the dashboard to a request's trace, with "
        "{trace_id} where its id goes, e.g. http://jaeger:16686/trace/{trace_id}; "
        "empty = no link",
    )
    dashboard_queue_events: int = Field(
        256,
        ge=8,
        le=100_000,
        description="feed batches one dashboard connection "
        "may have unsent; beyond it its backlog is dropped and it starts over "
        "from a fresh snapshot",
    )
    dashboard_max_rows: int = Field(
        5000, ge=1, le=100_000, description="most in-flight requests a dashboard's snapshot lists"
    )

    @field_validator("trace_url_template")
    @classmethod
    def _check_trace_template(cls, v: str) -> str:
        v = v.strip()
        if v and ("{trace_id}" not in v or not v.startswith(("http://", "https://", "/"))):
            raise ValueError("must be an http(s) URL or an absolute path containing {trace_id}")
        if v and v.replace("{trace_id}", "").count("{"):
            raise ValueError("{trace_id} is the only placeholder it may contain")
        return v

    @field_validator("api_keys", "admin_api_keys", mode="before")
    @classmethod
    def _split_keys(cls, v):
        # One environment variable holds every key: "key1,key2" (a JSON list is accepted too).
        if isinstance(v, str):
            v = v.strip()
            if v.startswith("["):
                return json.loads(v)
            return [k.strip() for k in v.split(",") if k.strip()]
        return v


class TokenizerSettings(CommonSettings):
    pass


class SchedulerSettings(CommonSettings):
    queue_slack: int = Field(2, ge=0, description="requests sent to a worker beyond its free sequence slots")
    max_ended_contexts: int = Field(100_000, ge=1, description="ended contexts kept; the oldest go first")
    janitor_interval_s: float = Field(10.0, gt=0, description="how often ended contexts are swept")
    placement_grace_s: float = Field(
        5.0,
        gt=0,
        description="a placement still without its record after this "
        "long (4 times as long, for one its worker does not hold) is finished from Redis",
    )
    timeout_safety_factor: float = Field(1.5, ge=1, description="adaptive deadline = factor x predicted time")
    timeout_min_s: float = Field(5.0, gt=0, description="smallest adaptive deadline")
    timeout_max_s: float = Field(300.0, gt=0, description="largest adaptive deadline")
    max_attempts: int = Field(3, ge=1, description="placements of one request before it fails (worker_lost)")
    worker_hang_timeout_s: float = Field(
        60.0,
        gt=0,
        description="a worker holding work whose step counter has not moved for this long is treated as dead",
    )
    routing: Literal["kv", "load", "round_robin"] = Field(
        "kv",
        description="placement: kv = the worker with the cheapest uncached prefix + load (KV-cache-aware), "
        "load = the emptiest KV pool, round_robin = in turn",
    )
    routing_overlap_weight: float = Field(
        4.0,
        ge=0,
        description="kv: cost of one prompt block to prefill, in KV blocks in use (decode load); 0 = load only",
    )
    routing_balance_abs: int = Field(
        16,
        ge=0,
        description="kv: requests held by the busiest minus the idlest "
        "worker beyond which (with routing_balance_rel) load alone decides",
    )
    routing_balance_rel: float = Field(
        1.5,
        ge=1,
        description="kv: ratio busiest / idlest worker beyond which (with routing_balance_abs) load alone decides",
    )


# Last: the worker's module builds on CommonSettings and CpuIsa above (a file of its own for its ~110 lines)
from shared.settings.worker import WorkerSettings  # noqa: E402, F401 - re-exported: every settings class is here
