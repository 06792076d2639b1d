"""Stop strings: matched on text across token boundaries; neither they nor a prefix of them ever reach the client."""

from __future__ import annotations


import pytest

from services.gateway.text.stop_strings import StopMatcher, TextStream

TEXT = "The answer is forty-two, and the question remains unknown to everyone."


def _offsets(tokenizer, ids: list[int]) -> list[int]:
    """Character offset in the text where each token starts (plus the end)."""
    return [len(tokenizer.decode(ids[:k])) for k in range(len(ids) + 1)]


def _spanning(text: str, offsets: list[int], tokens: int, start: int = 3) -> tuple[str, int]:
    """A stop string from the 2nd character of some token into the 1st character of the `tokens`-th token from
    it (so it spans exactly that many), occurring nowhere earlier; and the index of that first token."""
    for first in range(start, len(offsets) - tokens):
        if offsets[first + 1] - offsets[first] < 2:
            continue
        stop = text[offsets[first] + 1 : offsets[first + tokens - 1] + 1]
        if text.find(stop) == offsets[first] + 1:
            return stop, first
    raise AssertionError(f"no stop string spanning {tokens} tokens in {text!r}")


def _stream(tokenizer, ids: list[int], stops: list[str]) -> tuple[list[str], int, TextStream]:
    """Push one token at a time; returns the deltas and the number of tokens used."""
    ts, deltas, used = TextStream(tokenizer, stops), [], 0
    for t in ids:
        text, n = ts.push([t])
        deltas.append(text)
        used += n
        if ts.stop_matched:
            break
    deltas.append(ts.flush())
    return deltas, used, ts


def _assert_never_ahead(deltas: list[str], allowed: str) -> None:
    """Every moment of the stream shows a prefix of `allowed` (nothing of the stop string, ever)."""
    shown = ""
    for d in deltas:
        shown += d
        assert allowed.startswith(shown), (shown, allowed)
    assert shown == allowed


@pytest.mark.parametrize("tokens", [2, 3])
def test_stop_string_spanning_tokens_cuts_text_before_it(tokenizer, tokens):
    ids = tokenizer.encode(TEXT)
    stop, first = _spanning(TEXT, _offsets(tokenizer, ids), tokens)
    deltas, used, ts = _stream(tokenizer, ids, [stop])
    assert ts.stop_matched == stop
    _assert_never_ahead(deltas, TEXT[: TEXT.index(stop)])
    assert used == first + tokens  # the token that completed the stop string is the last one used


def test_stop_string_that_never_completes_is_released_at_the_end(tokenizer):
    ids = tokenizer.encode(TEXT)
    deltas, used, ts = _stream(tokenizer, ids, ["everyone.!!"])
    assert ts.stop_matched is None and used == len(ids)
    assert "".join(deltas[:-1]) == TEXT[: -len("everyone.")]  # the possible start was held back...
    assert deltas[-1] == "everyone."  # ...and released when the output ended


def test_earliest_of_several_stop_strings_wins():
    m = StopMatcher(["remains", "answer"])
    assert m.feed(TEXT) == "The " and m.matched == "answer"


def test_tokens_after_the_stop_in_the_same_delta_are_not_used(tokenizer):
    ids = tokenizer.encode(TEXT)
    ts = TextStream(tokenizer, ["forty"])
    text, used = ts.push(ids)
    assert text == "The answer is " and tokenizer.decode(ids[:used]).endswith("forty")


def _naive_first_completion(text: str, stops: list[str]) -> tuple[str, str | None]:
    """The shown text and the matched stop, by definition: the stop whose end comes first in the text (the longer
    of two ending together)."""
    ends = [(at + len(s), -len(s), s) for s in stops if (at := text.find(s)) >= 0]
    if not ends:
        return text, None
    end, _, s = min(ends)
    return text[: end - len(s)], s


def test_matching_in_any_chunking_equals_the_definition_on_random_texts():
    import random

    rng = random.Random(7)
    for _ in range(2000):
        text = "".join(rng.choice("abca") for _ in range(rng.randrange(0, 40)))
        stops = ["".join(rng.choice("abc") for _ in range(rng.randrange(1, 6))) for _ in range(rng.randrange(1, 4))]
        m, shown, i = StopMatcher(stops), [], 0
        while i < len(text):
            n = rng.randrange(1, 6)
            shown.append(m.feed(text[i : i + n]))
            i += n
        shown.append(m.flush())
        assert ("".join(shown), m.matched) == _naive_first_completion(text, stops), (text, stops)
