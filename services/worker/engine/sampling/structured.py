"""Grammar-constrained decoding: one matcher per constrained sequence, a bitmask of allowed tokens per step.

The grammar of each distinct constraint is built once (shared/text/grammar.py) into a template matcher kept in a
bounded LRU table; a sequence gets a copy of it (a copy costs ~15 us, building one ~1-3 ms). A sequence that
arrives with outputs already generated (moved from another worker: Scheduled.output_token_ids) has them replayed
into its matcher. Preemption inside this worker keeps the Sequence and its tokens, so its matcher stays in step
with them and is not rebuilt.

The step's mask is filled in a thread of its own while the forward pass runs (start() after prepare, result()
before sampling): llguidance computes it without the GIL, so on a GPU it costs the step nothing and on a CPU it
takes a core's share for ~0.5 ms a batch of 32 (docs/benchmarks.md, "Grammar masks"). The sampled token then
advances the sequence's matcher (advance()); EOS is in the mask only where the grammar may end.

No torch here: the mask is a numpy int32 array [rows, ceil(vocab / 32)], bit j of word w = token 32*w + j may
come next; the sampler (or the simulator) applies it.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import llguidance
import llguidance.numpy as llg_np
import numpy as np

from services.worker.engine.errors import InvalidRequestError
from services.worker.engine.request import GrammarSpec, Sequence
from shared.text.grammar import GrammarError, grammar_for

logger = logging.getLogger(__name__)

TEMPLATE_CACHE_SIZE = 64  # distinct constraints whose compiled template matcher is kept
MASK_THREADS = 2  # llguidance's own threads filling one step's rows


class GrammarViolation(RuntimeError):
    """A sampled token the sequence's grammar refuses: the mask and the matcher disagree (a bug)."""


class MaskJob:
    """One step's bitmask, being filled in the background; result() waits for it."""

    def __init__(self, future: Future):
        self._future = future

    def result(self) -> np.ndarray:
        return self._future.result()


class StructuredOutputs:
    def __init__(self, tokenizer_file: Path, vocab_size: int, eos_ids: frozenset[int]):
        """tokenizer_file: the served model's tokenizer.json, read on the first constrained request (with the
        tokenizers library inside llguidance: no transformers, so a simulated worker still imports no torch);
        eos_ids: the tokens the mask allows once the grammar may end."""
        self.tokenizer_file = Path(tokenizer_file)
        self.eos_ids = sorted(eos_ids)
        self.vocab_size = vocab_size
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._templates: OrderedDict[GrammarSpec, llguidance.LLMatcher] = OrderedDict()
        self._pool: ThreadPoolExecutor | None = None
        self._executor: llguidance.LLExecutor | None = None

    @property
    def words(self) -> int:
        return (self.vocab_size + 31) // 32

    def _tok(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            try:
                text = self.tokenizer_file.read_text()
            except OSError as e:
                raise InvalidRequestError(f"constrained output needs the model's tokenizer.json: {e}") from e
            self._tokenizer = llguidance.LLTokenizer(text, n_vocab=self.vocab_size, eos_token=self.eos_ids)
        return self._tokenizer

    def _template(self, g: GrammarSpec) -> llguidance.LLMatcher:
        m = self._templates.get(g)
        if m is not None:
            self._templates.move_to_end(g)
            return m
        try:
            m = llguidance.LLMatcher(self._tok(), grammar_for(g.kind, g.spec), log_level=0)
        except GrammarError as e:
            raise InvalidRequestError(f"constraint: {e}") from e
        if m.is_error():
            raise InvalidRequestError(f"constraint: {m.get_error()}")
        self._templates[g] = m
        if len(self._templates) > TEMPLATE_CACHE_SIZE:
            self._templates.popitem(last=False)
        return m

    def attach(self, seq: Sequence) -> None:
        """Give a constrained sequence its matcher, with its outputs so far replayed; raises InvalidRequestError
        (the constraint does not compile, or those outputs do not fit it)."""
        g = seq.sampling.grammar
        if g is None:
            return
        m = self._template(g).deep_copy()
        for i, token in enumerate(seq.output_token_ids):
            if not m.consume_token(token) or m.is_error():
                raise InvalidRequestError(
                    f"output token {i} ({token}) of the resumed request does not fit its constraint: {m.get_error()}"
                )
        seq.grammar = m

    @staticmethod
    def release(seq: Sequence) -> None:
        seq.grammar = None

    def start(self, seqs: list[Sequence]) -> MaskJob | None:
        """Begin filling the bitmask of seqs' next tokens (all ones for unconstrained rows); None if none is
        constrained."""
        rows = [(seq.grammar, i) for i, seq in enumerate(seqs) if seq.grammar is not None]
        if not rows:
            return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
            self._executor = llguidance.LLExecutor(MASK_THREADS)
        mask = np.full((len(seqs), self.words), -1, dtype=np.int32)
        return MaskJob(self._pool.submit(self._fill, rows, mask))

    def _fill(self, rows: list[tuple[llguidance.LLMatcher, int]], mask: np.ndarray) -> np.ndarray:
        llg_np.fill_next_token_bitmask_par(self._executor, rows, mask)
        for m, i in rows:
            if not mask[i].any():  # a matcher in error (or already stopped): only EOS, so the row can be sampled
                for eos in self.eos_ids:
                    mask[i, eos // 32] |= np.uint32(1 << (eos % 32)).view(np.int32)
                logger.warning("grammar matcher has no allowed token (%s); allowing EOS only", m.get_error())
        return mask

    @staticmethod
    def advance(seq: Sequence, token: int) -> None:
        """The sampled token moves the sequence's matcher on; raises GrammarViolation if it does not fit."""
        m = seq.grammar
        if m is not None and (not m.consume_token(token) or m.is_error()):
            raise GrammarViolation(f"token {token} does not fit the constraint: {m.get_error()}")
