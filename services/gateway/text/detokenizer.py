"""Incremental detokenization that never emits half a character.

Decoding token by token breaks multi-byte UTF-8 (an emoji spread over three byte-level
tokens) and word-boundary spacing. As vLLM does, each step decodes a short window,
ids[prefix_offset:], and emits only what extends the window's previous text; while the
window's text ends in U+FFFD (an incomplete byte sequence) nothing is emitted. `flush`
releases what is left at the end except a character the last tokens left incomplete (max_tokens can cut
one): as vLLM does, it is dropped rather than shown as U+FFFD, in the stream and the whole text alike.
"""

from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0  # window start: context so the next token decodes with the right spacing
        self.read_offset = 0  # tokens before this were already emitted

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip, clean_up_tokenization_spaces=False)

    def push(self, token_ids) -> str:
        """Add tokens; return the newly complete text (possibly empty)."""
        self.ids.extend(token_ids)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if new_text == prefix_text:
            # The new tokens decode to nothing (special tokens, skipped): forget them. Kept, they would stay in the
            # window, which only moves on with text, and every later push would decode them again: a long run
            # of them (a model repeating a special token) cost quadratic time on the gateway's event loop.
            del self.ids[self.read_offset :]
            return ""
        if len(new_text) < len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return new_text[len(prefix_text) :]

    def flush(self) -> str:
        """The text still held back, less the replacement characters of an incomplete character at the very end.
        (A model emitting U+FFFD itself as its last character loses it too: the bytes cannot tell them apart.)"""
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return new_text[len(prefix_text) :].rstrip("\ufffd") if len(new_text) > len(prefix_text) else ""
