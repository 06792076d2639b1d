"""The worker's writes to conversation sessions' records (shared.state.sessions): what its engine did with their KV.

A finished turn whose KV the engine kept is paused before the step's completion is published, so a client that
sends its next turn as soon as it has the answer finds the session PAUSED here (and its turn placed here). Later
moves (swapped to disk, released under pressure, idle or at shutdown) are recorded after the step. Each write is
fenced on the turn's request id and this worker's id: once the session's next turn started (anywhere), nothing this
worker writes about the old turn changes it. A write Redis refuses is logged and dropped, never retried: the
record then says less than the engine holds (a turn placed elsewhere recomputes), which is safe.
"""

from __future__ import annotations

import logging

from services.worker.engine.kv.session_kv import SessionEvent
from shared.redis_io.redis_client import TRANSIENT_ERRORS
from shared.state.sessions import SessionStore, pause, released, swapped

logger = logging.getLogger(__name__)


class SessionRecorder:
    def __init__(self, store: SessionStore, worker_id: str):
        self.store = store
        self.worker_id = worker_id
        self._unrecorded: list = []  # pauses applied, their feed records written after the step's publish

    def paused(self, outputs, active: dict) -> list[str]:
        """Pause the sessions of the step's finished turns whose KV was kept. active: the worker's held requests.
        -> the sessions whose pause was not made (closed meanwhile, or a newer turn began): their KV is not wanted."""
        moves = [
            pause(a.session, o.request_id, self.worker_id, o.session_blocks)
            for o in outputs
            if o.finished and o.session_blocks and (a := active.get(o.request_id)) is not None and a.session
        ]
        return [m.key for m in self._run(moves, "pause")]

    def moved(self, events: list[SessionEvent]) -> None:
        """Record the engine's later moves, then the feed records of this step's moves (off the completions' path)."""
        moves = [
            swapped(e.session, e.request_id, self.worker_id)
            if e.what == "swapped"
            else released(e.session, e.request_id, self.worker_id, e.reason)
            for e in events
        ]
        self._run(moves, "record")
        applied, self._unrecorded = self._unrecorded, []
        self.store.record(applied)

    def _run(self, moves, what: str) -> list:
        """Run the moves -> those Redis answered and did not apply (not those it could not be asked: unknown).
        The applied ones wait in _unrecorded for their feed records."""
        if not moves:
            return []
        try:
            pipe = self.store.r.pipeline(transaction=False)
            for m in moves:
                self.store.queue_move(pipe, m)
            replies = pipe.execute(raise_on_error=False)
        except TRANSIENT_ERRORS as e:
            logger.warning(
                "could not %s %d sessions (%s): their records say less than this worker holds", what, len(moves), e
            )
            return []
        refused = []
        for m, reply in zip(moves, replies):
            if isinstance(reply, Exception):
                logger.warning("session move %s -> %s failed: %r", m.key, m.to.value, reply)
            elif (res := self.store.result(reply)).applied:
                self._unrecorded.append((m, res))
            else:
                # The ordinary race: the session's next turn began (or it was closed) before this worker's write.
                logger.debug("session move %s -> %s: %s (state %s)", m.key, m.to.value, res.status.value, res.state)
                refused.append(m)
        return refused
