"""Stop strings, matched on the detokenized text as it streams.

A stop string can span token boundaries ("\\n\\nUser:" may arrive as "\\n", "\\nUs", "er:"), so
text is matched, never tokens. While the text's tail could still grow into a stop string it
is held back: the client never sees a stop string, nor a piece of one that later completes
(vLLM and TGI both leaked such prefixes into streams). When the output ends without a match,
the held tail is released, so the concatenated deltas still equal the whole text.
"""

from __future__ import annotations

from typing import Sequence

from services.gateway.text.detokenizer import IncrementalDetokenizer


class _Automaton:
    """Knuth-Morris-Pratt over one stop string: fed one character at a time, it knows the longest prefix of the
    stop string the text ends with (`state`), so nothing already seen is scanned again. Scanning the tail anew at
    every token cost O(len(stop)^2) per token: 4 stop strings of 256 characters held the event loop for seconds
    over a 4,096-token answer."""

    __slots__ = ("s", "fail", "state")

    def __init__(self, s: str):
        self.s, self.state, self.fail = s, 0, [0] * len(s)
        k = 0
        for i in range(1, len(s)):
            while k and s[i] != s[k]:
                k = self.fail[k - 1]
            k += s[i] == s[k]
            self.fail[i] = k

    def step(self, c: str) -> bool:
        """Advance over one character; True when the stop string now ends the text."""
        k = self.state
        while k and c != self.s[k]:
            k = self.fail[k - 1]
        k += c == self.s[k]
        if k == len(self.s):
            self.state = self.fail[k - 1]
            return True
        self.state = k
        return False


class StopMatcher:
    """The first stop string to complete in the text ends the output (of two completing at the same character, the
    longer: it started first)."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in dict.fromkeys(stops) if s]
        self._automata = [_Automaton(s) for s in self.stops]
        self.held = ""  # text that may be the start of a stop string: the longest partial match's characters
        self.matched: str | None = None  # the stop string found, once found

    def feed(self, text: str) -> str:
        """Add text; return what is now safe to show (never part of a stop string)."""
        if self.matched is not None:
            return ""
        pending = self.held + text
        if not self.stops:
            return pending
        base = len(self.held)
        for i, c in enumerate(text):
            done = [a.s for a in self._automata if a.step(c)]  # every automaton steps: their states stay right
            if done:
                self.matched, self.held = max(done, key=len), ""  # ending here, the longest started first
                return pending[: base + i + 1 - len(self.matched)]
        keep = max(a.state for a in self._automata)
        self.held = pending[len(pending) - keep :] if keep else ""
        return pending[: len(pending) - keep]

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
