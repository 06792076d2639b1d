"""Request data: what callers submit (SamplingOptions, EngineRequest) and the engine's Sequence.

A Sequence's tokens are `prompt + outputs` in one list. `num_computed_tokens` of them have
their K/V in the cache; the step that computes the last one yields logits for the next token.
Prefill, chunked prefill, decode and recompute after preemption are all the same operation:
compute tokens [num_computed_tokens, num_tokens).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from services.worker.engine.errors import InvalidRequestError

MAX_LOGPROBS = 20  # most alternatives per token a request may ask for (OpenAI's top_logprobs limit; vLLM's default)
MAX_PENALTY = 2.0  # presence / frequency penalties lie in [-2, 2] (OpenAI's range)
MAX_BIAS = 100.0  # logit_bias values lie in [-100, 100] (OpenAI's range)


@dataclass(frozen=True)
class GrammarSpec:
    """A request's output constraint (the wire's shared.wire.events.Constraint), compiled by structured.py."""

    kind: str  # shared.text.grammar.KINDS
    spec: str  # for json_schema: the JSON Schema's text


@dataclass(frozen=True)
class SamplingOptions:
    temperature: float = 1.0  # 0 = greedy (exact argmax)
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # 1 = off
    seed: int | None = None  # per-request generator: same seed, same tokens, whatever the batch
    max_tokens: int = 16  # counts output tokens given in EngineRequest.output_token_ids
    min_tokens: int = 0  # EOS / stop tokens are masked until this many outputs exist
    stop_token_ids: tuple = ()
    ignore_eos: bool = False
    # OpenAI's penalties, over this request's output tokens so far (the prompt does not count):
    # logit[t] -= count[t] * frequency_penalty + (count[t] > 0) * presence_penalty. 0 = off.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None  # None = off; k >= 0: each sampled token's log probability and its k most likely
    grammar: GrammarSpec | None = None  # every output token must keep to it (None = free text)
    logit_bias: tuple = ()  # (token id, bias in [-100, 100]) pairs added to those logits before anything else
    # None = off; k >= 0: each prompt token's log probability (the first's is None), its rank and the k most likely
    # at its position, of the model's raw logits (prompt_logprobs.py)
    prompt_logprobs: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        """Raise InvalidRequestError naming every bad field."""
        bad = []
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            bad.append(f"temperature={self.temperature} (must be >= 0)")
        if not 0 < self.top_p <= 1:
            bad.append(f"top_p={self.top_p} (must be in (0, 1])")
        if self.top_k < -1:
            bad.append(f"top_k={self.top_k} (must be >= -1)")
        if not 0 <= self.min_p <= 1:
            bad.append(f"min_p={self.min_p} (must be in [0, 1])")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            bad.append(f"repetition_penalty={self.repetition_penalty} (must be > 0)")
        if self.max_tokens < 1:
            bad.append(f"max_tokens={self.max_tokens} (must be >= 1)")
        if self.min_tokens < 0:
            bad.append(f"min_tokens={self.min_tokens} (must be >= 0)")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -MAX_PENALTY <= value <= MAX_PENALTY):
                bad.append(f"{name}={value} (must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}])")
        if self.logprobs is not None and not (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS):
            bad.append(f"logprobs={self.logprobs!r} (must be None or in [0, {MAX_LOGPROBS}])")
        if self.prompt_logprobs is not None and not (
            isinstance(self.prompt_logprobs, int) and 0 <= self.prompt_logprobs <= MAX_LOGPROBS
        ):
            bad.append(f"prompt_logprobs={self.prompt_logprobs!r} (must be None or in [0, {MAX_LOGPROBS}])")
        if any(not -MAX_BIAS <= b <= MAX_BIAS for _, b in self.logit_bias):
            bad.append(f"logit_bias={self.logit_bias!r} (biases must be in [-{MAX_BIAS:g}, {MAX_BIAS:g}])")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad.append(f"stop_token_ids={self.stop_token_ids!r} (must be non-negative ints)")
        if bad:
            raise InvalidRequestError("invalid sampling options: " + ", ".join(bad))


@dataclass
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    priority: int = 0  # higher number = less important (preempted first), like vLLM
    output_token_ids: list[int] = field(default_factory=list)  # already generated elsewhere (resume)
    group_id: str = ""  # requests sharing it (the choices of one n > 1 request) have one prompt: prefilled once
    session_id: str = ""  # its conversation session: the KV is kept for the session's next turn (session_kv.py)


class SequenceStatus(enum.Enum):
    WAITING = "WAITING"  # queued, never scheduled
    PREFILLING = "PREFILLING"  # running, computing prompt (+ resumed outputs) in chunks
    DECODING = "DECODING"  # running, one token per step
    PREEMPTED = "PREEMPTED"  # blocks taken back; queued at the front to recompute
    FINISHED = "FINISHED"
    FAILED = "FAILED"


class Sequence:
    """The engine's mutable state of one request. Owned by the scheduler; never shared."""

    __slots__ = (
        "request_id",
        "sampling",
        "priority",
        "arrival",
        "token_ids",
        "num_prompt_tokens",
        "num_emitted",
        "status",
        "block_table",
        "block_hashes",
        "num_computed_tokens",
        "num_cached_tokens",
        "num_registered_blocks",
        "generator",
        "finish_reason",
        "error_reason",
        "error",
        "stop_ids",
        "group_id",
        "grammar",
        "session_id",
        "prompt_lps",
        "draft",
        "ngrams",
        "admitted_tokens",
    )

    def __init__(self, req: EngineRequest, arrival: int, eos_token_ids: frozenset[int]):
        self.request_id = req.request_id
        self.group_id = req.group_id
        self.session_id = req.session_id
        self.sampling = req.sampling
        self.priority = req.priority
        self.arrival = arrival  # global admission counter: larger = newer
        self.token_ids: list[int] = list(req.prompt_token_ids) + list(req.output_token_ids)
        self.num_prompt_tokens = len(req.prompt_token_ids)
        self.num_emitted = len(req.output_token_ids)  # outputs the caller already has
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []  # chained hashes of the full blocks of token_ids
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at its first admission
        self.num_registered_blocks = 0  # leading blocks of block_table already in the prefix cache
        self.finish_reason: str | None = None
        self.error_reason: str | None = None
        self.error: str | None = None
        ignore = req.sampling.ignore_eos
        self.stop_ids = frozenset(req.sampling.stop_token_ids) | (frozenset() if ignore else eos_token_ids)
        # The model runner's per-request sampling state, set by its init_sequence (a torch.Generator for the
        # torch runner): kept here so that this module, and whatever imports the request types, needs no torch.
        self.generator: object | None = None
        # Its grammar matcher while it has a constraint (structured.py); released when it ends.
        self.grammar: object | None = None
        # Prompt log probabilities gathered so far (entry j: prompt token j + 1's), while they are owed: the request
        # asked and has emitted nothing yet (a resumed request's were sent by its earlier worker). Handed out with
        # the first output token, then None.
        self.prompt_lps: list | None = [] if req.sampling.prompt_logprobs is not None and not self.num_emitted else None
        # Speculative decoding (spec.py): the tokens drafted after token_ids for this step ([] but while one is
        # scheduled with drafts), and its n-gram index (built at its first draft).
        self.draft: list[int] = []
        self.ngrams: object | None = None
        self.admitted_tokens = 0  # num_tokens at its last admission (what it has emitted since: first tokens first)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_outputs(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def importance_key(self) -> tuple[int, int]:
        """Sorts most important first: lower priority number, then older."""
        return (self.priority, self.arrival)

    @property
    def can_draft(self) -> bool:
        """Whether drafted tokens can be checked against its next tokens exactly: greedy, decoding, and nothing that
        makes a token depend on more than the logits of its row (penalties over the outputs so far, a grammar,
        EOS masked until min_tokens) nor anything asked per token beyond the token (log probabilities)."""
        o = self.sampling
        return (
            o.greedy
            and self.status == SequenceStatus.DECODING
            and o.logprobs is None
            and o.grammar is None
            and not o.logit_bias
            and o.repetition_penalty == 1.0
            and o.presence_penalty == 0.0
            and o.frequency_penalty == 0.0
            and self.num_outputs >= o.min_tokens
        )

    def tokens_at(self, start: int, n: int) -> list[int]:
        """The n tokens from position `start` this step computes: its own, then its drafts."""
        own = self.token_ids[start : start + n]
        return own + self.draft[: n - len(own)] if self.draft else own

    @property
    def is_done(self) -> bool:
        return self.status in (SequenceStatus.FINISHED, SequenceStatus.FAILED)
