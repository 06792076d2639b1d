"""The engine's two boundaries, as typing Protocols (no torch here, so importing them is cheap).

`Engine` is everything the worker service and its tracing call on an engine; `LLMEngine` is the one
implementation. `ModelRunner` is what the engine needs from whatever computes a step: the torch runner
(model_runner.py: a packed forward pass and the sampler) or the simulator (sim_runner.py: a modelled step
time and deterministic tokens). The scheduler, the paged block manager and the prefix cache are the
engine's own and the same whichever runner computes the steps.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Protocol, Sequence as Seq

from services.worker.engine.outputs import EngineStats, StepResult, TokenLogprobs
from services.worker.engine.request import EngineRequest, Sequence
from shared.wire.events import State

OnScheduled = Callable[[list[tuple[str, State]]], None]


class Engine(Protocol):
    def add_request(self, req: EngineRequest) -> None:
        """Queue a request; raises RecoverableEngineError (nothing queued) for a malformed one."""

    def abort_request(self, request_id: str) -> bool:
        """Drop a request now, its blocks freed; False if unknown."""

    def step(self, on_scheduled: OnScheduled | None = None) -> StepResult:
        """One scheduling + compute + sampling step; on_scheduled gets the scheduling decisions before the
        compute runs."""

    def has_unfinished(self) -> bool: ...

    def stats(self) -> EngineStats: ...

    def request_kv_info(self, request_id: str) -> tuple[int, int] | None:
        """(blocks held, prompt tokens served from the prefix cache), or None for unknown requests."""

    def computed_tokens(self, request_id: str) -> int | None:
        """Tokens of the request whose K/V are computed (prefill progress), or None for unknown requests."""

    def enable_kv_events(self) -> None:
        """From now on, note every block hash the prefix cache stores or evicts (take_kv_events collects)."""

    def take_kv_events(self) -> tuple[list[bytes], list[bytes]]:
        """(block hashes stored, block hashes removed) since the last call."""

    def cached_block_hashes(self) -> list[bytes]:
        """Every block hash the prefix cache holds now."""

    def close_session(self, session: str) -> None:
        """Release the KV kept for a conversation session."""

    def expire_sessions(self, idle_s: float, reason: Any = None) -> None:
        """Release the KV of sessions untouched for idle_s seconds (0: all)."""

    def take_session_events(self) -> list[Any]:
        """What happened to kept sessions' KV since the last call (session_kv.SessionEvent)."""


class PreparedStep(Protocol):
    sample_seqs: list[Sequence]  # the sequences that get a next token from this step, in row order
    prompt_jobs: list[Any]  # prompt_logprobs.PromptJob: the prompt log probabilities this step owes
    prompt_logprobs: list[list[TokenLogprobs]]  # set by forward: one list per prompt job


class ModelRunner(Protocol):
    num_blocks: int  # KV blocks the runner's pool holds (the block manager hands them out)
    block_bytes: int  # bytes of one block's K and V over all layers: read_blocks' payload per block
    verifies_drafts: bool  # computes every row of a drafted sequence, so its drafts can be checked (spec.py)

    def read_blocks(self, block_ids: list[int]) -> Any:
        """K and V of these blocks, all layers, as one contiguous uint8 numpy array on the CPU (block_bytes per
        block), for the disk tier (kv_tier.py) to keep. ValueError for ids outside the pool."""

    def read_slabs(self, block_ids: list[int]) -> Iterable[Any]:
        """read_blocks' payload as consecutive buffers, for the tier's put_parts; a runner may reuse one buffer for
        every slab (each valid until the next is taken). ValueError for ids outside the pool, before any slab."""

    def write_blocks(self, block_ids: list[int], payload: Any) -> None:
        """The inverse of read_blocks, into these (possibly other) blocks. payload: bytes, memoryview or numpy
        array. ValueError (nothing written) unless it is exactly len(block_ids) * block_bytes bytes and the ids are
        distinct ids of the pool."""

    def init_sequence(self, seq: Sequence) -> None:
        """Set up a new sequence's sampling state (seq.generator)."""

    def prepare(self, items: list[tuple[Sequence, int]]) -> PreparedStep:
        """items: (sequence, tokens to compute from its num_computed_tokens)."""

    def forward(self, step: Any) -> tuple[Seq[Any], float]:
        """-> (one row of scores per step.sample_seqs, sliceable by row; seconds the compute took)."""

    def sample(
        self, rows: Seq[Any], seqs: list[Sequence], allowed: Any = None
    ) -> tuple[list[int], list[TokenLogprobs | None] | None]:
        """Next token of each sequence from its row (honouring its SamplingOptions), and the TokenLogprobs of
        each whose request asked for them (None for the others; None alone when none asked). allowed: None, or
        the tokens each row may take (structured.py's bitmask, a numpy int32 array [rows, ceil(vocab / 32)])."""

    def is_out_of_memory(self, error: BaseException) -> bool:
        """Whether error is the device running out of memory (the engine then halves the batch)."""

    def free_memory(self) -> None:
        """Give cached device memory back after an out-of-memory error."""
