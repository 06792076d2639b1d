"""Stored responses (store=true) in Redis: one JSON string per response, owned by the API key that created it.

A record holds what the API shows (the response, its input items) and the conversation so far as chat turns (every
turn up to and including this response's output), so that previous_response_id costs one GET, whatever the length
of the chain, and a continuation survives the deletion or expiry of an earlier response of the chain. A copy per
response is bounded by the body limit and the model's context; a chain walked at read time would cost a GET per
turn instead. Any gateway reads any record: the key names the owner, not the process.

The key lives responses_ttl_s from its creation (set in the same SET): nothing in Redis outlives its TTL.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.gateway.edge.errors import NotFound

if TYPE_CHECKING:
    from services.gateway.session.core import GatewayCore


@dataclass(frozen=True)
class Stored:
    response: dict  # the Response object, as GET /v1/responses/{id} answers
    input_items: list[dict]  # this request's own input, each item with its id
    turns: list[dict]  # the conversation through this response's output, as chat messages

    def encode(self) -> str:
        return json.dumps(
            {"response": self.response, "input_items": self.input_items, "turns": self.turns}, ensure_ascii=False
        )


async def put(core: GatewayCore, owner: str, stored: Stored) -> None:
    key = core.names.response(owner, stored.response["id"])
    await core.r.set(key, stored.encode(), ex=core.s.responses_ttl_s)


async def get(core: GatewayCore, owner: str, response_id: str, param: str = "response_id") -> Stored:
    """The stored response, or a 404 naming param (unknown, expired, deleted, or another key's look alike)."""
    raw = await core.r.get(core.names.response(owner, response_id))
    if raw is None:
        raise NotFound(f"{param}: no response {response_id!r} (never stored, deleted, or expired)", param, "not_found")
    data = json.loads(raw)
    return Stored(data["response"], data["input_items"], data["turns"])


async def delete(core: GatewayCore, owner: str, response_id: str) -> None:
    if not await core.r.delete(core.names.response(owner, response_id)):
        raise NotFound(f"response_id: no response {response_id!r}", "response_id", "not_found")
