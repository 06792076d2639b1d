"""Log probabilities on the bus (packed float32, compatible with a reader that does not know them) and as the
gateway shows them (token strings and bytes, OpenAI's shapes)."""

from __future__ import annotations

import math

import msgspec

from services.gateway.text.logprobs import CompletionLogprobs, chat, native
from shared.wire.events import TokenDelta, TokenGenerated, decode, encode
from shared.wire.logprobs import TokenLogprob, pack, unpack


def test_pack_round_trips_in_float32_and_keeps_minus_infinity():
    entries = [TokenLogprob(-0.125, (5, 9), (-0.125, -2.5)), TokenLogprob(-1e-8, (1, 2), (-1e-8, float("-inf")))]
    back = unpack(pack(entries))
    assert [e.top_ids for e in back] == [(5, 9), (1, 2)]
    assert back[0] == entries[0] and back[1].top_logprobs[1] == float("-inf")
    assert math.isclose(back[1].logprob, -1e-8, rel_tol=1e-6)
    assert len(pack(entries).values) == 4 * 2 * 3, "float32: 4 bytes a value"


def test_a_reader_that_does_not_know_logprobs_still_decodes_the_delta():
    class OldTokenDelta(msgspec.Struct, frozen=True, array_like=True):  # TokenDelta before the field was added
        request_id: str
        index: int
        token_ids: tuple[int, ...]

    new = TokenDelta("r", 3, (7, 8), pack([TokenLogprob(-1.0), TokenLogprob(-2.0)]))
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(new), type=OldTokenDelta) == OldTokenDelta("r", 3, (7, 8))
    old = msgspec.msgpack.encode(OldTokenDelta("r", 3, (7, 8)))
    assert msgspec.msgpack.decode(old, type=TokenDelta) == TokenDelta("r", 3, (7, 8))
    ev = TokenGenerated(worker_id="w", step=1, items=(new,))
    assert decode(encode(ev)) == ev


def test_token_strings_are_exact_bytes_with_openais_form_for_a_piece_of_a_character(token_strings):
    tok = token_strings.tok
    ids = tok.encode(" café 🦜")  # the parrot is split over three byte-level tokens
    assert b"".join(token_strings.raw(i) for i in ids) == " café 🦜".encode()
    assert [token_strings.text(i) for i in ids] == [" café", "bytes:\\x20\\xf0\\x9f", "bytes:\\xa6", "bytes:\\x9c"]
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    assert token_strings.text(eos) == "<|im_end|>" and eos in token_strings.special


def test_shapes_clamp_minus_infinity_and_offsets_skip_special_tokens(token_strings):
    tok = token_strings.tok
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    ids = tok.encode("Hello Paris") + [eos]
    entries = [
        TokenLogprob(-0.5, (ids[0],), (-0.5,)),
        TokenLogprob(float("-inf"), (1,), (-0.1,)),
        TokenLogprob(-2.0, (eos,), (-2.0,)),
    ]
    c = chat(token_strings, ids, entries)["content"]
    assert [e["token"] for e in c] == ["Hello", " Paris", "<|im_end|>"] and c[1]["logprob"] == -9999.0
    assert c[1]["bytes"] == list(b" Paris") and c[0]["top_logprobs"][0]["token"] == "Hello"
    n = native(token_strings, ids, entries)
    assert [e["token_id"] for e in n] == ids
    assert n[1]["top_logprobs"] == [{"token_id": 1, "token": token_strings.text(1), "logprob": -0.1}]
    shaper = CompletionLogprobs(token_strings)
    first, rest = shaper(ids[:1], entries[:1]), shaper(ids[1:], entries[1:])  # as a stream: offsets run on
    assert first["text_offset"] + rest["text_offset"] == [0, 5, 11]
    assert rest["top_logprobs"][0] == {token_strings.text(1): -0.1, " Paris": -9999.0}, "the sampled token is always in"
