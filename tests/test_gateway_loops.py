"""The gateway's background loops survive any Redis error, and /ready tells when one is not running."""

from __future__ import annotations

import asyncio

import pytest
import redis

from services.gateway.core import cancel_until_done
from services.gateway.errors import Unavailable
from tests.inproc import gateway_core, mark_live


async def _wait(check, timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not await check():
            await asyncio.sleep(0.05)


def test_reply_reader_outlives_the_loss_of_its_group_and_makes_it_again(redis_server, redis_client, names):
    async def run():
        core = gateway_core(redis_server.url, names)
        await core.start()
        try:
            await core.r.delete(core.reply_to)  # Redis lost the stream and its group
            await _wait(lambda: _has_group(core))
            assert not core.stalled_loops()
        finally:
            await core.stop()

    asyncio.run(run())


async def _has_group(core) -> bool:
    try:
        return len(await core.r.xinfo_groups(core.reply_to)) == 1
    except redis.ResponseError:  # no such key yet
        return False


def test_ready_answers_503_while_the_reply_reader_is_not_running(redis_server, redis_client, names):
    mark_live(redis_client, names)

    async def run():
        core = gateway_core(redis_server.url, names)
        await core.start()
        try:
            assert await core.ready() == {"tokenizer": 1, "scheduler": 1, "worker": 1}
            reader = next(t for t in core._tasks if t.get_name() == "replies")
            assert not await cancel_until_done([reader], 10)
            with pytest.raises(Unavailable, match="replies"):
                await core.ready()
        finally:
            await core.stop()

    asyncio.run(run())
