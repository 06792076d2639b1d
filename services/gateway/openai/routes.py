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
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    OpenAIRequest,
)
from services.gateway.openai.stream import Echo, Shape, at_index, openai_usage, start_stream
from services.gateway.openai.native_request import chat_messages, native_request
from services.gateway.openai.structured_output import OutputPlan, plan_chat, plan_weight
from services.gateway.session.drive import collect_choices, handle_weight, merged_usage
from services.gateway.session.intake import accept_choices
from services.gateway.session.request import GenerateRequest
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
    ]
    for param, broken, message in rules:
        if broken:
            raise _unsupported(param, message)


def _check_completion(body: CompletionRequest) -> str:
    """The single prompt, once the completion-only fields are known to be supported."""
    for param, broken, message in [
        ("max_tokens", body.max_tokens == 0 and not body.echo, "0 is allowed only with echo (the prompt alone)"),
        ("suffix", body.suffix is not None, "not supported"),
        ("best_of", body.best_of not in (None, 1), "only 1 is supported"),
    ]:
        if broken:
            raise _unsupported(param, message)
    if isinstance(body.prompt, list):
        if len(body.prompt) != 1:
            raise InvalidRequest(
                f"prompt: a list must hold exactly one string (got {len(body.prompt)}); "
                "batched prompts are not supported",
                "prompt",
                "unsupported_parameter",
            )
        return body.prompt[0]
    return body.prompt


def _chat_logprobs(body: ChatCompletionRequest) -> int | None:
    """The native `logprobs` (alternatives per token, None = off) of a chat request."""
    if body.top_logprobs not in (None, 0) and not body.logprobs:
        raise InvalidRequest("top_logprobs: only allowed when logprobs is true", "top_logprobs", "invalid_value")
    return (body.top_logprobs or 0) if body.logprobs else None


async def _serve(
    core: GatewayCore,
    request: Request,
    body: OpenAIRequest,
    native: GenerateRequest,
    chat: bool,
    default_max_tokens: int | None = None,
    plan: OutputPlan = OutputPlan(),
    echo: Echo | None = None,
):
    meta = {
        "api": "openai.chat" if chat else "openai.completions",
        "user": body.user,
        "client_request_id": body.request_id,
    }
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    n = body.n or 1
    choices = await accept_choices(
        core, request, native, n, default_max_tokens, meta, constraint=plan.constraint, tools=plan.tools_json
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
            core.token_strings if native.logprobs is not None or native.prompt_logprobs is not None else None,
            plan,
            echo,
        )
        for _ in range(n)
    ]
    headers = {"X-Request-Id": primary.request_id, "traceparent": primary.trace.traceparent}
    if native.stream:
        return await start_stream(request, core, choices, shapes, headers)
    # The log probabilities are shaped from the handles (Shape.body), not from the native bodies.
    bodies = await collect_choices(core, choices, request, with_logprobs=False)
    return await json_response(
        lambda: choices_body(shapes, choices, bodies), sum(handle_weight(h) for h in choices.handles), headers
    )


@router.post("/v1/completions", responses={**sse_or_json(CompletionResponse, "the completion"), **GENERATION_ERRORS})
async def completions(body: CompletionRequest, request: Request, core: Core):
    _check_common(core, body)
    prompt = _check_completion(body)
    # max_tokens 0 with echo: the prompt alone, as vLLM (which, like this, still generates one token and drops it)
    max_tokens = 1 if body.max_tokens == 0 else body.max_tokens
    native = native_request(body, max_tokens, body.logprobs, prompt=prompt)
    echo = Echo(prompt, body.max_tokens == 0) if body.echo else None
    if echo and body.logprobs is not None and native.prompt_logprobs is None:  # the echoed prompt's, as vLLM
        native = native.model_copy(update={"prompt_logprobs": body.logprobs})
    return await _serve(
        core, request, body, native, chat=False, default_max_tokens=COMPLETIONS_DEFAULT_MAX_TOKENS, echo=echo
    )


@router.post(
    "/v1/chat/completions",
    responses={**sse_or_json(ChatCompletionResponse, "the assistant's message"), **GENERATION_ERRORS},
)
async def chat_completions(body: ChatCompletionRequest, request: Request, core: Core):
    _check_common(core, body)
    plan = await off_loop(lambda: plan_chat(body), plan_weight(body))  # its schemas compiled off the loop
    native = native_request(
        body, body.max_completion_tokens or body.max_tokens, _chat_logprobs(body), messages=chat_messages(body)
    )
    return await _serve(core, request, body, native, chat=True, plan=plan)


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


def choices_body(shapes: list[Shape], choices: Choices, bodies: list[dict]) -> dict:
    """The non-stream answer from the choices' native bodies (and their handles' log probabilities)."""
    outs = [
        at_index(shapes[i].body(b, choices.handles[i].logprobs, choices.handles[i].prompt), i)
        for i, b in enumerate(bodies)
    ]
    out = outs[0]
    out["choices"] = [o["choices"][0] for o in outs]
    out["usage"] = openai_usage(merged_usage(bodies))
    return out
