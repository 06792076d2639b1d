"""Answers built and encoded without holding the event loop (issue 24, item 9): the one way every API path turns
a heavy body or stream event into bytes, and runs other heavy client-controlled work (a request's schemas).

The loop serves every request, /health, the reply reader and the keep-alive; n=16 x logprobs=20 x 4096 tokens is
1.4 M objects and ~100 MB of JSON, ~10 s of work on the loop as it was. Three things bound it:
- work whose weight (the JSON values it makes: tokens x (1 + alternatives)) is past HEAVY runs in this module's
  threads (off_loop); the GIL passes to the loop every 5 ms of bytecode, so the loop keeps answering;
- a long array of log probabilities is a Sliced: made SLICE items at a time as it is encoded, each slice encoded
  by one C call (which holds the GIL for its ~2 ms), then dropped. Built whole, the objects of one such body make
  the cyclic collector's full passes (which hold the GIL) last 0.7 s and more, and take ~1 GB;
- msgspec encodes those slices ~7x faster than json.dumps.
Bytes are what they were: light bodies go through json.dumps exactly as JSONResponse and edge.sse.sse do; a
heavy body is written piece by piece in the same form (separators, ensure_ascii=False), its floats as Python
writes them (ExactFloat: msgspec writes 1e-05 as 0.00001, a different text of the same number).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable, TypeVar

import msgspec
from starlette.responses import Response

logger = logging.getLogger(__name__)

T = TypeVar("T")
SLICE = 256  # items of a long array per encoding call (chat log probabilities: ~2 ms of msgspec)
HEAVY = 8192  # weight from which work leaves the loop (below it the hand-off to a thread costs more than it saves)
# Threads of their own: the default executor also resolves host names (a new Redis connection) and must not wait
# behind bodies. Two: the gateway's share of a small machine; more heavy requests wait for their turn.
_POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="gateway-render")

_COMPACT = {"ensure_ascii": False, "allow_nan": False, "indent": None, "separators": (",", ":")}  # JSONResponse
_SPACED = {"ensure_ascii": False}  # an SSE event's data (json.dumps' defaults)


class ExactFloat(float):
    """A float msgspec would write differently from Python (outside 1e-4 <= |x| < 1e16): written as repr."""


def exact(value: float) -> float:
    """value, wrapped where msgspec's text of it differs from json.dumps'. Floats of a Sliced go through here."""
    if value == 0.0 or 1e-4 <= abs(value) < 1e16:
        return value
    return ExactFloat(value)


def _exact_hook(obj: Any) -> Any:
    if isinstance(obj, ExactFloat):
        if not math.isfinite(obj):  # as json.dumps(allow_nan=False) in JSONResponse: no NaN in a JSON body
            raise ValueError("Out of range float values are not JSON compliant")
        return msgspec.Raw(float.__repr__(obj).encode())
    raise TypeError(f"cannot encode {type(obj).__name__}")


_msgspec = msgspec.json.Encoder(enc_hook=_exact_hook)


class Sliced:
    """A long JSON array made on demand: make(start, stop) gives items [start, stop) as a list, or, for an object
    of parallel arrays (completions' logprobs), a dict of such lists (same keys each time). Made in order, once:
    a maker may carry state from one slice to the next (completions' text_offset)."""

    __slots__ = ("length", "make", "_used")

    def __init__(self, length: int, make: Callable[[int, int], Any]):
        self.length, self.make, self._used = length, make, False

    def slices(self) -> Iterable[Any]:
        if self._used:
            raise RuntimeError("a Sliced is made once")
        self._used = True
        for start in range(0, self.length, SLICE):
            yield self.make(start, min(start + SLICE, self.length))

    def whole(self) -> Any:
        """Every item at once (what the encoder writes), for a reader of the body that is not the encoder."""
        parts = list(self.slices())
        if parts and isinstance(parts[0], dict):
            return {k: [x for p in parts for x in p[k]] for k in parts[0]}
        return [x for p in parts for x in p]


def sliced(length: int, make: Callable[[int, int], Any]) -> Any:
    """make's items: as they are when they fit in one slice, else a Sliced."""
    return make(0, length) if length <= SLICE else Sliced(length, make)


def encode(value: Any, spaced: bool = False) -> bytes:
    """value as JSON, compact (JSONResponse's form) or spaced (an SSE event's), in one json.dumps call: for a
    light body (a Sliced in it made whole)."""
    return json.dumps(value, default=_whole, **(_SPACED if spaced else _COMPACT)).encode()


def _whole(obj: Any) -> Any:
    if isinstance(obj, Sliced):
        return obj.whole()
    raise TypeError(f"Object of type {type(obj).__name__} is not JSON serializable")


def encode_heavy(value: Any, spaced: bool = False) -> bytes:
    """What encode(value, spaced) gives, written piece by piece: no call holds the GIL for long, and a Sliced is
    never whole in memory. For the render threads."""
    out: list[bytes] = []
    _Writer(out, spaced).value(value)
    return b"".join(out)


class _Columns:
    """The columns of a Sliced object (a dict of lists), each already encoded slice by slice."""

    def __init__(self, pieces: dict[str, list[bytes]]):
        self.pieces = pieces


class _Writer:
    """Writes a body whose bulk is in Sliced values and long lists; everything else (a few dozen values) one by
    one with json.dumps, so that the bytes are json.dumps' own."""

    def __init__(self, out: list[bytes], spaced: bool):
        self.out, self.spaced = out, spaced
        self.opts = _SPACED if spaced else _COMPACT
        self.item_sep, self.key_sep = (b", ", b": ") if spaced else (b",", b":")

    def dumps(self, value: Any) -> bytes:
        return json.dumps(value, **self.opts).encode()

    def value(self, value: Any) -> None:
        if isinstance(value, Sliced):
            self.sliced(value)
        elif isinstance(value, _Columns):
            self.items(((k, v) for k, v in value.pieces.items()), self.array)
        elif isinstance(value, dict):
            self.items(value.items(), self.value)
        elif isinstance(value, (list, tuple)) and len(value) > SLICE:  # plain values (token ids): in slices
            self.array([self.dumps(list(value[i : i + SLICE])) for i in range(0, len(value), SLICE)])
        elif isinstance(value, (list, tuple)):
            self.out.append(b"[")
            for i, v in enumerate(value):
                if i:
                    self.out.append(self.item_sep)
                self.value(v)
            self.out.append(b"]")
        else:
            self.out.append(self.dumps(value))

    def items(self, pairs: Iterable[tuple[Any, Any]], write: Callable[[Any], None]) -> None:
        self.out.append(b"{")
        for i, (k, v) in enumerate(pairs):
            if not isinstance(k, str):
                raise TypeError(f"a body's keys are strings (got {type(k).__name__})")
            self.out.extend((self.item_sep if i else b"", self.dumps(k), self.key_sep))
            write(v)
        self.out.append(b"}")

    def array(self, pieces: list[bytes]) -> None:
        """An array from the encodings ("[...]" each) of consecutive slices of it."""
        inner = [p[1:-1] for p in pieces if len(p) > 2]
        self.out.extend((b"[", self.item_sep.join(inner), b"]"))

    def slice_bytes(self, items: list) -> bytes:
        # msgspec's compact form is JSONResponse's (its floats made exact); the spaced form is json.dumps' alone
        return self.dumps(items) if self.spaced else _msgspec.encode(items)

    def sliced(self, s: Sliced) -> None:
        parts = iter(s.slices())
        first = next(parts, None)
        if not isinstance(first, dict):  # an array (None: an empty one)
            head = [] if first is None else [self.slice_bytes(first)]
            self.array(head + [self.slice_bytes(p) for p in parts])
            return
        columns = {k: [self.slice_bytes(v)] for k, v in first.items()}
        for part in parts:
            for k, v in part.items():
                columns[k].append(self.slice_bytes(v))
        self.value(_Columns(columns))


async def off_loop(work: Callable[[], T], weight: int) -> T:
    """work(): here when light, else in a render thread while the loop serves everything else."""
    if weight < HEAVY:
        return work()
    return await asyncio.get_running_loop().run_in_executor(_POOL, work)


class EncodedJSON(Response):
    """A JSON body already encoded (JSONResponse's media type and bytes)."""

    media_type = "application/json"


async def json_response(build: Callable[[], Any], weight: int, headers: dict | None = None) -> Response:
    """The JSON answer of build() (a body that may hold Sliced values), built and encoded off the loop when heavy."""
    if weight < HEAVY:
        return EncodedJSON(encode(build()), headers=headers)
    return EncodedJSON(await off_loop(lambda: encode_heavy(build()), weight), headers=headers)


async def sse_events(build: Callable[[], list], weight: int) -> bytes:
    """The SSE bytes of build()'s events (dicts, or "[DONE]"), as edge.sse.sse writes them one by one."""
    if weight < HEAVY:
        return b"".join(_event(e, encode) for e in build())
    return await off_loop(lambda: b"".join(_event(e, encode_heavy) for e in build()), weight)


def _event(data: Any, enc: Callable[..., bytes]) -> bytes:
    payload = data.encode() if isinstance(data, str) else enc(data, spaced=True)
    return b"data: " + payload + b"\n\n"
