"""The OpenAI-compatible API: /v1/models, /v1/completions, /v1/chat/completions.

Point the official `openai` client (or LangChain, or curl) at the gateway's /v1 and nothing
else changes. Each request becomes the native GenerateRequest and goes the same way as
/generate (session.intake.accept_choices, then session.drive.ChoiceRun); openai.stream gives it OpenAI's shape:
here a JSON body with n choices (in index order; `usage` for the whole request, prompt once, completion tokens
summed), there chunks over Server-Sent Events.
"""

from __future__ import annotations

import time

from typing import TYPE_CHECKING

from fastapi import APIRouter, Request

from services.gateway.edge.deps import Core
from services.gateway.edge.errors import InvalidRequest, NotFound
from services.gateway.edge.openapi_doc import GENERATION_ERRORS, error_responses, sse_or_json
from services.gateway.openai.schemas import (
    GUIDED,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    OpenAIRequest,
)
from services.gateway.openai.prompt_facts import prompt_ids
from services.gateway.openai.stream import Echo, Shape, at_index, openai_usage, start_stream
from services.gateway.openai.native_request import chat_messages, native_request
from services.gateway.openai.structured_output import OutputPlan, plan_chat, plan_completion, plan_weight
from services.gateway.session.drive import collect_choices, handle_weight, merged_usage
from services.gateway.session.intake import accept_choices
from services.gateway.session.request import MAX_BATCH, GenerateRequest
from services.gateway.session.timing import queue_time_headers
from services.gateway.text.render import json_response, off_loop

if TYPE_CHECKING:
    from services.gateway.session.core import GatewayCore
    from services.gateway.session.handle import Choices

router = APIRouter(tags=["OpenAI-compatible"])

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions
STARTED = int(time.time())  # "created" of the model card: when this gateway started serving it


def _unsupported(param: str, message: str) -> InvalidRequest:
    return InvalidRequest(f"{param}: {message}", param, "unsupported_parameter")


def _check_common(core: GatewayCore, body: OpenAIRequest) -> None:
    name = core.model_name
    if body.model != name:
        raise NotFound(
            f"the model '{body.model}' does not exist; this server serves '{name}'", "model", "model_not_found"
        )
    rules: list[tuple[str, bool, str]] = [
        ("stream_options", body.stream_options is not None and not body.stream, "only allowed when stream is true"),
        (
            "stream_options.continuous_usage_stats",
            bool(body.stream_options and body.stream_options.continuous_usage_stats)
            and not body.stream_options.include_usage,
            "only with include_usage true (as vLLM)",
        ),
    ]
    rules += [(old, old in body.model_fields_set, f"removed in vLLM 0.12; use {new}") for old, new in GUIDED.items()]
    for param, broken, message in rules:
        if broken:
            raise _unsupported(param, message)


def _check_completion(body: CompletionRequest) -> list[dict]:
    """The prompts (each the native fields it sets: prompt or prompt_token_ids), once the completion-only fields
    are known to be supported."""
    for param, broken, message in [
        ("max_tokens", body.max_tokens == 0 and not body.echo, "0 is allowed only with echo (the prompt alone)"),
        ("suffix", body.suffix is not None, "not supported"),
        ("best_of", body.best_of not in (None, 1), "only 1 is supported"),
    ]:
        if broken:
            raise _unsupported(param, message)
    p = body.prompt
    if isinstance(p, str):
        prompts = [{"prompt": p}]
    elif not p:
        raise InvalidRequest("prompt: an empty list (give at least one prompt)", "prompt", "invalid_value")
    elif isinstance(p[0], int):
        prompts = [{"prompt_token_ids": p}]
    else:
        for i, one in enumerate(p):
            if not one:  # a list of prompts: each is checked here (the native request's rules do not see them)
                raise InvalidRequest(f"prompt.{i}: an empty prompt", f"prompt.{i}", "invalid_value")
        prompts = [{"prompt": one} if isinstance(one, str) else {"prompt_token_ids": one} for one in p]
    if len(prompts) * (body.n or 1) > MAX_BATCH:
        raise InvalidRequest(
            f"prompt: {len(prompts)} prompts x n={body.n or 1} is more than {MAX_BATCH} choices in all",
            "prompt",
            "too_many_choices",
        )
    return prompts


def _prompt_text(core: GatewayCore, prompt: dict) -> str:
    """What echo puts before a prompt's completion: its text (a token-id prompt's, decoded, as vLLM)."""
    return prompt["prompt"] if "prompt" in prompt else core.tokenizer.decode(prompt["prompt_token_ids"])


def _chat_logprobs(body: ChatCompletionRequest) -> int | None:
    """The native `logprobs` (alternatives per token, None = off) of a chat request."""
    if body.top_logprobs not in (None, 0) and not body.logprobs:
        raise InvalidRequest("top_logprobs: only allowed when logprobs is true", "top_logprobs", "invalid_value")
    return (body.top_logprobs or 0) if body.logprobs else None


def _chat_echo(body: ChatCompletionRequest, plan: OutputPlan, messages: list) -> str:
    """What a chat answer's content starts with under echo, as vLLM: the last message's text when it is the turn
    being answered (an assistant's, or any one's with add_generation_prompt false)."""
    if not body.echo:
        return ""
    if plan.tool_mode != "none":
        raise _unsupported("echo", "cannot be combined with tools unless tool_choice is 'none'")
    last = messages[-1]
    return last.content if last.role == "assistant" or body.add_generation_prompt is False else ""


