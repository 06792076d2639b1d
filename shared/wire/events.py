"""Every event on the bus: one frozen struct per event, msgpack on the wire.

Wire structs only: services build their own internal objects from them and never mutate
them. Each struct carries `schema_version` (bumped on an incompatible change; consumers
reject versions they do not know) and `traceparent` (W3C trace context of the producer).
"""

from __future__ import annotations

import enum
from typing import Union

import msgspec

SCHEMA_VERSION = 1


class State(enum.StrEnum):
    """A request's lifecycle state (shared/state/lifecycle.py holds the table of moves between them). StrEnum: each is
    its own name on the wire, in Redis, in logs and in f-strings."""

    RECEIVED = "RECEIVED"  # gateway accepted it
    PREPROCESSED = "PREPROCESSED"  # tokenizer produced the prompt's token ids
    QUEUED = "QUEUED"  # in the scheduler's queue
    SCHEDULED = "SCHEDULED"  # sent to a worker
    PREFILLING = "PREFILLING"  # the worker is computing the prompt
    DECODING = "DECODING"  # first token produced; generating
    PREEMPTED = "PREEMPTED"  # blocks taken back; will recompute
    FINISHED = "FINISHED"  # terminal: stop or length
    FAILED = "FAILED"  # terminal: with a reason
    CANCELLED = "CANCELLED"  # terminal: client, disconnect or shutdown
    TIMED_OUT = "TIMED_OUT"  # terminal: deadline passed


class Reason(enum.StrEnum):
    """Why a request failed, was cancelled, handed back or moved: every reason a service sends in an event or
    records with a transition (besides a finish reason, stop or length). On the wire each is its plain string, as
    before it was an enum; a reason not listed here does not decode, so one a service starts sending is added here
    first."""

    # failed (Failed.reason)
    INVALID = "invalid"  # the client's input cannot be served as given (param says which field)
    TOO_LONG = "too_long"  # the request can never fit the context window or the KV pool
    OOM = "oom"  # out of device memory even when the request ran alone
    WORKER_ERROR = "worker_error"  # any other exception while a worker processed it
    WORKER_LOST = "worker_lost"  # its worker was lost too many times (or, cancel: the worker it was on is lost)
    INTERNAL = "internal"  # a service could not process it (a poison entry, a tokenizer exception)
    OVERLOADED = "overloaded"  # refused: it could no longer start before its deadline
    STATE_LOST = "state_lost"  # Redis lost the request's context
    # cancelled (Cancelled.reason, CancelRequested.reason)
    CLIENT_CANCEL = "client_cancel"  # an operator's or client's cancel
    CLIENT_DISCONNECT = "client_disconnect"  # the client went away (or its gateway died)
    SHUTDOWN = "shutdown"  # the process holding it is stopping (also a worker's hand-back)
    TIMEOUT = "timeout"  # its deadline passed: the worker is told to stop
    STOP_STRING = "stop_string"  # the gateway matched a stop string (also the FINISHED transition's reason)
    CHOICE_FAILED = "choice_failed"  # a sibling choice (n > 1) ended the request
    # transitions only
    DEADLINE = "deadline"  # the TIMED_OUT transition's
    LOST_IN_TRANSIT = "lost_in_transit"  # queued again: its placement never reached the worker
    MOVED = "moved"  # a worker dropped it: it was placed elsewhere meanwhile


class ResyncReason(enum.StrEnum):
    """Why the scheduler's KV index lost track of a worker's cache (KvResyncRequested)."""

    UNKNOWN_INCARNATION = "unknown_incarnation"  # events of a worker process the index never saw start
    GAP = "gap"  # an event's number skipped some (the capped stream was trimmed)
    MISSED = "missed"  # its heartbeat names an event the index never applied


class SessionState(enum.StrEnum):
    """A conversation session's state (shared/state/sessions.py holds the table of moves between them)."""

    OPEN = "OPEN"  # no turn running and no KV kept: its next turn computes the whole conversation
    RUNNING = "RUNNING"  # one of its turns is a request in flight (another turn meanwhile is a 409)
    PAUSED = "PAUSED"  # between turns, its KV kept in a worker's pool: the next turn prefills only new tokens
    SWAPPED = "SWAPPED"  # between turns, its KV moved to the worker's second tier (disk): swapped back on resume
    CLOSED = "CLOSED"  # closed by its owner (DELETE): its KV released, its record gone


