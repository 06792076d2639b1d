"""Stop strings, matched on the detokenized text as it streams.

A stop string can span token boundaries ("\\n\\nUser:" may arrive as "\\n", "\\nUs", "er:"), so
text is matched, never tokens. While the text's tail could still grow into a stop string it
is held back: the client never sees a stop string, nor a piece of one that later completes
(vLLM and TGI both leaked such prefixes into streams). When the output ends without a match,
the held tail is released, so the concatenated deltas still equal the whole text.
"""

from __future__ import annotations

from typing import Sequence

from services.gateway.detokenizer import IncrementalDetokenizer


class StopMatcher:
    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in dict.fromkeys(stops) if s]
        self.held = ""  # text that may be the start of a stop string
        self.matched: str | None = None  # the stop string found, once found

    def feed(self, text: str) -> str:
        """Add text; return what is now safe to show (never part of a stop string)."""
        if self.matched is not None:
            return ""
        buf = self.held + text
        if not self.stops:
            return buf
        found = [(at, s) for s in self.stops if (at := buf.find(s)) >= 0]
        if found:
            at, self.matched = min(found)  # the earliest match ends the output
            self.held = ""
            return buf[:at]
        keep = self._partial_tail(buf)
        self.held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep]

    def _partial_tail(self, buf: str) -> int:
        """Length of the longest tail of buf that is a proper prefix of some stop string."""
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:k]):
                    best = k
                    break
        return best

    def flush(self) -> str:
        """At the end of the output: what was held back was no stop string after all."""
        out, self.held = ("" if self.matched is not None else self.held), ""
        return out


class TextStream:
    """Token ids in, client text out: exact incremental detokenization, then stop strings.

    Tokens go through one at a time so that a stop string completed by a token in the middle
    of a delta ends the output at that token: `push` says how many of the ids were used.
    """

    def __init__(self, tokenizer, stops: Sequence[str] = ()):
        self.detok = IncrementalDetokenizer(tokenizer)
        self.matcher = StopMatcher(stops)

    @property
    def stop_matched(self) -> str | None:
        return self.matcher.matched

    def push(self, token_ids: Sequence[int]) -> tuple[str, int]:
        """Return (text to show, how many of token_ids produced output before any stop string)."""
        if not self.matcher.stops:
            return self.detok.push(token_ids), len(token_ids)
        out = []
        for i, t in enumerate(token_ids):
            if self.matcher.matched is not None:
                return "".join(out), i
            out.append(self.matcher.feed(self.detok.push([t])))
        return "".join(out), len(token_ids)

    def flush(self) -> str:
        """The text still held back, at the end of the output (nothing once a stop string matched)."""
        if self.matcher.matched is not None:
            return ""
        text = self.matcher.feed(self.detok.flush())
        return text + self.matcher.flush()
