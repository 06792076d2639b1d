"""What the dashboard shows of requests: table rows read from the indexes and a few fields of each context.

No SCAN anywhere: the in-flight ids come from the per-state sorted sets (intersected with the caller's per-owner
index when it may see only its own requests), and each row is a handful of HMGETs in one pipeline.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from services.gateway.ops.introspection import ids_in_states
from services.gateway.session.metrics import LIVE_STATES
from services.gateway.session.timing import lifecycle_intervals

if TYPE_CHECKING:
    from services.gateway.session.core import GatewayCore

_META = ("state", "state_since", "created_at", "owner")


def _value(raw):
    """A context field as stored: JSON (written by Python) or a bare word/number (written by the Lua scripts)."""
    if raw is None:
        return None
    try:
        return msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return raw.decode() if isinstance(raw, bytes) else raw


async def read_rows(core: GatewayCore, ids: list[str], owner: str | None) -> list[dict]:
    """One table row per request that still exists and that `owner` may see (None: all), in the order given."""
    names = core.names
    pipe = core.ops_r.pipeline(transaction=False)
    for rid in ids:
        pipe.hmget(names.layer(rid, "meta"), *_META)
        pipe.hmget(names.layer(rid, "exec"), "worker_id", "attempt")
        pipe.hget(names.layer(rid, "kv"), "cached_tokens")
        pipe.hget(names.layer(rid, "input"), "prompt_tokens")
        pipe.llen(names.tokens(rid))
    raw = await pipe.execute() if ids else []
    rows = []
    for i, rid in enumerate(ids):
        meta, exec_, cached, prompt, produced = raw[5 * i : 5 * i + 5]
        state, since, created, row_owner = (_value(v) for v in meta)
        if state is None or (owner is not None and (row_owner or "") != owner):
            continue  # expired meanwhile, or not the caller's
        worker, attempt = (_value(v) for v in exec_)
        rows.append(
            {
                "rid": rid,
                "state": state,
                "since": since,
                "created": created,
                "worker": worker or "",
                "attempt": attempt or 0,
                "prompt": _value(prompt),
                "output": produced,
                "cached": _value(cached),
            }
        )
    return rows


async def snapshot(core: GatewayCore, owner: str | None, max_rows: int) -> dict:
    """Every in-flight request `owner` may see (the oldest `max_rows`), with the Redis time it was read at."""
    ids = [rid for _t, rid in await ids_in_states(core, owner, LIVE_STATES)]
    seconds, micros = await core.ops_r.time()
    rows = await read_rows(core, ids[:max_rows], owner)
    return {"at": seconds + micros / 1e6, "rows": rows, "total": len(ids), "truncated": len(ids) > max_rows}


def trace_id(traceparent: str) -> str:
    """The trace id of a W3C traceparent ("00-<trace id>-<span id>-<flags>"); "" when there is none."""
    parts = (traceparent or "").split("-")
    return parts[1] if len(parts) == 4 and len(parts[1]) == 32 else ""


def detail(snap_dict: dict, trace_url_template: str) -> dict:
    """A request's whole context for the page: layers, history, intervals, and the link to its trace."""
    tid = trace_id(snap_dict.get("meta", {}).get("traceparent", ""))
    metrics = (snap_dict.get("output") or {}).get("metrics") or {}
    return {
        **snap_dict,
        "intervals": {**lifecycle_intervals(snap_dict["history"]), **metrics},
        "trace_id": tid,
        "trace_url": trace_url_template.replace("{trace_id}", tid) if tid and trace_url_template else "",
    }