class SessionReason(enum.StrEnum):
    """Why a session moved (recorded with the move; GET /v1/sessions/{id} shows the last)."""

    OPENED = "opened"  # POST /v1/sessions
    TURN = "turn"  # a turn started, or ended with its KV kept
    TURN_ENDED = "turn_ended"  # a turn ended without its KV kept (failed, cancelled, timed out, nothing to keep)
    STALE_TURN = "stale_turn"  # a new turn found the previous one ended without anyone closing it (its gateway died)
    PRESSURE = "pressure"  # the worker needed the blocks: swapped to the second tier (or dropped, tier full)
    IDLE = "idle"  # idle past the KV idle TTL: its KV was released
    WORKER_RESTART = "worker_restart"  # the worker holding its KV stopped
    CLIENT_CLOSE = "client_close"  # DELETE /v1/sessions/{id}


class ChatMessage(msgspec.Struct, frozen=True):
    role: str  # system | user | assistant | tool
    content: str  # the message text


class Constraint(msgspec.Struct, frozen=True):
    """What the output must be, enforced token by token (shared/text/grammar.py compiles it)."""

    kind: str  # shared.text.grammar.KINDS: json_schema (one JSON value valid against `spec`), lark, regex
    spec: str  # the JSON Schema as JSON text, the Lark grammar, the regular expression


class Sampling(msgspec.Struct, frozen=True, kw_only=True):
    """Generation parameters as the client gave them (validated by the gateway)."""

    max_tokens: int  # most new tokens, 1..4096 and within the context window
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass, (0, 1]
    top_k: int = 0  # 0 = off
    min_p: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off
    seed: int | None = None  # per-request RNG seed; same seed, same tokens
    min_tokens: int = 0  # stop tokens are masked until this many were generated
    stop_token_ids: tuple[int, ...] = ()  # extra token ids that end generation
    ignore_eos: bool = False  # keep generating past EOS
    presence_penalty: float = 0.0  # OpenAI's, over the output so far, [-2, 2]; 0 = off
    frequency_penalty: float = 0.0  # OpenAI's, over the output so far, [-2, 2]; 0 = off
    logprobs: int | None = None  # None = off; k: each token's log probability and its k most likely (0..20)
    constraint: Constraint | None = None  # grammar every output token must keep to (None = free text)
    logit_bias: tuple[tuple[int, float], ...] = ()  # OpenAI's: (token id, -100..100) added to its logit
    prompt_logprobs: int | None = None  # None = off; k: each prompt token's log probability, rank and k most likely


