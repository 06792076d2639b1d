"""Tokenizer service: turns request_received into preprocessed (or a clear failure).

Idempotent: the PREPROCESSED transition is a compare-and-set published atomically with the
preprocessed event, so a redelivered request_received (this process died before XACK)
finds the request already past RECEIVED and is only acknowledged. A request cancelled
before it got here is not tokenized at all: its transition is refused.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from opentelemetry.trace import Span

from shared.process.service import BusService
from shared.process import telemetry
from shared.wire.block_hash import block_hashes
from shared.wire.bus import Delivery, event_field
from shared.text.chat_template import TemplateRefused, render
from shared.wire.constants import GROUP_TOKENIZER
from shared.wire.events import Failed, Preprocessed, Reason, RequestReceived
from shared.state.lifecycle import Publish, State, TransitionResult
from shared.text.model_files import resolve_model_dir
from shared.process.runtime import Liveness, StopFlag, run_loop
from shared.settings import TokenizerSettings
from shared.text.tokenization import encoder, load_tokenizer, model_info

logger = logging.getLogger(__name__)


class PromptError(ValueError):
    """The prompt cannot be served as given; carries the failure reason and offending field."""

    def __init__(self, reason: str, param: str, message: str):
        super().__init__(message)
        self.reason, self.param = reason, param


class Preprocessor:
    """Chat template + tokenization + context-window check, independent of the bus."""

    def __init__(self, tokenizer, max_len: int):
        self.tok = tokenizer
        self.encode = encoder(tokenizer)
        self.max_len = max_len

    def _template(self, chat: list[dict], ev: RequestReceived) -> str:
        try:
            return render(
                self.tok,
                chat,
                json.loads(ev.tools) if ev.tools else None,
                ev.add_generation_prompt,
                ev.continue_final_message,
                json.loads(ev.chat_template_kwargs) if ev.chat_template_kwargs else None,
            )
        except TemplateRefused as e:  # the client's to fix, as the template says
            raise PromptError(Reason.INVALID, "messages", f"messages: {e}") from e

    def _truncated(self, ids: list[int], ev: RequestReceived) -> list[int]:
        """vLLM's truncate_prompt_tokens: the prompt's last k tokens (-1: as many as the window leaves after
        max_tokens)."""
        keep = ev.truncate_prompt_tokens
        if keep == -1:
            keep = max(1, self.max_len - ev.sampling.max_tokens)
        return ids[-keep:] if 0 < keep < len(ids) else ids

    def token_ids(self, ev: RequestReceived) -> list[int]:
        if ev.prompt_token_ids:
            ids = list(ev.prompt_token_ids)
            field = "prompt"
        elif ev.messages is not None:
            chat = [{"role": m.role, "content": m.content} for m in ev.messages]
            text = self._template(chat, ev)
            ids = self.encode(text, False)
            field = "messages"
        else:
            ids = self.encode(ev.prompt or "", True)
            field = "prompt"
        if not ids:
            raise PromptError(Reason.INVALID, field, f"{field} tokenizes to no tokens")
        ids = self._truncated(ids, ev)
        if len(ids) >= self.max_len:
            raise PromptError(
                Reason.TOO_LONG,
                field,
                f"{field} is {len(ids)} tokens; the context window is "
                f"{self.max_len} tokens and at least 1 must be left for output",
            )
        if len(ids) + ev.sampling.max_tokens > self.max_len:
            raise PromptError(
                Reason.INVALID,
                "max_tokens",
                f"max_tokens {ev.sampling.max_tokens} + {len(ids)} prompt "
                f"tokens exceeds the context window of {self.max_len}; max_tokens may be at most "
                f"{self.max_len - len(ids)}",
            )
        return ids


@dataclass
class _Plan:
    """One delivery of a batch: what its pipeline holds for it, and its spans (None with tracing off)."""

    d: Delivery
    process: Span | None = None
    publish: Span | None = None
    to: State | None = None  # its transition (None: not a request)
    at: int = -1  # the index of the transition's reply in the pipeline
    later: tuple[Publish, ...] = ()  # its events to publish after the transition (another slot's streams)


class TokenizerService(BusService):
    kind = "tokenizer"

    def __init__(self, settings: TokenizerSettings):
        super().__init__(settings, on_dead=self._on_dead)
        info = model_info(resolve_model_dir(settings.model, settings.cache_dir))
        self.pre = Preprocessor(load_tokenizer(info.model_dir), info.max_len)
        self.live = Liveness.of(settings, "tokenizer", self.id)
        self.streams = [self.names.received_stream(p) for p in self.names.all_partitions]

    def run(self) -> None:
        stop = StopFlag()
        self.bus.ensure_groups(self.streams, GROUP_TOKENIZER)
        logger.info("tokenizer %s reading %s", self.id, ", ".join(self.streams))
        run_loop(stop, self.tick, "tokenizer", on_nogroup=lambda: self.bus.ensure_groups(self.streams, GROUP_TOKENIZER))
        self.live.clear(self.r)

    def tick(self) -> None:
        deliveries = self.bus.read(self.streams, GROUP_TOKENIZER)
        if self.live.due():
            deliveries += self.bus.sweep_all(self.streams, GROUP_TOKENIZER)
            self.live.refresh(self.r)
        if deliveries:
            self.handle_batch(deliveries)

    def handle_batch(self, deliveries: list[Delivery]) -> None:
        """Every request of a tick in one pipeline (input layers and transitions with their events), acknowledged
        together: a burst costs the tokenizer two round trips a tick, not three a request. Traced, each request
        has its own spans all the same (process, tokenize, publish), open until its events are out."""
        pipe = self.r.pipeline(transaction=False)
        plans = [self._queue(pipe, d) for d in deliveries]
        try:
            replies = pipe.execute(raise_on_error=False)
            done, applied = [], []
            for p in plans:
                if p.to is None:
                    done.append(p.d)  # not a request: logged, nothing to retry
                elif isinstance(replies[p.at], Exception):  # left pending: retried, then dead-lettered
                    logger.error("preprocessing %s failed: %r", p.d.event.request_id, replies[p.at])
                else:
                    rid = p.d.event.request_id
                    with telemetry.current(p.publish or p.process):  # the transition's event goes on it
                        res = self._outcome(rid, p.to, self.lifecycle.interpret(rid, p.to, replies[p.at]))
                    applied.append((p, res))
                    done.append(p.d)
            # Before the acknowledgement: a failure leaves them pending.
            results = self.lifecycle.complete(self.r, [(res, p.later) for p, res in applied])
            for (p, _res), res in zip(applied, results):
                if p.publish is not None:
                    telemetry.published(p.publish, res.entry_ids)
        finally:
            for p in plans:
                telemetry.end_all(p.publish, p.process)
        self.bus.ack_all(done)

    def _queue(self, pipe, d: Delivery) -> _Plan:
        """Queue the request's writes on pipe (its spans opened first, when tracing): the transition, the index of
        its reply and the events to publish after it."""
        ev, plan = d.event, _Plan(d, telemetry.start_process_span(d, self.id))
        if not isinstance(ev, RequestReceived):
            logger.error("unexpected %s on %s", type(ev).__name__, d.stream)
            return plan
        with telemetry.current(plan.process):
            try:
                ids = self._traced_token_ids(ev)
            except PromptError as e:
                fail = self._failed(ev, e, telemetry.current_traceparent(ev.traceparent))
                plan.later = self.lifecycle.queue(
                    pipe, ev.request_id, State.FAILED, e.reason, [Publish(ev.reply_to, fail)]
                )
                plan.to, plan.at = State.FAILED, len(pipe) - 1
                return plan
            self.store.update(pipe, ev.request_id, "input", {"prompt_token_ids": ids, "prompt_tokens": len(ids)})
            stream = self.names.preprocessed_stream(self.names.partition(ev.request_id))
            if plan.process is not None:
                plan.publish = telemetry.start_publish_span(stream, ev.request_id)
            out = self._preprocessed(ev, ids, telemetry.traceparent_of(plan.publish, ev.traceparent))
        plan.later = self.lifecycle.queue(pipe, ev.request_id, State.PREPROCESSED, "", [Publish(stream, out)])
        plan.to, plan.at = State.PREPROCESSED, len(pipe) - 1
        return plan

    def _traced_token_ids(self, ev: RequestReceived) -> list[int]:
        """_token_ids in a `tokenize` span (a non-recording one with tracing off)."""
        with telemetry.tracer().start_as_current_span("tokenize", record_exception=False) as span:
            span.set_attribute("conveyor.request_id", ev.request_id)
            try:
                ids = self._token_ids(ev)
            except PromptError as e:
                telemetry.set_error(span, e.reason, str(e))
                raise
            span.set_attribute("gen_ai.usage.input_tokens", len(ids))
        return ids

    def _token_ids(self, ev: RequestReceived) -> list[int]:
        """The prompt's token ids, or PromptError: for the client's fault (invalid, too_long), and for any other
        exception (internal). Either way that request alone fails, at once: a redelivery would meet the same
        exception, and one escaping here took down the process and, claimed again after each restart, its whole
        batch with it."""
        try:
            return self.pre.token_ids(ev)
        except PromptError:
            raise
        except Exception as e:
            logger.exception("preprocessing %s failed; failing it alone", ev.request_id)
            raise PromptError(
                Reason.INTERNAL,
                "",
                f"the tokenizer could not process this request ({type(e).__name__}: {str(e)[:200]})",
            ) from e

    def _preprocessed(self, ev: RequestReceived, ids: list[int], traceparent: str) -> Preprocessed:
        # The prompt's block hashes, computed once here: the scheduler matches them against its KV index.
        bs = self.s.block_size
        return Preprocessed(
            request_id=ev.request_id,
            reply_to=ev.reply_to,
            prompt_token_ids=tuple(ids),
            sampling=ev.sampling,
            priority=ev.priority,
            deadline=ev.deadline,
            adaptive_deadline=ev.adaptive_deadline,
            received_at=ev.received_at,
            block_size=bs,
            block_hashes=block_hashes(ids, bs),
            traceparent=traceparent,
            group_id=ev.group_id,
            group_size=ev.group_size,
            session=ev.session,
            session_worker=ev.session_worker,
        )

    @staticmethod
    def _failed(ev: RequestReceived, e: PromptError, traceparent: str) -> Failed:
        return Failed(
            request_id=ev.request_id,
            reason=e.reason,
            message=str(e),
            param=e.param,
            service="tokenizer",
            traceparent=traceparent,
        )

    @staticmethod
    def _outcome(request_id: str, to: State, res: TransitionResult) -> TransitionResult:
        """The transition's result, logged when not applied (refused: already further along, a redelivery)."""
        if not res.applied:
            logger.info(
                "request %s not moved to %s: it is %s",
                request_id,
                to.value,
                res.previous.value if res.previous else "gone",
            )
        return res

    def _settle(self, request_id: str, to: State, reason: str, publish: list[Publish]):
        return self._outcome(request_id, to, self.lifecycle.transition(request_id, to, reason, publish))

    def _on_dead(self, stream: str, event, why: str) -> None:
        rid, reply_to = event_field(event, "request_id"), event_field(event, "reply_to")
        if isinstance(rid, str) and isinstance(reply_to, str):
            fail = Failed(
                request_id=rid,
                reason=Reason.INTERNAL,
                service="tokenizer",
                message=f"the tokenizer could not process this request ({why})",
            )
            self._settle(rid, State.FAILED, Reason.INTERNAL, [Publish(reply_to, fail)])
