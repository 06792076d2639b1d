"""The native API's request body, validated strictly (a wrong type is an error, not a guess)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field
from pydantic_core import PydanticCustomError


INT32_MAX = 2**31 - 1  # integers travel as msgpack ints: bounded so every valid value encodes
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # a seed's range: OpenAI's schema takes any int64 (msgpack encodes it)
MAX_CHOICES = 16  # most choices (n) per request: each is a request of its own (groups.py)
MAX_LOGPROBS = 20  # most alternatives per token (the engine's limit, OpenAI's top_logprobs limit)
# Levels a free-form JSON value (a tool, its schema, a response format, a tool call) may nest. Python's own code
# (json.dumps, deepcopy) recurses once a level, and a value as deep as its parser allows (~950) overflowed the
# stack further on (RecursionError, a 500); JSON Schemas deeper than this are not written by people.
MAX_NESTING = 64


def nesting(value: Any, limit: int = MAX_NESTING) -> int:
    """How many levels of lists and objects value has, counted without recursion, up to limit + 1."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        v, depth = todo.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, depth)
            if depth > limit:
                break
            todo.extend((x, depth + 1) for x in (v.values() if isinstance(v, dict) else v))
    return deepest


def shallow(value: Any) -> Any:
    """A validator: the value, if it nests at most MAX_NESTING levels."""
    if nesting(value) > MAX_NESTING:
        raise PydanticCustomError(
            "too_deep", "nests deeper than {limit} levels; at most {limit} levels are accepted", {"limit": MAX_NESTING}
        )
    return value


Shallow = AfterValidator(shallow)

MAX_LOGIT_BIAS = 1024  # entries of one logit_bias (each is a row of the sampler's work on every step)
LogitBias = Annotated[
    dict[Annotated[str, Field(pattern=r"^[0-9]{1,10}$")], Annotated[float, Field(ge=-100.0, le=100.0)]],
    Field(max_length=MAX_LOGIT_BIAS),
]

# A stop string: matched on the output text; neither it nor any part of it is returned.
StopString = Annotated[str, Field(min_length=1, max_length=256)]
Stop = StopString | Annotated[list[StopString], Field(max_length=4)]


MAX_PROMPT_IDS = 1_000_000  # token ids of one prompt (the context window bounds it further)
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
TokenIds = Annotated[list[TokenId], Field(min_length=1, max_length=MAX_PROMPT_IDS)]
MAX_BATCH = 64  # choices of a request of a prompt list: prompts x n (each a request of its own)


class Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    role: Literal["system", "user", "assistant", "tool"]
    content: str = Field(max_length=1_000_000)


class Grammar(BaseModel):
    """TGI's grammar: the output keeps to a regular expression or a JSON Schema (openai.structured_output)."""

    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["regex", "json"] = Field(..., description="regex: value is a pattern; json: a JSON Schema")
    value: str | Annotated[dict[str, Any], AfterValidator(shallow)] = Field(
        ..., description="the pattern (at most 65536 characters), or the schema (an object or its JSON text)"
    )


class GenerateRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    prompt: str | None = Field(None, min_length=1, description="raw prompt; exactly one of prompt/messages")
    messages: list[Message] | None = Field(None, min_length=1, description="chat turns, templated by the model")
    prompt_token_ids: TokenIds | None = Field(
        None, description="the prompt as token ids (each below the vocabulary size), instead of prompt or messages"
    )
    max_tokens: int | None = Field(None, ge=1, description="most new tokens (1..4096, within the context window)")
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="0 = greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, le=INT32_MAX, description="0 or -1 = off")
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    presence_penalty: float = Field(
        0.0,
        ge=-2.0,
        le=2.0,
        description="OpenAI's: subtracted from the logit of every token already in the output (0 = off)",
    )
    frequency_penalty: float = Field(
        0.0,
        ge=-2.0,
        le=2.0,
        description="OpenAI's: subtracted from a token's logit once per time it is already in the output (0 = off)",
    )
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX, description="any int64; same seed, same tokens")
    min_tokens: int = Field(0, ge=0, le=INT32_MAX)
    stop_token_ids: list[Annotated[int, Field(ge=0, le=INT32_MAX)]] = Field(default_factory=list, max_length=64)
    logit_bias: LogitBias | None = Field(
        None, description="OpenAI's: token id (as a string) -> -100..100 added to its logit before sampling"
    )
    stop: Stop | None = Field(None, description="up to 4 strings that end the output (not included in it)")
    ignore_eos: bool = False
    priority: int = Field(0, ge=-1000, le=1000, description="lower is served first")
    timeout: float | None = Field(None, gt=0, le=3600, description="seconds until the request times out")
    logprobs: int | None = Field(
        None,
        ge=0,
        le=MAX_LOGPROBS,
        description="each output token's log probability and its N most likely alternatives (null = none)",
    )
    prompt_logprobs: int | None = Field(
        None,
        ge=0,
        le=MAX_LOGPROBS,
        description="each prompt token's log probability, rank and N most likely alternatives (vLLM's; null = none)",
    )
    stream: bool = False
    session_id: str | None = Field(
        None, description="conversation session the turn belongs to (as the X-Session-ID header; README: Sessions)"
    )
    n: int = Field(1, ge=1, le=MAX_CHOICES, description="choices: each a request of its own, the prompt prefilled once")
    grammar: Grammar | None = Field(None, description="TGI's: the output matches a regex or a JSON Schema")
    truncate_prompt_tokens: int | None = Field(
        None, ge=-1, le=INT32_MAX, description="vLLM's: keep the prompt's last k tokens (-1: what max_tokens leaves)"
    )
    # messages: how the chat template writes them (vLLM's fields; shared.text.chat_template.render)
    add_generation_prompt: bool = Field(True, description="messages: end with the assistant turn's opening")
    continue_final_message: bool = Field(
        False, description="messages: the output continues the last message (no new turn); add_generation_prompt false"
    )
    chat_template_kwargs: Annotated[dict[str, Any], AfterValidator(shallow)] | None = Field(
        None, max_length=64, description="messages: variables passed to the chat template (at most 64 KiB as JSON)"
    )