class Event(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    schema_version: int = SCHEMA_VERSION  # wire schema of this event
    traceparent: str = ""  # W3C trace context of the producing span ("" = none)


class RequestReceived(Event, tag="request_received", kw_only=True):
    request_id: str  # 128-bit random hex id given by the gateway
    reply_to: str  # reply stream of the gateway holding the client
    prompt: str | None = None  # raw prompt (exactly one of prompt/messages)
    messages: tuple[ChatMessage, ...] | None = None  # chat turns, templated by the tokenizer
    prompt_token_ids: tuple[int, ...] = ()  # a prompt given as token ids (checked by the gateway), not encoded
    truncate_prompt_tokens: int = 0  # keep only the prompt's last k tokens (0 = all; -1 = what max_tokens leaves)
    sampling: Sampling  # generation parameters
    priority: int = 0  # lower value = served first
    deadline: float  # epoch seconds after which the request times out
    adaptive_deadline: bool = False  # no client timeout: the scheduler predicts one (deadline is the cap)
    received_at: float  # epoch seconds at the gateway's receipt
    group_id: str = ""  # the choices of one request with n > 1 share it: placed together, prompt prefilled once
    group_size: int = 1  # how many requests share group_id (n)
    tools: str = ""  # OpenAI tool definitions (a JSON list) the tokenizer renders into the prompt ("" = none)
    # messages: how the chat template writes them (shared.text.chat_template.render)
    add_generation_prompt: bool = True  # end with the assistant turn's opening
    continue_final_message: bool = False  # end inside the last message: the output continues it
    chat_template_kwargs: str = ""  # the template's variables, a JSON object ("" = none)
    session: str = ""  # the conversation session's key (shared.state.sessions) this turn belongs to ("" = none)
    session_worker: str = ""  # the worker that kept the session's KV after its last turn ("" = none known)


class Preprocessed(Event, tag="preprocessed", kw_only=True):
    request_id: str  # request id
    reply_to: str  # reply stream of the gateway holding the client
    prompt_token_ids: tuple[int, ...]  # templated, tokenized prompt
    sampling: Sampling  # generation parameters
    priority: int  # lower value = served first
    deadline: float  # epoch seconds
    adaptive_deadline: bool = False  # no client timeout: the scheduler predicts one (deadline is the cap)
    received_at: float  # epoch seconds at the gateway's receipt
    block_size: int = 0  # tokens per block of block_hashes (0: none attached)
    block_hashes: tuple[bytes, ...] = ()  # chained hash of each full prompt block (shared/wire/block_hash.py)
    group_id: str = ""  # the choices of one request with n > 1 share it ("" = alone)
    group_size: int = 1  # how many requests share group_id (n)
    session: str = ""  # the conversation session's key this turn belongs to ("" = none)
    session_worker: str = ""  # the worker holding the session's KV: placed there when it has room


class Scheduled(Event, tag="scheduled", kw_only=True):
    request_id: str  # request id
    worker_id: str  # worker chosen by the scheduler
    reply_to: str  # where the worker sends tokens
    prompt_token_ids: tuple[int, ...]  # tokenized prompt
    output_token_ids: tuple[int, ...] = ()  # tokens already generated (resume after a move)
    sampling: Sampling  # generation parameters
    priority: int  # lower value = served first
    deadline: float  # epoch seconds
    received_at: float = 0.0  # epoch seconds at the gateway's receipt (keeps its place if requeued)
    attempt: int = 1  # 1 for the first placement, +1 per move to another worker
    group_id: str = ""  # the choices of one request with n > 1 share it: the worker prefills their prompt once
    session: str = ""  # the conversation session's key: the worker keeps the KV for its next turn ("" = none)


class SessionClosed(Event, tag="session_closed", kw_only=True):
    session: str  # the session's key: the worker releases whatever KV it keeps for it (swapped too)
    worker_id: str  # the worker that holds it


class CancelRequested(Event, tag="cancel", kw_only=True):
    request_id: str  # request to stop
    reason: Reason  # client_cancel | client_disconnect | shutdown | timeout | stop_string | choice_failed | worker_lost
    worker_id: str = ""  # set when the scheduler forwards it to the worker holding the request


class HandBack(Event, tag="hand_back", kw_only=True):
    request_id: str  # request the worker gives back (shutting down, or it cannot keep it)
    worker_id: str  # worker giving it back
    reason: Reason  # shutdown
    scheduled: Scheduled  # the placement it had, to place it again
    output_token_ids: tuple[int, ...]  # tokens generated so far: the next worker resumes after them


class Logprobs(msgspec.Struct, frozen=True, array_like=True):
    """Log probabilities of a TokenDelta's tokens, packed (shared/wire/logprobs.py packs and unpacks them)."""

    top: int  # alternatives given per token
    values: bytes  # float32 little-endian; per token: its own log probability, then its `top` alternatives'
    top_ids: tuple[int, ...]  # per token, its `top` alternatives' ids, most likely first


class PromptLogprobs(msgspec.Struct, frozen=True, array_like=True):
    """A request's prompt log probabilities (its `prompt_logprobs`), sent once with its first output token."""

    token_ids: tuple[int, ...]  # the prompt as the worker computed it (the gateway holds only its text)
    logprobs: Logprobs  # prompt tokens 1.. (token 0 has none): each one's own, then its `top` alternatives'
    ranks: tuple[int, ...]  # per prompt token 1.., its rank among the vocabulary (1 = most likely)


class TokenDelta(msgspec.Struct, frozen=True, array_like=True):
    request_id: str  # request the tokens belong to
    index: int  # position of token_ids[0] in the request's output (duplicates are dropped by it)
    token_ids: tuple[int, ...]  # new tokens of this step
    logprobs: Logprobs | None = None  # when the request asked for them (an older reader ignores a trailing field)
    prompt: PromptLogprobs | None = None  # with index 0, when the request asked for prompt_logprobs


class TokenGenerated(Event, tag="token_generated", kw_only=True):
    worker_id: str  # producing worker
    step: int  # worker's step counter
    items: tuple[TokenDelta, ...]  # every request of this reply stream that got tokens this step


class Completed(Event, tag="completed", kw_only=True):
    request_id: str  # request id
    worker_id: str  # worker that finished it
    finish_reason: str  # stop | length
    prompt_tokens: int  # prompt length
    output_tokens: int  # generated tokens (including a final EOS)
    cached_tokens: int  # prompt tokens served from the prefix cache
    num_preemptions: int  # times the request was preempted on the worker
    session_blocks: int = 0  # KV blocks the worker keeps for the request's session's next turn (0 = none)


class Failed(Event, tag="failed", kw_only=True):
    request_id: str  # request id
    reason: Reason  # invalid | too_long | oom | worker_error | worker_lost | internal | overloaded | state_lost
    message: str  # what a person can act on
    param: str = ""  # offending request field, when the client's input is at fault
    service: str = ""  # service that failed it
    retry_after_s: int = 0  # overloaded: seconds after which the work ahead of it would leave room (Retry-After)


class Cancelled(Event, tag="cancelled", kw_only=True):
    request_id: str  # request id
    reason: Reason  # client_cancel | client_disconnect | shutdown | stop_string | choice_failed
    service: str = ""  # service that settled it


class TimedOut(Event, tag="timed_out", kw_only=True):
    request_id: str  # request id
    state: State | None = None  # the state it was in when its deadline passed (None: its sender cannot tell)
    service: str = ""  # service that settled it


class Heartbeat(Event, tag="heartbeat", kw_only=True):
    worker_id: str  # worker id
    sent_at: float  # worker's epoch seconds
    max_num_seqs: int  # most sequences per step
    draining: bool = False  # stopping: it takes no new request (the scheduler places nothing on it)
    num_running: int  # sequences in the running batch
    num_waiting: int  # sequences waiting or preempted inside the worker
    request_ids: tuple[str, ...]  # every request the worker holds
    last_read_id: str  # last entry id read from its stream (later ones are in flight)
    total_blocks: int  # KV pool size in blocks
    free_blocks: int  # blocks allocatable now (never used, released, or cached and unreferenced)
    cached_blocks: int  # blocks holding a cached prefix (referenced or not)
    block_size: int  # tokens per block
    step_time_s: float  # moving average of a step's wall time
    prefill_s_per_token: float  # measured prefill cost per token
    decode_s_per_token: float  # measured decode cost per token (per sequence-step)
    num_preemptions: int  # preemptions since start
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache since start
    prefix_cache_hits: int  # of those, tokens found
    step_no: int = 0  # steps taken since start: progress, to tell a hung worker from a busy one
    busy: bool = False  # it holds work (so its step counter must move)
    kv_incarnation: str = ""  # its KV events' incarnation ("" = it publishes none)
    kv_seq: int = 0  # number of its latest KV event (a reader that never saw it missed it)
    decode_tokens_left: int = 0  # output tokens the requests it holds may still produce: the work a queue waits on
    sessions_paused: int = 0  # sessions whose KV it keeps in its pool between turns
    sessions_swapped: int = 0  # sessions whose KV it keeps in its second tier (disk)
    session_blocks_paused: int = 0  # KV blocks of its pool held by paused sessions (reclaimable under pressure)
    session_blocks_swapped: int = 0  # KV blocks' worth kept in its second tier
    kv_swap_outs: int = 0  # KV runs copied to its second tier since start (paused sessions, parked preemptions)
    kv_swap_ins: int = 0  # of those, runs copied back into its pool since start
    num_drafted: int = 0  # speculative decoding since start: draft tokens checked
    num_draft_accepted: int = 0  # of them, those the model agreed with (each one a step saved)


class KvEvents(Event, tag="kv_events", kw_only=True):
    """What changed in one worker's prefix cache (one event per engine step that changed it), named by block hash.
    Applied in seq order: `cleared` first (drop every block of this worker), then `removed`, then `stored`."""

    worker_id: str  # the worker whose cache it is
    incarnation: str  # random per worker process start (seq starts again at 1 with it)
    seq: int  # 1, 2, ... within the incarnation: a gap means events were missed (the stream was trimmed)
    block_size: int  # tokens per block of the hashes
    cleared: bool = False  # drop what the worker held before: with `stored`, a full announcement of its cache
    stored: tuple[bytes, ...] = ()  # hashes of blocks now findable in its prefix cache
    removed: tuple[bytes, ...] = ()  # hashes evicted from it


class KvResyncRequested(Event, tag="kv_resync", kw_only=True):
    worker_id: str  # the worker asked to announce its whole cache (a KvEvents with cleared=True)
    reason: ResyncReason  # why the scheduler's index lost track of it


AnyEvent = Union[
    RequestReceived,
    Preprocessed,
    Scheduled,
    CancelRequested,
    SessionClosed,
    HandBack,
    TokenGenerated,
    Completed,
    Failed,
    Cancelled,
    TimedOut,
    Heartbeat,
    KvEvents,
    KvResyncRequested,
]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(AnyEvent)


class SchemaError(ValueError):
    """An entry that is not a known event of a known schema version."""


def encode(event: Event) -> bytes:
    return _encoder.encode(event)


def decode(payload: bytes) -> AnyEvent:
    try:
        event = _decoder.decode(payload)
    except msgspec.DecodeError as e:
        raise SchemaError(f"undecodable event: {e}") from e
    if event.schema_version != SCHEMA_VERSION:
        raise SchemaError(f"unknown schema_version {event.schema_version} of {type(event).__name__}")
    return event


def event_type(event: Event) -> str:
    return type(event).__struct_config__.tag
