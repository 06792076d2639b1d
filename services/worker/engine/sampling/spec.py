"""Speculative decoding of greedy requests with prompt-lookup (n-gram) drafts: what to draft, what to keep.

Text a model writes often repeats its context: code edited in place, a document quoted or summarised, a JSON
answer echoing the schema's keys, a conversation's names. When the last n tokens of a sequence occurred earlier
in it, the tokens that followed that occurrence are a cheap guess at what comes next. The engine computes the
guesses ("drafts") in the same forward pass as the sequence's next token, one row each, and keeps those the
model's own greedy choice agrees with (engine.py): every kept token is exactly what plain greedy decoding would
have produced, so the output is unchanged, and each agreeing draft saves one step. On a CPU a decode step at a
few rows reads every weight once whatever the rows (memory-bound), so checking four drafts costs little more than
computing one token.

The scheduler drafts (`draft`: only for a sequence whose next token is a plain greedy argmax, Sequence.can_draft,
only while few sequences decode, never into blocks the pool lacks) and reserves the drafts' rows; the runner
computes them after the sequence's own token and hands back every row's logits; the engine keeps the agreeing
prefix (`accept`) and the token after it, and counts the kept drafts' KV as computed (the rest is overwritten when
those positions are computed again).

An index per sequence maps each n-gram (n from `min_n` to `max_n`) to where it last ended, built once from the
prompt and extended with every committed token: a proposal costs O(max_n), not a scan of the context.
"""

from __future__ import annotations

from services.worker.engine.request import Sequence


class NgramIndex:
    """Where each n-gram of a token list last ended, for n in [min_n, max_n]."""

    __slots__ = ("min_n", "max_n", "last", "indexed")

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.last: dict[tuple[int, ...], int] = {}  # n-gram -> index of its last token, latest occurrence
        self.indexed = 0  # n-grams ending before this position are in `last`

    def _catch_up(self, tokens: list[int], upto: int) -> None:
        """Index the n-grams ending at positions [self.indexed, upto)."""
        for end in range(self.indexed, upto):
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                self.last[tuple(tokens[end - n + 1 : end + 1])] = end
        self.indexed = max(self.indexed, upto)

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest suffix of `tokens` (at least
        min_n long) seen before; [] when none occurred."""
        size = len(tokens)
        if k < 1 or size <= self.min_n:
            return []
        self._catch_up(tokens, size - 1)  # never the suffix itself: it ends at size - 1
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            end = self.last.get(tuple(tokens[size - n :]))
            if end is not None:
                return tokens[end + 1 : end + 1 + k]
        return []


def draft(seq: Sequence, config, room: int, max_len: int) -> list[int]:
    """The tokens to check after `seq`'s next one this step: at most config.spec_ngram_tokens, `room` (the step's
    budget and blocks left), and what its max_tokens and the context window leave after the token it will get
    anyway."""
    if not seq.can_draft:
        return []
    k = min(
        config.spec_ngram_tokens,
        room,
        seq.sampling.max_tokens - seq.num_outputs - 1,
        max_len - seq.num_tokens - 1,
    )
    if k < 1:
        return []
    if seq.ngrams is None:
        seq.ngrams = NgramIndex(config.spec_ngram_min, config.spec_ngram_max)
    return seq.ngrams.propose(seq.token_ids, k)


def accept(drafted: list[int], greedy: list[int]) -> list[int]:
    """greedy[i]: the model's choice after the sequence's last token and drafted[:i] (len(drafted) + 1 of them).
    -> its new tokens: the drafts the model agrees with, in order, then the model's own token after the last of
    them (the first disagreement's, or the one after every draft): what one-at-a-time greedy decoding yields."""
    kept = [greedy[0]]
    for i, d in enumerate(drafted):
        if d != greedy[i]:
            break
        kept.append(greedy[i + 1])
    return kept


def check_drafts(runner, logits, drafted: list[Sequence], costs) -> list[tuple[Sequence, list[int], None]]:
    """After the forward: each drafted sequence's rows of `logits` (its token's, then one per draft, in `drafted`
    order) sampled greedily by the runner -> (sequence, its new tokens: `accept`, no log probabilities); its draft
    cleared, the counts in `costs` (step_costs.StepCosts)."""
    out, at = [], 0
    for seq in drafted:
        n = 1 + len(seq.draft)
        greedy, _ = runner.sample(logits[at : at + n], [seq] * n)
        at += n
        kept = accept(seq.draft, greedy)
        costs.drafts_checked(len(seq.draft), len(kept) - 1)
        seq.draft = []
        out.append((seq, kept, None))
    return out
