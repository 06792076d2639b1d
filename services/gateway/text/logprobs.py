"""Log probabilities as clients see them: token ids (from the workers) become token strings and bytes (the
gateway's tokenizer), shaped as the native API's list, OpenAI chat's `logprobs.content`, or OpenAI
completions' `logprobs` (tokens, token_logprobs, top_logprobs, text_offset).

A token's bytes are its exact bytes (a byte-level BPE piece mapped back to bytes, a `<0xNN>` byte-fallback
piece, a sentencepiece piece with its word-boundary mark as a space); its string is those bytes as UTF-8, or,
for a piece of a character split over several tokens, `bytes:\\xe2\\x80` as OpenAI writes them. Special tokens
(the EOS that ends an output) are shown by name, and take no room in the text (`text_offset`).
Log probabilities of -inf (a token masked by min_tokens) are written -9999.0, as OpenAI does: JSON has no
infinity.
A whole output's log probabilities (the *_sliced shapes) are made slice by slice as the answer is encoded
(render.Sliced): n=16 x 20 alternatives x 4096 tokens is 1.4 M objects, too many to hold at once.
"""

from __future__ import annotations

import codecs
import json
import logging
import re
from typing import Sequence

from services.gateway.text.render import exact, sliced
from shared.wire.events import PromptLogprobs
from shared.wire.logprobs import TokenLogprob, unpack_prompt

logger = logging.getLogger(__name__)

FLOOR = -9999.0  # what -inf (and anything below) is written as
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character each byte is written as, reversed."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars, n = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + n)] = b
            n += 1
    return chars


def _is_byte_level(tokenizer) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    try:
        decoder = json.loads(backend.to_str()).get("decoder") or {}
    except (ValueError, TypeError):
        return False
    parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    return any(p.get("type") == "ByteLevel" for p in parts)


def clamp(value: float | None) -> float | None:
    return None if value is None else exact(max(float(value), FLOOR))


def weight(entries: Sequence[TokenLogprob | None] | None) -> int:
    """The JSON values the log probabilities of these tokens make (render.HEAVY says what is heavy)."""
    if not entries:
        return 0
    first = entries[0]
    return len(entries) * (2 + (len(first.top_ids) if first is not None else 0))


def prompt_weight(prompt: PromptLogprobs | None) -> int:
    """The JSON values a prompt's log probabilities make (each token: itself and its alternatives, 3 values each)."""
    return 0 if prompt is None else len(prompt.token_ids) * 3 * (2 + prompt.logprobs.top)


class TokenStrings:
    """Each token id's bytes and display string, from the served tokenizer (cached per id)."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        # Read from the loop and the render threads: entries are computed whole, then set (a race computes twice)
        self._cache: dict[int, tuple[bytes, str]] = {}
        self._byte_lists: dict[int, list[int]] = {}
        self._special: frozenset[int] | None = None
        self._bytes_map: dict[str, int] | None = None  # byte-level BPE's alphabet, reversed (read at first use)

    @property
    def special(self) -> frozenset[int]:
        if self._special is None:
            tok = self.tok
            added = getattr(tok, "added_tokens_decoder", {}) or {}
            self._special = frozenset(getattr(tok, "all_special_ids", ()) or ()) | {
                i for i, t in added.items() if getattr(t, "special", False)
            }
            self._bytes_map = _byte_level_decoder() if _is_byte_level(tok) else {}
        return self._special

    def _compute(self, tid: int) -> tuple[bytes, str]:
        special = self.special  # (reads the tokenizer's facts at first use)
        piece = self.tok.convert_ids_to_tokens(tid)
        if piece is None:  # an id beyond the tokenizer's vocabulary (a model with padded embeddings)
            raw = b""
        elif tid in special:
            raw = piece.encode()
        elif self._bytes_map and all(c in self._bytes_map for c in piece):
            raw = bytes(self._bytes_map[c] for c in piece)
        elif m := _BYTE_PIECE.fullmatch(piece):
            raw = bytes([int(m.group(1), 16)])
        elif "\u2581" in piece:  # sentencepiece: its word-boundary mark is a space
            raw = piece.replace("\u2581", " ").encode()
        else:
            raw = self.tok.decode([tid], skip_special_tokens=False, clean_up_tokenization_spaces=False).encode()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        return raw, text

    def get(self, tid: int) -> tuple[bytes, str]:
        if (hit := self._cache.get(tid)) is None:
            hit = self._cache[tid] = self._compute(tid)
        return hit

    def text(self, tid: int) -> str:
        return self.get(tid)[1]

    def raw(self, tid: int) -> bytes:
        return self.get(tid)[0]

    def byte_list(self, tid: int) -> list[int]:
        """The token's bytes as a list (chat's `bytes`): one list per token id, shared by every answer that
        holds it (never changed), instead of one per occurrence: 1.4 M fewer objects in the largest answer."""
        if (hit := self._byte_lists.get(tid)) is None:
            hit = self._byte_lists[tid] = list(self.raw(tid))
        return hit


def native(strings: TokenStrings, token_ids: Sequence[int], entries: Sequence[TokenLogprob | None]) -> list[dict]:
    """/generate's shape: per token, its id, string, log probability and alternatives."""
    out = []
    for tid, e in zip(token_ids, entries):
        out.append(
            {
                "token_id": tid,
                "token": strings.text(tid),
                "logprob": clamp(e.logprob) if e else None,
                "top_logprobs": [
                    {"token_id": i, "token": strings.text(i), "logprob": clamp(v)}
                    for i, v in zip(e.top_ids, e.top_logprobs)
                ]
                if e
                else [],
            }
        )
    return out


