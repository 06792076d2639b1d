"""The OpenAI-compatible API: /v1/models, /v1/completions, /v1/chat/completions.

Point the official `openai` client (or LangChain, or curl) at the gateway's /v1 and nothing
else changes. Each request becomes the native GenerateRequest and goes the same way as
/generate (intake.accept, then choices.ChoiceRun); openai_serve gives it OpenAI's shape.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from pydantic import ValidationError

from services.gateway.openai_serve import serve
from services.gateway.edge.errors import InvalidRequest, NotFound
from services.gateway.openai.schemas import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest,
                                             CompletionResponse, ModelCard, ModelList, OpenAIRequest,
                                             error_responses, sse_or_json)
from services.gateway.text.render import off_loop
from services.gateway.session.request import GenerateRequest, Message
from services.gateway.openai.structured_output import OutputPlan, plan_chat, plan_weight
from services.gateway.openai.tool_calls import turn_text

router = APIRouter(tags=["OpenAI-compatible"])

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions
STARTED = int(time.time())  # "created" of the model card: when this gateway started serving it
GENERATION_ERRORS = error_responses(400, 401, 404, 413, 429, 503, 504)
# Fields passed to the native request unchanged when given (both sides validate them alike).
PASSED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
          "seed", "min_tokens", "stop_token_ids", "ignore_eos", "priority", "timeout", "stop")


def _unsupported(param: str, message: str) -> InvalidRequest:
    return InvalidRequest(f"{param}: {message}", param, "unsupported_parameter")


def _check_common(request: Request, body: OpenAIRequest) -> None:
    name = request.app.state.core.model_name
    if body.model != name:
        raise NotFound(f"the model '{body.model}' does not exist; this server serves '{name}'", "model",
                       "model_not_found")
    rules: list[tuple[str, bool, str]] = [
        ("logit_bias", bool(body.logit_bias), "not supported"),
        ("stream_options", body.stream_options is not None and not body.stream, "only allowed when stream is true"),
    ]
    for param, broken, message in rules:
        if broken:
            raise _unsupported(param, message)


def _check_completion(body: CompletionRequest) -> str:
    """The single prompt, once the completion-only fields are known to be supported."""
    for param, broken, message in [
        ("echo", bool(body.echo), "not supported (the prompt is not returned, nor its tokens' log probabilities)"),
        ("suffix", body.suffix is not None, "not supported"),
        ("best_of", body.best_of not in (None, 1), "only 1 is supported"),
    ]:
        if broken:
            raise _unsupported(param, message)
    if isinstance(body.prompt, list):
        if len(body.prompt) != 1:
            raise InvalidRequest(f"prompt: a list must hold exactly one string (got {len(body.prompt)}); "
                                 "batched prompts are not supported", "prompt", "unsupported_parameter")
        return body.prompt[0]
    return body.prompt


def _chat_logprobs(body: ChatCompletionRequest) -> int | None:
    """The native `logprobs` (alternatives per token, None = off) of a chat request."""
    if body.top_logprobs not in (None, 0) and not body.logprobs:
        raise InvalidRequest("top_logprobs: only allowed when logprobs is true", "top_logprobs", "invalid_value")
    return (body.top_logprobs or 0) if body.logprobs else None



def _messages(body: ChatCompletionRequest) -> list[Message]:
    out = []
    for i, m in enumerate(body.messages):
        # As vLLM does: text parts are joined by newlines; "developer" is OpenAI's new name for "system".
        text = m.content if isinstance(m.content, str) or m.content is None else "\n".join(p.text for p in m.content)
        text = turn_text(i, m.role, text, m.tool_calls)
        out.append(Message(role="system" if m.role == "developer" else m.role, content=text))
    return out


def _native(body: OpenAIRequest, max_tokens: int | None, logprobs: int | None, **prompt: Any) -> GenerateRequest:
    fields = {k: v for k in PASSED if (v := getattr(body, k)) is not None}
    try:
        return GenerateRequest(**prompt, **fields, max_tokens=max_tokens, logprobs=logprobs, stream=bool(body.stream))
    except ValidationError as e:  # a rule of the native API the OpenAI schema does not repeat (empty prompt)
        err = e.errors()[0]
        param = ".".join(str(x) for x in err["loc"]) or None
        raise InvalidRequest(f"{param}: {err['msg']}", param, err["type"]) from e


async def _serve(request: Request, body: OpenAIRequest, native: GenerateRequest, chat: bool,
                 default_max_tokens: int | None = None, plan: OutputPlan = OutputPlan()):
    meta = {"api": "openai.chat" if chat else "openai.completions", "user": body.user,
            "client_request_id": body.request_id}
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return await serve(request, native, body.n or 1, chat, meta, include_usage, default_max_tokens, plan)


@router.post("/v1/completions", responses={**sse_or_json(CompletionResponse, "the completion"), **GENERATION_ERRORS})
async def completions(body: CompletionRequest, request: Request):
    _check_common(request, body)
    prompt = _check_completion(body)
    native = _native(body, body.max_tokens, body.logprobs, prompt=prompt)
    return await _serve(request, body, native, chat=False, default_max_tokens=COMPLETIONS_DEFAULT_MAX_TOKENS)


@router.post("/v1/chat/completions",
             responses={**sse_or_json(ChatCompletionResponse, "the assistant's message"), **GENERATION_ERRORS})
async def chat_completions(body: ChatCompletionRequest, request: Request):
    _check_common(request, body)
    plan = await off_loop(lambda: plan_chat(body), plan_weight(body))  # its schemas compiled off the loop
    native = _native(body, body.max_completion_tokens or body.max_tokens, _chat_logprobs(body),
                     messages=_messages(body))
    return await _serve(request, body, native, chat=True, plan=plan)


def _card(request: Request) -> dict:
    return {"id": request.app.state.core.model_name, "object": "model", "created": STARTED, "owned_by": "conveyor",
            "max_model_len": request.app.state.max_len}


@router.get("/v1/models", response_model=ModelList, responses=error_responses(401))
async def list_models(request: Request) -> dict:
    return {"object": "list", "data": [_card(request)]}


@router.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=error_responses(401, 404))
async def get_model(model_id: str, request: Request) -> dict:
    card = _card(request)
    if model_id != card["id"]:
        raise NotFound(f"the model '{model_id}' does not exist; this server serves '{card['id']}'", "model",
                       "model_not_found")
    return card
