"""POST /tokenize and POST /detokenize, in vLLM's shapes (its serving_tokenization): token-counting clients and
benchmarks call them. A chat's prompt is rendered exactly as the tokenizer service renders a request's
(shared.text.chat_template), so the count is what a request would be charged."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from services.gateway.edge.deps import Core
from services.gateway.edge.errors import InvalidRequest, NotFound
from services.gateway.edge.openapi_doc import error_responses
from services.gateway.session.intake import check_chat_options
from services.gateway.session.request import INT32_MAX, Shallow
from services.gateway.text.render import off_loop
from shared.text.chat_template import TemplateRefused, render

router = APIRouter(tags=["Tokenization"])
STRICT = ConfigDict(strict=True, extra="forbid")


class TokenizeMessage(BaseModel):
    model_config = STRICT
    role: str = Field(max_length=64)
    content: str | None = Field(None, max_length=1_000_000)


class TokenizeRequest(BaseModel):
    model_config = STRICT
    model: str | None = None
    prompt: str | None = Field(None, max_length=4_000_000, description="text; exactly one of prompt/messages")
    messages: list[TokenizeMessage] | None = Field(None, min_length=1, max_length=10_000)
    add_special_tokens: bool | None = Field(
        None, description="the tokenizer's special tokens (default: true for prompt, false for messages: the template)"
    )
    add_generation_prompt: bool = Field(True, description="messages: end with the assistant turn's opening")
    continue_final_message: bool = Field(False, description="messages: end inside the last message (to continue it)")
    chat_template_kwargs: Annotated[dict[str, Any], Shallow] | None = Field(
        None, max_length=64, description="messages: variables passed to the chat template"
    )
    tools: Annotated[list[dict[str, Any]], Shallow] | None = Field(None, max_length=128)
    return_token_strs: bool = Field(False, description="also each token's string")


class DetokenizeRequest(BaseModel):
    model_config = STRICT
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0, le=INT32_MAX)]] = Field(max_length=1_000_000)


def _check_model(core, model: str | None) -> None:
    if model is not None and model != core.model_name:
        raise NotFound(
            f"the model '{model}' does not exist; this server serves '{core.model_name}'", "model", "model_not_found"
        )


def _tokenize(core, body: TokenizeRequest) -> dict:
    tok = core.tokenizer
    if body.messages is not None:
        chat = [{"role": m.role, "content": m.content or ""} for m in body.messages]
        try:
            text = render(
                tok,
                chat,
                body.tools,
                body.add_generation_prompt,
                body.continue_final_message,
                body.chat_template_kwargs,
            )
        except TemplateRefused as e:
            raise InvalidRequest(f"messages: {e}", "messages", "invalid_value") from e
        ids = tok.encode(text, add_special_tokens=bool(body.add_special_tokens))
    else:
        ids = tok.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
    return {
        "count": len(ids),
        "max_model_len": core.max_len,
        "tokens": ids,
        "token_strs": tok.convert_ids_to_tokens(ids) if body.return_token_strs else None,
    }


@router.post("/tokenize", responses=error_responses(400, 401, 404))
async def tokenize(body: TokenizeRequest, core: Core) -> dict:
    _check_model(core, body.model)
    if (body.prompt is None) == (body.messages is None):
        which = "both were given" if body.prompt is not None else "neither was given"
        raise InvalidRequest(f"give exactly one of prompt or messages ({which})", "prompt", "prompt_or_messages")
    if body.tools is not None and body.messages is None:
        raise InvalidRequest("tools: only with messages", "tools", "invalid_value")
    check_chat_options(body)  # the same rules as a request's
    size = len(body.prompt or "") + sum(len(m.content or "") for m in body.messages or ())
    return await off_loop(lambda: _tokenize(core, body), size)


@router.post("/detokenize", responses=error_responses(400, 401, 404))
async def detokenize(body: DetokenizeRequest, core: Core) -> dict:
    _check_model(core, body.model)
    vocab = len(core.tokenizer)
    if bad := [t for t in body.tokens if t >= vocab]:
        raise InvalidRequest(
            f"tokens: every id must be below the vocabulary size {vocab} (got {bad[0]})",
            "tokens",
            "token_id_out_of_range",
        )
    return {"prompt": await off_loop(lambda: core.tokenizer.decode(body.tokens), len(body.tokens) * 4)}


# The tokenizer's configuration values a client can use (JSON scalars: the rest, objects of the tokenizer
# library, say nothing across HTTP).
_SCALARS = (str, int, float, bool)


@router.get("/tokenizer_info", responses=error_responses(401))
async def tokenizer_info(core: Core) -> dict:
    """The served tokenizer's class, configuration, special tokens and chat template, as vLLM's GET
    /tokenizer_info answers (a client that tokenizes on its side checks it has the same tokenizer)."""
    tok = core.tokenizer
    config = {k: v for k, v in getattr(tok, "init_kwargs", {}).items() if isinstance(v, _SCALARS)}
    return {
        **config,
        "tokenizer_class": type(tok).__name__,
        "model_max_length": core.max_len,
        "vocab_size": len(tok),
        **{f"{name}_token": getattr(tok, f"{name}_token", None) for name in ("bos", "eos", "pad", "unk")},
        "chat_template": getattr(tok, "chat_template", None),
    }
