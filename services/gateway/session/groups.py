"""A request's choices (OpenAI's `n`): one request of its own per choice, the n tied by a group id.

A request of one choice (n = 1) is a group of one, created without a group: its context is a plain request's.
intake.accept_choices creates a request's choices and drive.ChoiceRun drives them, whatever n.

Each choice lives a request's whole life: its own id, context, dashboard row, metrics and trace (its spans under the
first choice's root span, so one trace holds the request). The first choice's id is the request's: the response
id, X-Request-Id, and what DELETE /v1/requests/{id} takes; cancelling any choice's id cancels every choice
(`members`). The group id (the first choice's id) travels with each choice: the scheduler places the choices on one
worker (services/scheduler/affinity.py), whose engine computes their prompt once (the other choices wait for its
blocks and reuse them from the prefix cache).

Seeds: choice i samples with seed + i, so a seed gives reproducible choices that differ from each other (choice 0
is what n = 1 gives with that seed). Without a seed each choice draws its own randomness; greedy choices are equal.
Limits: each choice is a waiting request for CONVEYOR_MAX_WAITING_REQUESTS (and the per-key bound): a request whose
choices do not all fit is refused whole (429), the choices already created cancelled; the HTTP request takes one
open-request slot (CONVEYOR_MAX_OPEN_REQUESTS), whatever n.
One outcome: a choice that fails, times out or is cancelled ends its siblings (CANCELLED, reason choice_failed,
unless the client left: client_disconnect) and its error is the answer (a stream that has started ends with it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.gateway.session.request import INT64_MIN

if TYPE_CHECKING:
    from services.gateway.session.core import GatewayCore
    from services.gateway.session.request import GenerateRequest

SEED_SPACE = 2**64  # seeds are any int64 (request.py): choice i's seed + i wraps within them


def choice_body(body: GenerateRequest, index: int) -> GenerateRequest:
    """Choice `index`'s own request: the same but for its seed (seed + index, past INT64_MAX on from INT64_MIN, so
    choice 0 keeps the request's own seed and every choice's is a valid one)."""
    if body.seed is None:
        return body
    seed = (body.seed - INT64_MIN + index) % SEED_SPACE + INT64_MIN
    return body.model_copy(update={"seed": seed})


async def members(core: GatewayCore, meta: dict, request_id: str) -> list[str]:
    """Every request id of the request `request_id` belongs to (itself alone unless it is a choice of n > 1)."""
    group = meta.get("group_id")
    if not group:
        return [request_id]
    if group != request_id:
        primary = await core.store.aread(core.r, group)
        meta = primary.layers["meta"] if primary is not None else {}
    ids = meta.get("group_members") or [request_id]
    return ids if request_id in ids else [request_id, *ids]
