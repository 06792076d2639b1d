"""Helpers for the OpenAI-API tests: official clients pointed at a test cluster, worker and request state."""

from __future__ import annotations

import httpx

from shared.process.liveness import read_live
from shared.text.model_files import DEFAULT_MODEL_NAME

MODEL = DEFAULT_MODEL_NAME


def openai_client(url: str, api_key: str = "unused", **kw):
    """The official client, as a user would point it at Conveyor; no retries, so errors surface as raised."""
    from openai import OpenAI

    return OpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0, timeout=kw.pop("timeout", 180), **kw)


def async_openai_client(url: str, api_key: str = "unused", **kw):
    from openai import AsyncOpenAI

    return AsyncOpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0, timeout=kw.pop("timeout", 180), **kw)


def request_id(openai_id: str) -> str:
    """The Conveyor request id inside an OpenAI response id (cmpl-<id>, chatcmpl-<id>)."""
    return openai_id.split("-", 1)[1]


def snapshot(url: str, rid: str, headers: dict | None = None) -> dict:
    r = httpx.get(f"{url}/v1/requests/{rid}", headers=headers or {}, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def worker_idle(cluster) -> bool:
    """Every worker holds no request and no KV block is referenced by one (the engine counts evictable
    cached blocks as free)."""
    infos = list(read_live(cluster.client(), cluster.names, "worker").values())
    return bool(infos) and all(
        i["held"] == 0 and i["running"] == 0 and i["free_blocks"] == i["total_blocks"] for i in infos
    )
