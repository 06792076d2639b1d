"""LLMEngine: requests in, one scheduling + compute + sampling step at a time, outputs out.

The scheduler, the paged block manager and the prefix cache are the engine's; what computes a step is
an injected ModelRunner (protocol.py): the torch runner, or the simulator. Nothing here imports torch
(the torch runner is imported only by from_model / from_model_dir).

Not thread-safe: one thread owns the engine and calls add_request / abort_request / step.
Failure isolation: an error tied to one request fails that request only (RequestOutput with
error_reason); a device OOM halves the step's batch and retries; only a request that OOMs
alone fails with "oom".
"""

from __future__ import annotations

import itertools
import logging
import time
from pathlib import Path

from services.worker.engine.kv.block_manager import BlockManager
from services.worker.engine.config import EngineConfig
from services.worker.engine.errors import OOM, TOO_LONG, WORKER_ERROR, InvalidRequestError
from services.worker.engine.outputs import EngineStats, RequestOutput, StepResult, TokenLogprobs
from services.worker.engine.protocol import ModelRunner, OnScheduled
from services.worker.engine.request import EngineRequest, Sequence, SequenceStatus
from services.worker.engine.scheduler import Scheduler
from services.worker.engine.kv.session_kv import SessionEvent, SessionKV
from services.worker.engine.sampling.spec import check_drafts
from services.worker.engine.step_costs import StepCosts
from services.worker.engine.sampling.structured import MaskJob, StructuredOutputs
from shared.wire.events import SessionReason, State

logger = logging.getLogger(__name__)

# a sequence, its new tokens this step (one; more where drafts were right: spec.py), and their log probabilities
Sampled = tuple[Sequence, list[int], list[TokenLogprobs] | None]


