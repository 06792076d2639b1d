"""Reading the lifecycle change feed (issue 14).

The feed (`Names.lifecycle_feed`, capped at LIFECYCLE_FEED_MAXLEN) gets one flat record per transition, appended by
the creating script (shared/state/context_store.py) and the transition script (shared/state/lifecycle.py) in the same atomic
step as the change itself. A conversation session's moves (shared.state.sessions) are recorded too, in the partition of
the session's turn, right after the move applied: the session's record lives in its owner's slot, which no script
of a Redis Cluster can write together with a request's partition (a process dying between the two loses the
record, never the move). This module only decodes what they wrote.
"""

from __future__ import annotations

import msgspec

from shared.wire.constants import LIFECYCLE_FEED_FIELDS
from shared.redis_io.replies import as_text


class FeedRecord(msgspec.Struct, frozen=True):
    """One transition as the feed holds it."""

    id: str  # stream entry id (orders records; a reader resumes after it)
    rid: str  # request id
    from_: str  # state before ("" for the request's creation)
    to: str  # state after
    reason: str  # why ("" when none was given)
    service: str  # service that made the transition
    at: float  # Redis time of the transition (epoch seconds)
    owner: str  # API key id of the request's owner ("" without keys)
    worker: str  # worker of the placement a SCHEDULED transition records ("" otherwise)
    attempt: int  # that placement's attempt (0 otherwise)
    session: str = ""  # a conversation session's move (from/to are its states, rid its turn's request); "" otherwise

    def to_wire(self) -> dict:
        """The JSON the dashboard gets (the owner is left out: a browser has no use for key ids)."""
        return {
            "id": self.id,
            "rid": self.rid,
            "from": self.from_,
            "to": self.to,
            "reason": self.reason,
            "service": self.service,
            "at": self.at,
            "worker": self.worker,
            "attempt": self.attempt,
            "session": self.session,
        }


def decode_record(entry_id, fields: dict) -> FeedRecord:
    """A feed entry (as redis-py returns it, bytes or str) as a FeedRecord; KeyError/ValueError if malformed."""
    f = {as_text(k): as_text(v) for k, v in fields.items()}
    # `session` is optional: records written before it existed stay readable.
    missing = [k for k in LIFECYCLE_FEED_FIELDS if k not in f and k != "session"]
    if missing:
        raise KeyError(f"feed record {as_text(entry_id)} lacks {missing}")
    return FeedRecord(
        id=as_text(entry_id),
        rid=f["rid"],
        from_=f["from"],
        to=f["to"],
        reason=f["reason"],
        service=f["service"],
        at=float(f["at"]),
        owner=f["owner"],
        worker=f["worker"],
        attempt=int(f["attempt"] or 0),
        session=f.get("session", ""),
    )
