"""render.py writes what JSONResponse and responses.sse wrote (json.dumps), byte for byte, however the body is
cut into slices and whichever encoder writes a slice; and the real shapes of a long output's log probabilities,
made slice by slice, are those made whole."""

from __future__ import annotations

import json
import random
import sys

import pytest

from services.gateway.text import render
from services.gateway.text.logprobs import CompletionLogprobs, TokenStrings, chat, chat_sliced, native, native_sliced
from shared.wire.logprobs import TokenLogprob

COMPACT = {"ensure_ascii": False, "allow_nan": False, "indent": None, "separators": (",", ":")}  # JSONResponse


def old_json(body) -> bytes:
    return json.dumps(body, **COMPACT).encode()


def old_sse(body) -> bytes:
    return json.dumps(body, ensure_ascii=False).encode()


def _floats(rng: random.Random) -> list[float]:
    edges = [0.0, -0.0, 1e-4, -1e-4, 9.99e-5, 1e16, -1e16, 9.9e15, 5e-324, 1.7976931348623157e308, -9999.0, -1.0]
    return (
        edges + [-(10.0 ** rng.uniform(-12, 5)) for _ in range(300)] + [10.0 ** rng.uniform(10, 20) for _ in range(50)]
    )


def _text(rng: random.Random) -> str:
    pool = [chr(c) for c in range(0, 0x80)] + ["é", "\u2028", "\u2029", "🦜", "\ufeff", "\x7f", "\u00a0", '"', "\\"]
    return "".join(rng.choice(pool) for _ in range(rng.randint(0, 12)))


def test_a_heavy_body_is_written_as_json_dumps_writes_it():
    rng = random.Random(7)
    floats = _floats(rng)
    items = [
        {
            "token": _text(rng),
            "logprob": render.exact(f),
            "n": rng.randint(-(2**63), 2**63 - 1),
            "alt": [render.exact(rng.choice(floats)) for _ in range(3)],
            "none": None,
            "ok": True,
        }
        for f in floats
    ]
    body = {
        "id": "x",
        "metrics": {"a": 1e-05, "b": 0.5, "c": None},
        "token_ids": list(range(1000)),
        "logprobs": render.Sliced(len(items), lambda i, j: items[i:j]),
        "empty": [],
        "nested": [{"k": [1, 2]}],
    }
    expected_json, expected_sse = old_json({**body, "logprobs": items}), old_sse({**body, "logprobs": items})
    body2 = {**body, "logprobs": render.Sliced(len(items), lambda i, j: items[i:j])}
    body3 = {**body, "logprobs": render.Sliced(len(items), lambda i, j: items[i:j])}
    body4 = {**body, "logprobs": render.Sliced(len(items), lambda i, j: items[i:j])}
    assert render.encode_heavy(body) == expected_json
    assert render.encode_heavy(body2, spaced=True) == expected_sse
    assert render.encode(body3) == expected_json and render.encode(body4, spaced=True) == expected_sse


def test_an_object_of_parallel_arrays_and_an_empty_one_are_written_whole():
    rows = list(range(700))

    def make(i, j):
        return {"a": rows[i:j], "b": [str(x) for x in rows[i:j]]}

    expected = old_json({"lp": make(0, 700), "none": []})
    assert render.encode_heavy({"lp": render.Sliced(700, make), "none": render.Sliced(0, lambda i, j: [])}) == expected


def test_a_sliced_is_made_once():
    s = render.Sliced(300, lambda i, j: list(range(i, j)))
    render.encode_heavy(s)
    with pytest.raises(RuntimeError):
        render.encode_heavy(s)


def _output(token_strings: TokenStrings, n: int, k: int) -> tuple[list[int], list[TokenLogprob | None]]:
    rng = random.Random(n)
    vocab = len(token_strings.tok)
    ids = [rng.randrange(vocab) for _ in range(n)]
    entries = [
        None
        if rng.random() < 0.01
        else TokenLogprob(
            -(10.0 ** rng.uniform(-9, 1)),
            tuple(rng.randrange(vocab) for _ in range(k)),
            tuple(-(10.0 ** rng.uniform(-9, 4)) if rng.random() > 0.02 else float("-inf") for _ in range(k)),
        )
        for _ in range(n)
    ]
    return ids, entries


@pytest.mark.parametrize("n", [5, 700])
def test_the_log_probability_shapes_made_in_slices_are_those_made_whole(token_strings, n):
    ids, entries = _output(token_strings, n, 5)
    assert render.encode_heavy(native_sliced(token_strings, ids, entries)) == old_json(
        native(token_strings, ids, entries)
    )
    assert render.encode_heavy(chat_sliced(token_strings, ids, entries), spaced=True) == old_sse(
        chat(token_strings, ids, entries)
    )
    whole, parts = CompletionLogprobs(token_strings), CompletionLogprobs(token_strings)
    expected = [old_json(whole(ids[: n // 2], entries[: n // 2])), old_json(whole(ids[n // 2 :], entries[n // 2 :]))]
    assert [
        render.encode_heavy(parts.sliced(ids[: n // 2], entries[: n // 2])),
        render.encode_heavy(parts.sliced(ids[n // 2 :], entries[n // 2 :])),
    ] == expected, "text_offset runs on"


def test_light_work_stays_on_the_loop_and_heavy_work_leaves_it():
    import asyncio
    import threading

    async def where(weight: int) -> bool:
        return await render.off_loop(lambda: threading.current_thread() is threading.main_thread(), weight)

    assert asyncio.run(where(render.HEAVY - 1)) is True
    assert asyncio.run(where(render.HEAVY)) is False
    assert sys.getswitchinterval() <= 0.005, "the loop gets the GIL back at least this often from a render thread"


def test_a_heavy_json_body_refuses_nan_as_json_response_did():
    items = [{"logprob": render.exact(float("nan"))}] * 300
    with pytest.raises(ValueError):
        render.encode_heavy({"lp": render.Sliced(300, lambda i, j: items[i:j])})
    with pytest.raises(ValueError):
        old_json({"lp": items})
