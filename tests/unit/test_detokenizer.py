"""Incremental detokenization is exact: the deltas add up to the whole text, even when one character
(an emoji, a Chinese character) is split over several byte-level tokens; no replacement character
appears mid-stream for text that has none, and an output cut in the middle of a character (max_tokens)
ends before it, as vLLM's does: the incomplete character is held back and dropped."""

from __future__ import annotations

import random

import pytest

from services.gateway.text.detokenizer import IncrementalDetokenizer

SAMPLES = [
    "Hello 😀 world 你好，世界! 🎉🎉 naïve café — “quotes” 👨‍👩‍👧",
    "日本語のテキスト。한국어도. العربية",
    " leading  spaces\n\nnew\tlines  ",
]


def _deltas(tokenizer, ids: list[int]) -> list[str]:
    d = IncrementalDetokenizer(tokenizer)
    return [d.push([t]) for t in ids] + [d.flush()]


def _decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def _complete(tokenizer, ids: list[int]) -> str:
    """The text of `ids` without the replacement characters of a character their last tokens leave incomplete."""
    return _decode(tokenizer, ids).rstrip("\ufffd")


@pytest.mark.parametrize("text", SAMPLES)
def test_multibyte_text_token_by_token_equals_whole_decode_without_replacement_chars(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas = _deltas(tokenizer, ids)
    assert "".join(deltas) == _decode(tokenizer, ids) == text
    assert not any("\ufffd" in d for d in deltas)


def test_random_token_sequences_add_up_to_the_whole_decode(tokenizer):
    rng = random.Random(0)
    # Tokens that are pieces of a character (alone they decode to U+FFFD) are the hard case: favour them.
    pieces = [i for i in range(len(tokenizer)) if "\ufffd" in tokenizer.decode([i])]
    special = list(tokenizer.all_special_ids)
    for _ in range(500):
        ids = [
            rng.choice(pieces)
            if rng.random() < 0.5
            else rng.choice(special)
            if rng.random() < 0.1
            else rng.randrange(len(tokenizer))
            for _ in range(rng.randrange(1, 30))
        ]
        assert "".join(_deltas(tokenizer, ids)) == _complete(tokenizer, ids), ids


def test_a_character_cut_short_at_the_end_is_dropped_not_replaced(tokenizer):
    ids = tokenizer.encode("ok 😀", add_special_tokens=False)
    cut = next(k for k in range(1, len(ids)) if _decode(tokenizer, ids[:k]).endswith("\ufffd"))
    deltas = _deltas(tokenizer, ids[:cut])
    assert "".join(deltas) == "ok " and not any("\ufffd" in d for d in deltas), deltas


class _Counting:
    """The real tokenizer, counting how many ids it is asked to decode."""

    def __init__(self, tok):
        self.tok, self.decoded = tok, 0

    def decode(self, ids, **kw):
        self.decoded += len(ids)
        return self.tok.decode(ids, **kw)


def test_a_long_run_of_tokens_without_text_is_not_decoded_again_at_every_token(tokenizer):
    """Special tokens decode to nothing: the window must not keep them (it grew by one token per push and every
    push decoded all of it again, quadratic in the run: 2,000 tokens cost 4 million decoded ids)."""
    counting = _Counting(tokenizer)
    d = IncrementalDetokenizer(counting)
    eos, n = tokenizer.eos_token_id, 2000
    out = [d.push([eos]) for _ in range(n)] + [d.push(tokenizer.encode(" done", add_special_tokens=False)), d.flush()]
    assert "".join(out) == " done"
    assert counting.decoded < 10 * n