def chat(strings: TokenStrings, token_ids: Sequence[int], entries: Sequence[TokenLogprob | None]) -> dict:
    """OpenAI chat's choice.logprobs: {"content": [{token, logprob, bytes, top_logprobs}], "refusal": null}."""

    def one(tid: int, value: float | None) -> dict:
        return {"token": strings.text(tid), "logprob": clamp(value), "bytes": strings.byte_list(tid)}

    content = []
    for tid, e in zip(token_ids, entries):
        content.append(
            {
                **one(tid, e.logprob if e else None),
                "top_logprobs": [one(i, v) for i, v in zip(e.top_ids, e.top_logprobs)] if e else [],
            }
        )
    return {"content": content, "refusal": None}


def native_sliced(strings: TokenStrings, token_ids: Sequence[int], entries: Sequence[TokenLogprob | None]):
    """native()'s list, made as it is encoded."""
    return sliced(len(token_ids), lambda i, j: native(strings, token_ids[i:j], entries[i:j]))


def chat_sliced(strings: TokenStrings, token_ids: Sequence[int], entries: Sequence[TokenLogprob | None]) -> dict:
    """chat()'s object, its content made as it is encoded."""
    content = sliced(len(token_ids), lambda i, j: chat(strings, token_ids[i:j], entries[i:j])["content"])
    return {"content": content, "refusal": None}


class CompletionLogprobs:
    """OpenAI completions' choice.logprobs, for one request's output as it streams: `text_offset` runs on
    across calls (each token's character offset in the output text)."""

    def __init__(self, strings: TokenStrings):
        self.strings = strings
        self.offset = 0
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def __call__(self, token_ids: Sequence[int], entries: Sequence[TokenLogprob | None]) -> dict:
        tokens, values, tops, offsets = [], [], [], []
        for tid, e in zip(token_ids, entries):
            text = self.strings.text(tid)
            tokens.append(text)
            values.append(clamp(e.logprob) if e else None)
            top = None  # a token with none (an echoed prompt's first: vLLM's null)
            if e:  # the alternatives, and the sampled token always (so up to logprobs + 1 entries, as OpenAI)
                top = {}
                for i, v in zip(e.top_ids, e.top_logprobs):
                    top.setdefault(self.strings.text(i), clamp(v))
                top.setdefault(text, clamp(e.logprob))
            tops.append(top)
            offsets.append(self.offset)
            if tid not in self.strings.special:  # special tokens are not in the text
                self.offset += len(self._utf8.decode(self.strings.raw(tid)))
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

    def sliced(self, token_ids: Sequence[int], entries: Sequence[TokenLogprob | None]):
        """This call's object, made as it is encoded: its slices in order, as calls one after another would be
        (text_offset runs on); nothing else may use this formatter until it is encoded."""
        return sliced(len(token_ids), lambda i, j: self(token_ids[i:j], entries[i:j]))


def prompt_entries(prompt: PromptLogprobs) -> list[TokenLogprob | None]:
    """One per prompt token: None for the first (nothing comes before it), then each one's."""
    return [None, *unpack_prompt(prompt)]


def prompt_vllm(strings: TokenStrings, prompt: PromptLogprobs):
    """vLLM's `prompt_logprobs`: null for the first prompt token, then per token {token id: {logprob, rank,
    decoded_token}}, the token itself first, then its k most likely (ranks 1..k); made as it is encoded."""
    ids, entries = prompt.token_ids, prompt_entries(prompt)

    def one(tid: int, value: float, rank: int) -> dict:
        return {"logprob": clamp(value), "rank": rank, "decoded_token": strings.text(tid)}

    def make(i: int, j: int) -> list:
        out = []
        for tid, e in zip(ids[i:j], entries[i:j]):
            if e is None:
                out.append(None)
                continue
            d = {str(tid): one(tid, e.logprob, e.rank)}
            for r, (t, v) in enumerate(zip(e.top_ids, e.top_logprobs), 1):
                d.setdefault(str(t), one(t, v, r))
            out.append(d)
        return out

    return sliced(len(ids), make)
