"""The one way in for every API: checks a schema cannot express, then submission of each choice.

/generate and the OpenAI endpoints all build a GenerateRequest and come through here, so a
rule (prompt xor messages, the max_tokens limit, back-pressure, the owner's key) is written once.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING

from services.gateway.conversation import turns
from services.gateway.edge.auth import caller, is_admin
from services.gateway.edge.errors import InvalidRequest
from services.gateway.session.groups import choice_body
from services.gateway.session.handle import Choices
from services.gateway.session.outcome import SIBLING_FAILED
from shared.text.chat_template import kwargs_problem
from shared.state.sessions import end_turn

if TYPE_CHECKING:
    from fastapi import Request

    from services.gateway.session.core import GatewayCore
    from services.gateway.session.handle import RequestHandle
    from services.gateway.session.request import GenerateRequest
    from shared.wire.events import Constraint
    from shared.settings import GatewaySettings


async def accept_choices(
    core: GatewayCore,
    request: Request,
    body: GenerateRequest,
    n: int,
    default_max_tokens: int | None = None,
    extra_meta: dict | None = None,
    prompts: list[dict] | None = None,
    **output,
) -> Choices:
    """Create the n choices of each prompt, the first first (its trace holds the others'); all or none (raises
    GatewayError). prompts: a prompt list's prompts (each the fields it sets on body: prompt or prompt_token_ids;
    None: body's own), choice j of prompt i at index i*n + j (OpenAI's numbering). output: accept's constraint and
    tools, the same for every choice."""
    bodies = [body] if prompts is None else [body.model_copy(update=p) for p in prompts]
    choices = await _accept_all(core, request, bodies, n, default_max_tokens, extra_meta, prompts, **output)
    for _ in bodies:  # one request per prompt, as vLLM counts a prompt list
        core.metrics.observe_params(n, body.max_tokens or default_max_tokens)
    return choices


async def _accept_all(core, request, bodies, n, default_max_tokens, extra_meta, prompts, **output) -> Choices:
    body, total = bodies[0], len(bodies) * n
    if total == 1:  # a group of one: no group id, no seed offset
        return Choices([await accept(core, request, bodies[0], default_max_tokens, extra_meta, **output)])
    if turns.session_id_of(request, body.session_id) is not None:
        raise InvalidRequest(
            f"n: a session's turn has one answer to continue from (got {total} choices); send them without a session",
            "n",
            "session_with_n",
        )
    ids = [uuid.uuid4().hex for _ in range(total)]
    handles: list[RequestHandle] = []
    try:
        for k, rid in enumerate(ids):
            i, j = divmod(k, n)
            meta = {**(extra_meta or {}), "group_id": ids[0], "choice_index": k, "n": n}
            if prompts is not None:
                meta["prompt_index"] = i
            if k == 0:
                meta["group_members"] = ids  # what a cancel of any choice reads (groups.members)
            tp = handles[0].trace.traceparent if handles else None
            # the choices of one prompt share a prefill group (placed together, the prompt computed once)
            prefill = {"group_id": ids[i * n], "group_size": n} if n > 1 else {}
            handles.append(
                await accept(
                    core,
                    request,
                    choice_body(bodies[i], j),
                    default_max_tokens,
                    meta,
                    request_id=rid,
                    traceparent=tp,
                    **prefill,
                    **output,
                )
            )
    except BaseException:
        for h in handles:  # refused whole: what was created is cancelled (in tasks: this may be a cancellation)
            core.abandon(h, SIBLING_FAILED)
        raise
    return Choices(handles, per_prompt=n)


def check_token_prompt(ids: list[int] | None, vocab: int, max_len: int, truncate: int | None = None) -> None:
    """A prompt of token ids: every id in the vocabulary, and room for one output token in the context window
    (unless truncate_prompt_tokens cuts it: the tokenizer checks what is kept)."""
    if ids is None:
        return
    if (bad := next((t for t in ids if t >= vocab), None)) is not None:
        raise InvalidRequest(
            f"prompt: every token id must be below the vocabulary size {vocab} (got {bad})",
            "prompt",
            "token_id_out_of_range",
        )
    if max_len and len(ids) >= max_len and not truncate:
        raise InvalidRequest(
            f"prompt is {len(ids)} tokens; the context window is {max_len} tokens and at least 1 must be left for "
            "output",
            "prompt",
            "too_long",  # the tokenizer's code for a prompt it finds too long
        )


def check_chat_options(body: GenerateRequest) -> None:
    """How the chat template is to write the messages: vLLM's rules (raises a 400 naming the field). /tokenize's
    body (native.tokenize, an API package this layer does not import) has the same fields and is checked here too."""
    options = {"add_generation_prompt", "continue_final_message", "chat_template_kwargs"} & body.model_fields_set
    if body.messages is None and options:
        field = sorted(options)[0]
        raise InvalidRequest(f"{field}: only with messages (a chat)", field, "invalid_value")
    if body.continue_final_message and body.add_generation_prompt:
        raise InvalidRequest(
            "continue_final_message: cannot be true with add_generation_prompt true (as vLLM); "
            "set add_generation_prompt to false to continue the last message",
            "continue_final_message",
            "invalid_value",
        )
    problem = kwargs_problem(body.chat_template_kwargs) if body.chat_template_kwargs else None
    if problem is not None:
        param = "chat_template_kwargs" + (f".{problem[0]}" if problem[0] else "")
        raise InvalidRequest(f"{param}: {problem[1]}", param, "invalid_value")


def check_body(body: GenerateRequest, vocab: int, max_len: int) -> None:
    """What accept checks before anything is created: one prompt form, the chat options, and every token id (the
    prompt's, the stop ids, logit_bias's) within the vocabulary (raises InvalidRequest naming the field)."""
    given = [f for f in ("prompt", "messages", "prompt_token_ids") if getattr(body, f) is not None]
    if len(given) != 1:
        which = f"{' and '.join(given)} were given" if given else "none was given"
        raise InvalidRequest(
            f"give exactly one of prompt, messages or prompt_token_ids ({which})", "prompt", "prompt_or_messages"
        )
    check_chat_options(body)
    if body.truncate_prompt_tokens == 0:
        raise InvalidRequest(
            "truncate_prompt_tokens: must be -1 or at least 1 (got 0)", "truncate_prompt_tokens", "invalid_value"
        )
    check_token_prompt(body.prompt_token_ids, vocab, max_len, body.truncate_prompt_tokens)
    if any(t >= vocab for t in body.stop_token_ids):
        raise InvalidRequest(
            f"stop_token_ids: every id must be below the vocabulary size {vocab}",
            "stop_token_ids",
            "token_id_out_of_range",
        )
    if any(int(t) >= vocab for t in body.logit_bias or {}):
        raise InvalidRequest(
            f"logit_bias: every token id must be below the vocabulary size {vocab}",
            "logit_bias",
            "token_id_out_of_range",
        )


def max_tokens_of(body: GenerateRequest, default: int | None, s: GatewaySettings, max_len: int) -> int:
    """The request's output budget: its max_tokens, or the API's default within the limit (raises InvalidRequest
    above the limit: the settings' max_tokens_limit, and the context window less one prompt token)."""
    limit = min(s.max_tokens_limit, max_len - 1) if max_len else s.max_tokens_limit
    max_tokens = body.max_tokens or min(default or s.default_max_tokens, limit)
    if max_tokens > limit:
        raise InvalidRequest(
            f"max_tokens: must be at most {limit} (got {max_tokens})", "max_tokens", "max_tokens_too_large"
        )
    return max_tokens


async def accept(
    core: GatewayCore,
    request: Request,
    body: GenerateRequest,
    default_max_tokens: int | None = None,
    extra_meta: dict | None = None,
    constraint: Constraint | None = None,
    tools: str = "",
    **choice,
) -> RequestHandle:
    """Validate, apply back-pressure and submit; returns the handle to drive (raises GatewayError). constraint and
    tools: what openai.structured_output.plan_chat decided (already checked). choice: a choice of an n > 1 request
    (accept_choices) gives its request_id, group_id, group_size and traceparent."""
    check_body(body, len(core.tokenizer), core.max_len)  # the worker would refuse an id beyond it, as a 500
    max_tokens = max_tokens_of(body, default_max_tokens, core.s, core.max_len)
    if caller(request) and not is_admin(request) and body.priority < core.s.priority_floor:
        # An urgent priority is an entitlement: one key at -1000 would starve every other key until their timeouts.
        extra_meta = {**(extra_meta or {}), "priority_requested": body.priority}
        body = body.model_copy(update={"priority": core.s.priority_floor})
    traceparent = choice.pop("traceparent", None) or request.headers.get("traceparent", "")
    turn = {}
    if (session_id := turns.session_id_of(request, body.session_id)) is not None:
        rid = uuid.uuid4().hex
        key, worker = await turns.begin(core, caller(request), session_id, rid)
        turn = {"request_id": rid, "session": key, "session_worker": worker}
        extra_meta = {**(extra_meta or {}), "session_id": session_id}
    try:
        return await core.submit(
            body,
            max_tokens,
            owner=caller(request),
            extra_meta=extra_meta,
            traceparent=traceparent,
            route=request.url.path,
            constraint=constraint,
            tools=tools,
            **choice,
            **turn,
        )
    except BaseException:
        if turn:  # not created: the turn that began is over
            await core.sessions.amove(end_turn(turn["session"], turn["request_id"]))
        raise