class LLMEngine:
    def __init__(
        self,
        runner: ModelRunner,
        config: EngineConfig,
        eos_ids: frozenset[int],
        vocab_size: int,
        context_len: int,
        structured: StructuredOutputs | None = None,
    ):
        """runner computes the steps over its pool of runner.num_blocks KV blocks; vocab_size bounds valid
        token ids; context_len is the model's context window; structured: the grammar matchers of constrained
        requests (None: such requests are refused)."""
        self.structured = structured
        self.config = config
        self.runner = runner
        num_blocks = runner.num_blocks
        self.blocks = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.sessions = SessionKV.for_config(self.blocks, runner, config)
        self.scheduler = Scheduler(config, self.blocks, self.sessions)
        self.scheduler.spec_tokens = config.spec_ngram_tokens if runner.verifies_drafts else 0
        self.eos_token_ids = frozenset(eos_ids)
        self.vocab_size = int(vocab_size)
        self._model_max_len = min(context_len, config.max_model_len) if config.max_model_len else context_len
        # a sequence may never outgrow the pool: past this it finishes with "length"
        self.max_len = min(self._model_max_len, num_blocks * config.block_size)
        self.scheduler.max_len = self.max_len
        self._seqs: dict[str, Sequence] = {}
        self._pending: list[RequestOutput] = []  # decided outside a step (too_long at add time)
        self._ended_kv: dict[str, tuple[int, int]] = {}  # kv info of requests ended in the last step
        self._arrivals = itertools.count()
        self.costs = StepCosts()
        logger.info(
            "engine ready: %d KV blocks x %d tokens, max_len %d, eos %s",
            num_blocks,
            config.block_size,
            self.max_len,
            sorted(self.eos_token_ids),
        )

    @classmethod
    def from_model_dir(cls, model_dir: Path | str, config: EngineConfig) -> LLMEngine:
        from services.worker.engine.model.loader import eos_token_ids, load_model, resolve_device, resolve_dtype

        device = resolve_device(config.device)
        model = load_model(model_dir, device, resolve_dtype(config.dtype, device))
        engine = cls.from_model(model, config, eos_token_ids(model_dir, model))
        engine.structured = StructuredOutputs(
            Path(model_dir) / "tokenizer.json", engine.vocab_size, engine.eos_token_ids
        )
        return engine

    @classmethod
    def from_model(cls, model, config: EngineConfig, eos_ids: frozenset[int] | None = None) -> LLMEngine:
        """Wrap an already loaded transformers model in the torch runner (its attention is switched to paged)."""
        # Imported here: torch and transformers load only when a torch engine is built.
        from services.worker.engine.model.loader import eos_token_ids, model_context_len, model_vocab_size
        from services.worker.engine.model.model_runner import ModelRunner as TorchRunner

        runner = TorchRunner.for_model(model, config)
        eos = eos_ids if eos_ids is not None else eos_token_ids(None, model)
        return cls(runner, config, eos, model_vocab_size(model), model_context_len(model))

    @property
    def model_max_len(self) -> int:
        return self._model_max_len

    # ---- requests -------------------------------------------------------------------------
    def add_request(self, req: EngineRequest) -> None:
        """Queue a request. Raises InvalidRequestError for malformed ones (nothing is queued)."""
        self._validate(req)
        seq = Sequence(req, next(self._arrivals), self.eos_token_ids)
        if seq.num_tokens >= self.max_len:
            seq.status = SequenceStatus.FAILED
            self._pending.append(
                RequestOutput(
                    req.request_id,
                    [],
                    seq.num_emitted,
                    finished=True,
                    error_reason=TOO_LONG,
                    error=f"{seq.num_tokens} prompt+output tokens leave no room to generate: the limit is "
                    f"{self.max_len} (context window {self._model_max_len}, KV pool "
                    f"{self.blocks.num_blocks * self.blocks.block_size} tokens)",
                )
            )
            return
        done = self._already_done(seq)
        if done is not None:  # resumed with nothing left to generate
            self._pending.append(RequestOutput(req.request_id, [], seq.num_emitted, True, done))
            return
        self._attach_grammar(seq)
        self.runner.init_sequence(seq)
        self._seqs[req.request_id] = seq
        self.scheduler.add(seq)

    @staticmethod
    def _already_done(seq: Sequence) -> str | None:
        outputs = seq.output_token_ids
        if outputs and outputs[-1] in seq.stop_ids and len(outputs) - 1 >= seq.sampling.min_tokens:
            return "stop"
        if len(outputs) >= seq.sampling.max_tokens:
            return "length"
        return None

    def _attach_grammar(self, seq: Sequence) -> None:
        if seq.sampling.grammar is None:
            return
        if self.structured is None:
            raise InvalidRequestError(
                f"request {seq.request_id!r} has an output constraint and this engine has no tokenizer to compile it"
            )
        self.structured.attach(seq)

    def _validate(self, req: EngineRequest) -> None:
        if req.request_id in self._seqs:
            raise InvalidRequestError(f"request {req.request_id!r} is already in the engine")
        if not req.prompt_token_ids:
            raise InvalidRequestError(f"request {req.request_id!r} has an empty prompt")
        req.sampling.validate()
        bias = [t for t, _ in req.sampling.logit_bias]
        ids = [*req.prompt_token_ids, *req.output_token_ids, *req.sampling.stop_token_ids, *bias]
        if any(not 0 <= t < self.vocab_size for t in ids):
            raise InvalidRequestError(f"request {req.request_id!r} has token ids outside [0, {self.vocab_size})")

    def abort_request(self, request_id: str) -> bool:
        """Drop a request now (blocks freed); it gets no output afterwards. False if unknown."""
        pending = len(self._pending)
        self._pending = [o for o in self._pending if o.request_id != request_id]
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return len(self._pending) != pending
        self.scheduler.remove(seq)
        StructuredOutputs.release(seq)
        seq.status = SequenceStatus.FAILED
        seq.error_reason = "aborted"
        return True

    def has_unfinished(self) -> bool:
        return bool(self._seqs) or bool(self._pending)

    # ---- stepping -------------------------------------------------------------------------
    def step(self, on_scheduled: OnScheduled | None = None) -> StepResult:
        """One step. on_scheduled, if given, gets the scheduling decisions (PREFILLING, PREEMPTED) before the
        forward pass runs, so they can be stamped when they happen; they are then not repeated in
        result.transitions, which keeps only what the forward pass caused (DECODING)."""
        t0 = time.perf_counter()
        result = StepResult(outputs=self._pending)
        self._pending = []
        self._ended_kv.clear()
        batch = self.scheduler.schedule()
        if on_scheduled is not None and batch.transitions:
            on_scheduled(list(batch.transitions))
            result.transitions = []
        else:
            result.transitions = batch.transitions
        if batch.items:
            for seq, tokens, logprobs in self._execute(batch.items, result):
                self._append_tokens(seq, tokens, logprobs, result)
        result.step_time_s = time.perf_counter() - t0
        return result

    def _execute(self, items: list[tuple[Sequence, int]], result: StepResult) -> list[Sampled]:
        """Run the forward pass for items; -> (sequence, its new tokens, their logprobs or None) for those that
        sample."""
        while True:
            try:
                step = self.runner.prepare(items)
                # the constrained rows' masks are filled while the forward pass runs
                masks = self.structured.start(step.sample_seqs) if self.structured is not None else None
                logits, forward_s = self.runner.forward(step)
                break
            except Exception as e:  # isolate: the culprit fails alone, the others still run
                if self.runner.is_out_of_memory(e):
                    if len(items) == 1:
                        self._fail(items[0][0], OOM, f"out of device memory even alone: {e}", result)
                        return []
                    logger.warning("OOM on a step of %d sequences; retrying with %d", len(items), len(items) // 2)
                    items = items[: len(items) // 2]  # the rest keep their blocks and run next step
                    self.runner.free_memory()
                    continue
                if len(items) == 1:
                    logger.exception("forward failed for %s", items[0][0].request_id)
                    self._fail(items[0][0], WORKER_ERROR, f"{type(e).__name__}: {e}", result)
                    return []
                logger.exception("forward failed for a batch of %d; retrying one by one", len(items))
                return [pair for item in items for pair in self._execute([item], result)]
        self.costs.account(items, forward_s, result)
        for job, entries in zip(step.prompt_jobs, step.prompt_logprobs):
            job.seq.prompt_lps.extend(entries)
        for seq, n in items:
            seq.num_computed_tokens += n - len(seq.draft)  # a draft's KV counts once the model agrees with it
            self.scheduler.register_computed_blocks(seq)
        n = len(step.sample_seqs)  # the sampled rows come first, then the drafted sequences' (spec.py)
        return self._sample(logits[:n], step.sample_seqs, result, masks) + check_drafts(
            self.runner, logits[n:], step.drafted, self.costs
        )

    def _sample(self, logits, seqs: list[Sequence], result: StepResult, masks: MaskJob | None = None) -> list[Sampled]:
        if not seqs:
            return []
        allowed = None
        if masks is not None:
            try:
                allowed = masks.result()
            except Exception as e:  # the constrained rows fail; the others are sampled as usual
                logger.exception("grammar mask failed")
                for seq in seqs:
                    if seq.grammar is not None:
                        self._fail(seq, WORKER_ERROR, f"grammar mask: {type(e).__name__}: {e}", result)
                return [s for s in self._sample(logits, seqs, result) if not s[0].is_done]
        try:
            tokens, logprobs = self.runner.sample(logits, seqs, allowed)
            return [
                (s, [t], None if lp is None else [lp]) for s, t, lp in zip(seqs, tokens, logprobs or [None] * len(seqs))
            ]
        except Exception:  # find the row(s) at fault; the others keep their tokens
            logger.exception("batched sampling failed; sampling row by row")
        out = []
        for i, seq in enumerate(seqs):
            try:
                row = allowed[i : i + 1] if allowed is not None else None
                tokens, logprobs = self.runner.sample(logits[i : i + 1], [seq], row)
                out.append((seq, tokens, logprobs if logprobs and logprobs[0] is not None else None))
            except Exception as e:
                logger.exception("sampling failed for %s", seq.request_id)
                self._fail(seq, WORKER_ERROR, f"sampling: {type(e).__name__}: {e}", result)
        return out

    def _append_tokens(self, seq: Sequence, tokens: list[int], logprobs: list | None, result: StepResult) -> None:
        """The sequence's new tokens of the step (in order; after each but the last, the draft it follows was
        right, so that position's KV computed this step is valid), up to the first that ends it; one output."""
        try:
            index, reason, new = seq.num_emitted, None, []
            for i, token in enumerate(tokens):
                if i:
                    seq.num_computed_tokens += 1
                    self.scheduler.register_computed_blocks(seq)
                reason = self._push(seq, token, result)
                new.append(token)
                if reason is not None:
                    break
            seq.num_emitted += len(new)
            out = RequestOutput(
                seq.request_id,
                new,
                index,
                reason is not None,
                reason,
                num_cached_tokens=seq.num_cached_tokens,
                logprobs=logprobs,
                prompt_logprobs=seq.prompt_lps,
            )
            seq.prompt_lps = None  # handed out once, with the first token
            result.outputs.append(out)
            if reason is not None:
                seq.finish_reason = reason
                out.session_blocks = self._end(seq, SequenceStatus.FINISHED)
        except Exception as e:
            logger.exception("post-processing failed for %s", seq.request_id)
            self._fail(seq, WORKER_ERROR, f"{type(e).__name__}: {e}", result)

    def _push(self, seq: Sequence, token: int, result: StepResult) -> str | None:
        """One token onto the sequence -> why it ends there ("stop", "length"), or None."""
        if seq.grammar is not None:
            StructuredOutputs.advance(seq, token)
        seq.token_ids.append(token)
        if seq.status == SequenceStatus.PREFILLING:
            seq.status = SequenceStatus.DECODING
            result.transitions.append((seq.request_id, State.DECODING))
        if token in seq.stop_ids and seq.num_outputs - 1 >= seq.sampling.min_tokens:
            return "stop"
        if seq.num_outputs >= seq.sampling.max_tokens or seq.num_tokens >= self.max_len:
            return "length"
        return None

    def _fail(self, seq: Sequence, reason: str, message: str, result: StepResult) -> None:
        if seq.is_done:
            return
        seq.error_reason, seq.error = reason, message
        result.outputs.append(
            RequestOutput(seq.request_id, [], seq.num_emitted, True, None, reason, message, seq.num_cached_tokens)
        )
        self._end(seq, SequenceStatus.FAILED)

    def _end(self, seq: Sequence, status: SequenceStatus) -> int:
        """-> KV blocks kept for the request's session (a finished turn of one; else 0)."""
        self._ended_kv[seq.request_id] = (len(seq.block_table), seq.num_cached_tokens)
        seq.status = status
        StructuredOutputs.release(seq)
        kept = self.sessions.keep(seq.session_id, seq) if seq.session_id and status == SequenceStatus.FINISHED else 0
        self.scheduler.remove(seq)
        self._seqs.pop(seq.request_id, None)
        return kept

    # ---- conversation sessions ------------------------------------------------------------------------------
    def close_session(self, session: str) -> None:
        """Release the KV kept for a session (its owner closed it)."""
        self.sessions.forget(session)

    def expire_sessions(self, idle_s: float, reason: SessionReason = SessionReason.IDLE) -> None:
        """Release the KV of sessions untouched for idle_s (0: all of them, the worker is stopping)."""
        self.sessions.expire(idle_s, reason)

    def take_session_events(self) -> list[SessionEvent]:
        """What happened to kept sessions since the last call (swapped, released): for their Redis records."""
        return self.sessions.take_events()

    # ---- introspection --------------------------------------------------------------------
    def stats(self) -> EngineStats:
        b = self.blocks
        return EngineStats(
            total_blocks=b.num_blocks,
            free_blocks=b.num_free_blocks + self.sessions.reclaimable_blocks(),
            cached_blocks=b.num_cached_blocks,
            block_size=b.block_size,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            max_num_seqs=self.config.max_num_seqs,
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_queries=b.prefix_queries,
            prefix_cache_hits=b.prefix_hits,
            prefill_s_per_token=self.costs.prefill_s_per_token,
            decode_s_per_token=self.costs.decode_s_per_token,
            num_drafted=self.costs.num_drafted,
            num_draft_accepted=self.costs.num_draft_accepted,
            decode_tokens_left=sum(
                max(0, s.sampling.max_tokens - s.num_outputs) for s in self._seqs.values() if not s.is_done
            ),
            sessions=self.sessions.figures(),
        )

    def request_kv_info(self, request_id: str) -> tuple[int, int] | None:
        """(blocks held, prompt tokens served from the prefix cache); requests that ended in the
        last step report what they held when they ended. None for unknown requests."""
        seq = self._seqs.get(request_id)
        if seq is not None:
            return len(seq.block_table), seq.num_cached_tokens
        return self._ended_kv.get(request_id)

    def computed_tokens(self, request_id: str) -> int | None:
        """Tokens of the request whose K/V are computed (its prefill progress); None for unknown requests."""
        seq = self._seqs.get(request_id)
        return None if seq is None else seq.num_computed_tokens

    def enable_kv_events(self) -> None:
        self.blocks.track_kv_events = True

    def take_kv_events(self) -> tuple[list[bytes], list[bytes]]:
        return self.blocks.take_kv_events()

    def cached_block_hashes(self) -> list[bytes]:
        return self.blocks.cached_hashes()

    def check_no_leak(self) -> None:
        """With no unfinished request, every block must be free or cached-and-unreferenced."""
        assert not self._seqs, f"requests still unfinished: {sorted(self._seqs)[:20]}"
        assert not self.scheduler.running, f"running queue not empty: {[s.request_id for s in self.scheduler.running]}"
        assert not self.scheduler.waiting, f"waiting queue not empty: {[s.request_id for s in self.scheduler.waiting]}"
        assert not self.sessions.kept, f"sessions still keep KV: {list(self.sessions.kept)[:20]}"
        self.blocks.check_no_leak()