async def _serve(
    core: GatewayCore,
    request: Request,
    body: OpenAIRequest,
    native: GenerateRequest,
    chat: bool,
    default_max_tokens: int | None = None,
    plan: OutputPlan = OutputPlan(),
    echoes: list[Echo] | None = None,
    chat_echo: str = "",
    prompts: list[dict] | None = None,
):
    meta = {
        "api": "openai.chat" if chat else "openai.completions",
        "user": body.user,
        "client_request_id": body.request_id,
    }
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    n = body.n or 1
    choices = await accept_choices(
        core, request, native, n, default_max_tokens, meta, prompts, constraint=plan.constraint, tools=plan.tools_json
    )
    primary = choices.primary
    # One Shape per choice: a completion's log probabilities carry a text offset that runs on within its choice.
    shapes = [
        Shape(
            chat,
            f"{'chatcmpl' if chat else 'cmpl'}-{primary.request_id}",
            int(time.time()),
            core.model_name,
            include_usage,
            bool(include_usage and body.stream_options.continuous_usage_stats),
            bool(body.return_token_ids),
            core.token_strings if native.logprobs is not None or native.prompt_logprobs is not None else None,
            plan,
            echoes[k // n] if echoes else None,  # choice j of prompt i is at i * n + j
            chat_echo,
        )
        for k in range(len(choices.handles))
    ]
    headers = {"X-Request-Id": primary.request_id, "traceparent": primary.trace.traceparent}
    if native.stream:
        return await start_stream(request, core, choices, shapes, headers)
    return await _json_answer(core, request, body, choices, shapes, headers)


async def _json_answer(
    core: GatewayCore, request: Request, body: OpenAIRequest, choices: Choices, shapes: list[Shape], headers: dict
):
    """The non-stream answer, once every choice has ended."""
    # The log probabilities are shaped from the handles (Shape.body), not from the native bodies.
    bodies = await collect_choices(core, choices, request, with_logprobs=False)
    headers.update(queue_time_headers((choices.primary.metrics or {}).get("queue_wait")))
    prompts_ids = await prompt_ids(core, choices) if body.return_token_ids else None
    return await json_response(
        lambda: choices_body(shapes, choices, bodies, prompts_ids),
        sum(handle_weight(h) for h in choices.handles),
        headers,
    )


@router.post("/v1/completions", responses={**sse_or_json(CompletionResponse, "the completion"), **GENERATION_ERRORS})
async def completions(body: CompletionRequest, request: Request, core: Core):
    _check_common(core, body)
    prompts = _check_completion(body)
    plan = await off_loop(lambda: plan_completion(body), plan_weight(body))  # its grammar compiled off the loop
    # max_tokens 0 with echo: the prompt alone, as vLLM (which, like this, still generates one token and drops it)
    max_tokens = 1 if body.max_tokens == 0 else body.max_tokens
    native = native_request(body, max_tokens, body.logprobs, **prompts[0])
    echoes = [Echo(_prompt_text(core, p), body.max_tokens == 0) for p in prompts] if body.echo else None
    if echoes and body.logprobs is not None and native.prompt_logprobs is None:  # the echoed prompt's, as vLLM
        native = native.model_copy(update={"prompt_logprobs": body.logprobs})
    batch = prompts if len(prompts) > 1 else None
    return await _serve(
        core, request, body, native, False, COMPLETIONS_DEFAULT_MAX_TOKENS, plan, echoes=echoes, prompts=batch
    )


@router.post(
    "/v1/chat/completions",
    responses={**sse_or_json(ChatCompletionResponse, "the assistant's message"), **GENERATION_ERRORS},
)
async def chat_completions(body: ChatCompletionRequest, request: Request, core: Core):
    _check_common(core, body)
    plan = await off_loop(lambda: plan_chat(body), plan_weight(body))  # its schemas compiled off the loop
    messages = chat_messages(body)
    native = native_request(
        body, body.max_completion_tokens or body.max_tokens, _chat_logprobs(body), messages=messages
    )
    return await _serve(core, request, body, native, chat=True, plan=plan, chat_echo=_chat_echo(body, plan, messages))


def _card(core: GatewayCore) -> dict:
    return {
        "id": core.model_name,
        "object": "model",
        "created": STARTED,
        "owned_by": "conveyor",
        "max_model_len": core.max_len,
    }


@router.get("/v1/models", response_model=ModelList, responses=error_responses(401))
async def list_models(core: Core) -> dict:
    return {"object": "list", "data": [_card(core)]}


@router.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=error_responses(401, 404))
async def get_model(model_id: str, core: Core) -> dict:
    card = _card(core)
    if model_id != card["id"]:
        raise NotFound(
            f"the model '{model_id}' does not exist; this server serves '{card['id']}'", "model", "model_not_found"
        )
    return card


def choices_body(
    shapes: list[Shape], choices: Choices, bodies: list[dict], prompts_ids: list[list[int]] | None = None
) -> dict:
    """The non-stream answer from the choices' native bodies (and their handles' log probabilities); prompts_ids:
    return_token_ids' prompt ids of each choice (vLLM's places: a completion's choice, a chat's response)."""
    outs = [
        at_index(shapes[i].body(b, choices.handles[i].logprobs, choices.handles[i].prompt), i)
        for i, b in enumerate(bodies)
    ]
    out = outs[0]
    out["choices"] = [o["choices"][0] for o in outs]
    if prompts_ids is not None:
        if shapes[0].chat:
            out["prompt_token_ids"] = prompts_ids[0]
        else:
            for choice, ids in zip(out["choices"], prompts_ids):
                choice["prompt_token_ids"] = ids
    out["usage"] = openai_usage(merged_usage(bodies, choices.per_prompt))
    return out
