"""Noticing that Redis lost its data (a restart without persistence, a FLUSHALL).

One random value per dataset sits in the key `Names.epoch`: the first process to find it missing
sets it (SET NX), every process remembers the value it saw. A missing or different value means
the dataset this process worked with is gone: its streams, groups, contexts and queues with it.
Each service then drops what it held for the old dataset (the gateway answers its clients at once
instead of letting them wait for their deadline) and starts afresh.
"""

from __future__ import annotations

import logging
import uuid

from shared.wire.constants import Names

logger = logging.getLogger(__name__)

EPOCH_TTL_S = 7 * 24 * 3600  # refreshed by every check; bounds the key once the whole cluster is gone


class DatasetEpoch:
    def __init__(self, names: Names):
        self.key = names.epoch
        self.known: str | None = None  # the value this process has seen; None before its first check

    def queue(self, pipe) -> None:
        """Queue the check on a pipeline (sync or asyncio); pass the pipeline's last reply to changed()."""
        pipe.set(self.key, uuid.uuid4().hex, nx=True, ex=EPOCH_TTL_S)
        pipe.getex(self.key, ex=EPOCH_TTL_S)

    def changed(self, value: bytes | str | None) -> bool:
        """Adopt the dataset's value; True when it differs from the one seen before (data was lost)."""
        value = value.decode() if isinstance(value, bytes) else value
        if value is None or value == self.known:
            return False
        first, self.known = self.known is None, value
        if not first:
            logger.error("Redis lost its data (dataset epoch changed): dropping what was held for the old one")
        return not first

    def check(self, client) -> bool:
        pipe = client.pipeline(transaction=False)
        self.queue(pipe)
        return self.changed(pipe.execute()[-1])

    async def acheck(self, client) -> bool:
        pipe = client.pipeline(transaction=False)
        self.queue(pipe)
        return self.changed((await pipe.execute())[-1])
