"""Log probabilities on the bus: a worker packs a delta's TokenLogprobs into one compact Logprobs (float32
values, top ids), the gateway unpacks them; each service keeps its own plain objects."""

from __future__ import annotations

import sys
from array import array
from typing import NamedTuple, Sequence

from shared.wire.events import Logprobs, PromptLogprobs


class TokenLogprob(NamedTuple):
    """One output token's log probability and its most likely alternatives (ids and log probabilities)."""

    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()
    rank: int = 0  # prompt tokens: its rank among the vocabulary (1 = most likely); 0 = not given


def pack(entries: Sequence, top: int | None = None) -> Logprobs:
    """entries: one per token, each with .logprob, .top_ids, .top_logprobs (the worker's TokenLogprobs). Every
    token carries as many alternatives as the fewest of them has (the engine always gives the request's k); top:
    what an empty list says it carries."""
    top = min((len(e.top_ids) for e in entries), default=top or 0)
    values = array("f")
    ids: list[int] = []
    for e in entries:
        values.append(e.logprob)
        values.extend(e.top_logprobs[:top])
        ids.extend(e.top_ids[:top])
    if sys.byteorder != "little":
        values.byteswap()
    return Logprobs(top=top, values=values.tobytes(), top_ids=tuple(ids))


def unpack(lp: Logprobs) -> list[TokenLogprob]:
    values = array("f")
    values.frombytes(lp.values)
    if sys.byteorder != "little":
        values.byteswap()
    k = lp.top
    n = len(values) // (k + 1)
    if n * (k + 1) != len(values) or len(lp.top_ids) != n * k:
        raise ValueError(f"malformed logprobs: {len(values)} values and {len(lp.top_ids)} ids for top {k}")
    return [
        TokenLogprob(
            values[i * (k + 1)],
            tuple(lp.top_ids[i * k : (i + 1) * k]),
            tuple(values[i * (k + 1) + 1 : (i + 1) * (k + 1)]),
        )
        for i in range(n)
    ]


def pack_prompt(token_ids: Sequence[int], entries: Sequence, top: int) -> PromptLogprobs:
    """entries: prompt tokens 1.. (the worker's TokenLogprobs, with their ranks); top: the request's k."""
    return PromptLogprobs(tuple(token_ids), pack(entries, top), tuple(e.rank for e in entries))


def unpack_prompt(p: PromptLogprobs) -> list[TokenLogprob]:
    """-> one TokenLogprob (with its rank) per prompt token from the second."""
    entries = unpack(p.logprobs)
    if len(entries) != len(p.ranks) or (p.token_ids and len(entries) != len(p.token_ids) - 1):
        raise ValueError(
            f"malformed prompt logprobs: {len(entries)} for {len(p.token_ids)} tokens, {len(p.ranks)} ranks"
        )
    return [e._replace(rank=r) for e, r in zip(entries, p.ranks)]
