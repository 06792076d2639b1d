"""Log probabilities on the bus: a worker packs a delta's TokenLogprobs into one compact Logprobs (float32
values, top ids), the gateway unpacks them; each service keeps its own plain objects."""

from __future__ import annotations

import sys
from array import array
from typing import NamedTuple, Sequence

from shared.events import Logprobs


class TokenLogprob(NamedTuple):
    """One output token's log probability and its most likely alternatives (ids and log probabilities)."""

    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


def pack(entries: Sequence) -> Logprobs:
    """entries: one per token, each with .logprob, .top_ids, .top_logprobs (the worker's TokenLogprobs). Every
    token carries as many alternatives as the fewest of them has (the engine always gives the request's k)."""
    top = min(len(e.top_ids) for e in entries)
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
