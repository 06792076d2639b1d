"""A chat or completion body as the native GenerateRequest: its messages for the template, its sampling fields.

Every OpenAI-shaped API builds its request here (openai.routes; responses.routes, whose body becomes a chat body
first), so the two cannot differ in how a turn is written or which fields reach the engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from services.gateway.edge.errors import InvalidRequest
from services.gateway.openai.tool_calls import turn_text
from services.gateway.session.request import GenerateRequest, Message

if TYPE_CHECKING:
    from services.gateway.openai.schemas import ChatCompletionRequest, OpenAIRequest

# Fields passed to the native request unchanged when given (both sides validate them alike).
PASSED = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "min_tokens",
    "stop_token_ids",
    "ignore_eos",
    "priority",
    "timeout",
    "stop",
    "session_id",
    "logit_bias",
    "prompt_logprobs",
    "truncate_prompt_tokens",
    # chat only (getattr's default: a completion body has none of them)
    "add_generation_prompt",
    "continue_final_message",
    "chat_template_kwargs",
)


def chat_messages(body: ChatCompletionRequest) -> list[Message]:
    out = []
    for i, m in enumerate(body.messages):
        # As vLLM does: text parts are joined by newlines; "developer" is OpenAI's new name for "system".
        text = m.content if isinstance(m.content, str) or m.content is None else "\n".join(p.text for p in m.content)
        text = turn_text(i, m.role, text, m.tool_calls)
        out.append(Message(role="system" if m.role == "developer" else m.role, content=text))
    return out


def native_request(body: OpenAIRequest, max_tokens: int | None, logprobs: int | None, **prompt: Any) -> GenerateRequest:
    fields = {k: v for k in PASSED if (v := getattr(body, k, None)) is not None}
    try:
        return GenerateRequest(**prompt, **fields, max_tokens=max_tokens, logprobs=logprobs, stream=bool(body.stream))
    except ValidationError as e:  # a rule of the native API the OpenAI schema does not repeat (empty prompt)
        err = e.errors()[0]
        param = ".".join(str(x) for x in err["loc"]) or None
        raise InvalidRequest(f"{param}: {err['msg']}", param, err["type"]) from e
