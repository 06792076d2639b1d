"""Redis replies as Python values, whichever way the client was made (with or without decode_responses)."""

from __future__ import annotations


def as_text(v) -> str:
    """A reply as text: bytes decoded (a client without decode_responses), anything else str()."""
    return v.decode() if isinstance(v, bytes) else str(v)
