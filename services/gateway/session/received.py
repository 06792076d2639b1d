"""What a validated request becomes before it is created: its sampling, its RequestReceived event, its context's
input layer. Pure mappings from the wire body (request.GenerateRequest) to the contract's structs (shared.wire.events),
apart from the core that creates them (core.GatewayCore.submit), so the core reads as the steps it takes."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shared.wire.events import ChatMessage, Constraint, RequestReceived, Sampling

if TYPE_CHECKING:
    from services.gateway.session.request import GenerateRequest


@dataclass(frozen=True)
class Placement:
    """Where a request stands beside others: a choice of an n > 1 request (its group, placed together), and a
    conversation session's turn (the session's key and the worker holding its KV)."""

    group_id: str = ""
    group_size: int = 1
    session: str = ""
    session_worker: str = ""


def sampling_of(req: GenerateRequest, max_tokens: int, constraint: Constraint | None) -> Sampling:
    return Sampling(
        max_tokens=max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=max(0, req.top_k),
        min_p=req.min_p,
        repetition_penalty=req.repetition_penalty,
        seed=req.seed,
        min_tokens=req.min_tokens,
        stop_token_ids=tuple(req.stop_token_ids),
        ignore_eos=req.ignore_eos,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        logprobs=req.logprobs,
        prompt_logprobs=req.prompt_logprobs,
        constraint=constraint,
        logit_bias=tuple(sorted((int(t), b) for t, b in (req.logit_bias or {}).items())),
    )


def stop_strings(req: GenerateRequest) -> list[str]:
    return [req.stop] if isinstance(req.stop, str) else list(req.stop or [])


def received_event(
    req: GenerateRequest,
    request_id: str,
    sampling: Sampling,
    *,
    reply_to: str,
    received_at: float,
    deadline: float,
    traceparent: str,
    tools: str,
    placement: Placement,
) -> RequestReceived:
    return RequestReceived(
        request_id=request_id,
        reply_to=reply_to,
        prompt=req.prompt,
        messages=tuple(ChatMessage(m.role, m.content) for m in req.messages) if req.messages else None,
        prompt_token_ids=tuple(req.prompt_token_ids or ()),
        truncate_prompt_tokens=req.truncate_prompt_tokens or 0,
        sampling=sampling,
        priority=req.priority,
        deadline=deadline,
        adaptive_deadline=req.timeout is None,
        received_at=received_at,
        traceparent=traceparent,
        group_id=placement.group_id,
        group_size=placement.group_size,
        tools=tools,
        add_generation_prompt=req.add_generation_prompt,
        continue_final_message=req.continue_final_message,
        chat_template_kwargs=json.dumps(req.chat_template_kwargs) if req.chat_template_kwargs else "",
        session=placement.session,
        session_worker=placement.session_worker,
    )


def input_layer(req: GenerateRequest, sampling: Sampling, stops: list[str]) -> dict:
    """The context's input layer: what the client asked for, as the store keeps it."""
    return {
        "prompt": req.prompt,
        "prompt_token_ids": req.prompt_token_ids,
        "messages": [m.model_dump() for m in req.messages] if req.messages else None,
        "sampling": {k: getattr(sampling, k) for k in sampling.__struct_fields__},
        "stop": stops,
    }
