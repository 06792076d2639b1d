"""OpenAI's request and response bodies (completions, chat completions, models), plus vLLM's extras.

Requests are validated strictly, like the native API. Every field an OpenAI client may send is
known: the ones Conveyor cannot honour (echo, suffix, best_of...) are refused with a
400 naming them, never silently ignored. Response models document the answers (and let the API
fuzzer check them); the handlers build plain dicts of the same shape.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from services.gateway.session.request import (
    INT32_MAX,
    LogitBias,
    INT64_MAX,
    INT64_MIN,
    MAX_CHOICES,
    MAX_BATCH,
    MAX_LOGPROBS,
    Shallow,
    Stop,
    MAX_PROMPT_IDS,
    TokenId,
    TokenIds,
    shallow,
)

STRICT = ConfigDict(strict=True, extra="forbid")


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool | None = Field(None, description="send one last chunk with the usage (and no choices)")
    continuous_usage_stats: bool | None = Field(
        None, description="vLLM's: with include_usage, every chunk carries the usage so far"
    )


MAX_PATTERN = 65_536  # characters of a structured_outputs regex
MAX_GRAMMAR = 262_144  # characters of a structured_outputs grammar
MAX_CHOICE = 1024  # characters of one structured_outputs choice
MAX_CHOICES_LISTED = 256  # strings of a structured_outputs choice


class StructuredOutputs(BaseModel):
    """vLLM's structured_outputs (its StructuredOutputsParams): one constraint the output keeps to
    (openai.structured_output.structured_constraint)."""

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)
    json_schema: Annotated[dict[str, Any], Shallow] | bool | str | None = Field(
        None, alias="json", description="a JSON Schema (an object, or its JSON text) the output is valid against"
    )
    regex: str | None = Field(None, min_length=1, max_length=MAX_PATTERN, description="the output matches it whole")
    choice: list[Annotated[str, Field(min_length=1, max_length=MAX_CHOICE)]] | None = Field(
        None, min_length=1, max_length=MAX_CHOICES_LISTED, description="the output is exactly one of these"
    )
    grammar: str | None = Field(
        None, min_length=1, max_length=MAX_GRAMMAR, description="a Lark (llguidance) or GBNF (root ::= ...) grammar"
    )
    json_object: bool | None = Field(None, description="true: the output is one JSON object")
    # vLLM's options of its JSON backends: Conveyor's JSON is always compact and there is no fallback backend
    disable_any_whitespace: bool | None = Field(None, description="accepted: the JSON never has free whitespace")
    disable_fallback: bool | None = Field(None, description="accepted: there is no other backend to fall back to")
    disable_additional_properties: bool | None = Field(None, description="not supported: true is a 400")
    whitespace_pattern: str | None = Field(None, max_length=256, description="not supported: a 400")
    structural_tag: str | None = Field(None, max_length=MAX_GRAMMAR, description="not supported: a 400")


# vLLM's guided_* fields, removed in its 0.12: a 400 that names the structured_outputs field replacing each
GUIDED = {
    "guided_json": "structured_outputs.json",
    "guided_regex": "structured_outputs.regex",
    "guided_choice": "structured_outputs.choice",
    "guided_grammar": "structured_outputs.grammar",
    "guided_whitespace_pattern": "structured_outputs.whitespace_pattern",
    "guided_decoding_backend": "nothing (remove it)",
}


class OpenAIRequest(BaseModel):
    """Fields both endpoints share."""

    model_config = STRICT

    model: str = Field(..., min_length=1, max_length=256, description="must be the served model (GET /v1/models)")
    max_tokens: int | None = Field(None, ge=1, description="most new tokens")
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="0 = greedy (default 1)")
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int | None = Field(None, ge=1, le=MAX_CHOICES, description="choices per request (prompt prefilled once)")
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: Stop | None = Field(None, description="up to 4 strings that end the output (not included in it)")
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX, description="any int64; same seed, same output")
    presence_penalty: float | None = Field(
        None, ge=-2.0, le=2.0, description="subtracted from the logit of every token already in the output (0 = off)"
    )
    frequency_penalty: float | None = Field(
        None,
        ge=-2.0,
        le=2.0,
        description="subtracted from a token's logit once per time it is already in the output (0 = off)",
    )
    logit_bias: LogitBias | None = Field(None, description="token id (as a string) -> -100..100 added to its logit")
    user: str | None = Field(None, max_length=256, description="end-user id, recorded with the request")
    # vLLM's extra sampling and scheduling fields
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX, description="0 or -1 = off")
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    min_tokens: int | None = Field(None, ge=0, le=INT32_MAX)
    stop_token_ids: list[Annotated[int, Field(ge=0, le=INT32_MAX)]] | None = Field(None, max_length=64)
    ignore_eos: bool | None = None
    priority: int | None = Field(None, ge=-1000, le=1000, description="lower is served first")
    request_id: str | None = Field(None, min_length=1, max_length=128, description="caller's id, recorded")
    session_id: str | None = Field(
        None, description="conversation session the turn belongs to (as the X-Session-ID header; README: Sessions)"
    )
    structured_outputs: StructuredOutputs | None = Field(None, description="vLLM's: regex, choice, grammar, json")
    return_token_ids: bool | None = Field(
        None,
        description="vLLM's: each choice's token_ids, and the prompt_token_ids (a completion's choice, a chat's answer)",
    )
    truncate_prompt_tokens: int | None = Field(
        None, ge=-1, le=INT32_MAX, description="keep the prompt's last k tokens (-1: what max_tokens leaves)"
    )
    prompt_logprobs: int | None = Field(
        None,
        ge=0,
        le=MAX_LOGPROBS,
        description="each prompt token's log probability, rank and N most likely in choices[].prompt_logprobs",
    )
    # Conveyor's
    timeout: float | None = Field(None, gt=0, le=3600, description="seconds until the request times out")
    # vLLM's removed guided_* fields (GUIDED): known, so that openai.routes refuses each naming its replacement
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_whitespace_pattern: Any = None
    guided_decoding_backend: Any = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    type: str = Field(..., description="text | json_object | json_schema (with json_schema: {name, schema, strict})")

    @model_validator(mode="after")
    def _shallow(self):
        shallow(self.model_extra)  # its free-form fields (json_schema) nest no deeper than any other value
        return self


class CompletionRequest(OpenAIRequest):
    prompt: (
        str
        | Annotated[list[str], Field(max_length=MAX_BATCH)]
        | TokenIds
        # an empty one is refused by name (openai.routes), not as the union's first branch
        | Annotated[list[Annotated[list[TokenId], Field(max_length=MAX_PROMPT_IDS)]], Field(max_length=MAX_BATCH)]
    ) = Field(
        ...,
        description="the prompt: a string, a list of strings, a list of token ids, or a list of token-id lists "
        f"(one answer per prompt and n; at most {MAX_BATCH} in all)",
    )
    logprobs: int | None = Field(
        None,
        ge=0,
        le=MAX_LOGPROBS,
        description="each output token's log probability "
        "and its N most likely alternatives (OpenAI allows up to 5, vLLM and Conveyor 20)",
    )
    max_tokens: int | None = Field(None, ge=0, description="most new tokens; 0 only with echo: the prompt alone")
    echo: bool | None = Field(
        None, description="the prompt before the completion, in text and (with logprobs) logprobs, as vLLM"
    )
    suffix: str | None = Field(None, description="not supported: null")
    best_of: int | None = Field(None, ge=1, le=20, description="only 1 is supported")
    response_format: ResponseFormat | None = Field(None, description="vLLM's: as chat's (json_object, json_schema)")


class TextPart(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: str = Field(max_length=1_000_000)


class ChatMessageIn(BaseModel):
    model_config = STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = Field(
        ...,
        description="text, or a list of text parts (null or left out: only in an assistant turn of tool calls)",
    )
    name: str | None = Field(None, max_length=256, description="accepted, not used by the chat template")
    tool_calls: Annotated[list[dict[str, Any]], Shallow] | None = Field(
        None, max_length=128, description="an assistant turn's calls"
    )
    tool_call_id: str | None = Field(None, max_length=256, description="a tool turn: the call it answers")

    @model_validator(mode="before")
    @classmethod
    def _calls_need_no_content(cls, data: Any) -> Any:
        """As OpenAI's schema: an assistant turn's content is required unless it carries tool_calls (clients send
        the model's calls back without it); a system, developer, user or tool turn's always is, so a missing one
        there is still the field's own "Field required" at messages.N.content."""
        if isinstance(data, dict) and "content" not in data and data.get("role") == "assistant":
            if data.get("tool_calls"):
                return {**data, "content": None}
        return data


class ChatCompletionRequest(OpenAIRequest):
    messages: list[ChatMessageIn] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="most new tokens (wins over max_tokens)")
    logprobs: bool | None = Field(None, description="each output token's log probability in choices[].logprobs")
    top_logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS, description="with logprobs: the N most likely alternatives of each token"
    )
    response_format: ResponseFormat | None = None
    tools: Annotated[list[dict[str, Any]], Shallow] | None = Field(
        None, description="function tools (services/gateway/openai/tool_calls.py)"
    )
    tool_choice: str | Annotated[dict[str, Any], Shallow] | None = Field(
        None, description="none | auto | required | a named function"
    )
    parallel_tool_calls: bool | None = None
    # vLLM's: how the chat template writes the messages (shared.text.chat_template.render)
    add_generation_prompt: bool | None = Field(None, description="end with the assistant turn's opening (default)")
    continue_final_message: bool | None = Field(
        None, description="the answer continues the last (assistant) message, no new turn; add_generation_prompt false"
    )
    chat_template_kwargs: Annotated[dict[str, Any], Shallow] | None = Field(
        None, max_length=64, description="variables passed to the chat template (at most 64 KiB as JSON)"
    )
    echo: bool | None = Field(
        None, description="vLLM's: the answer's content starts with the last message's (if it is the assistant's)"
    )
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = Field(None, max_length=64)


# ---- responses ----


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


FinishReason = Literal["stop", "length", "tool_calls"]


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(description="each output token as text (`bytes:\\xNN...` for part of a character)")
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] = Field(description="per token: its alternatives and itself")
    text_offset: list[int] = Field(description="per token: the character offset of its text in the output")


class PromptLogprob(BaseModel):
    logprob: float
    rank: int = Field(description="among the whole vocabulary, 1 = most likely")
    decoded_token: str


# vLLM's prompt_logprobs: null for the first prompt token, then token id -> its entry (the token, its k most likely)
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None
    token_ids: list[int] | None = Field(None, description="return_token_ids: the output's token ids")
    prompt_token_ids: list[int] | None = Field(None, description="return_token_ids: its prompt's token ids")
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[dict[str, Any]] | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float | None
    bytes: list[int] | None = Field(description="the token's exact UTF-8 bytes")


class TokenLogprobOut(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprobOut] | None
    refusal: list[TokenLogprobOut] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason
    token_ids: list[int] | None = Field(None, description="return_token_ids: the output's token ids")
    prompt_logprobs: PromptLogprobs | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int] | None = Field(None, description="return_token_ids: the prompt's token ids")


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]
