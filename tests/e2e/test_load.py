"""Under a burst the gateway queues for Redis connections instead of reporting Redis as down: every request of
a burst within the configured bounds is answered 200 (the 1,000-client figure is in benchmarks/peer/burst.py)."""

from __future__ import annotations

import asyncio
from collections import Counter

import httpx

BURST = 300  # three times the size of redis-py's default asyncio pool (100 connections)


def test_a_burst_within_the_bounds_is_answered_200_every_time(cluster):
    async def run() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=BURST, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=cluster.url, timeout=300, limits=limits) as client:

            async def one(i: int) -> httpx.Response:
                return await client.post(
                    "/generate", json={"prompt": f"Burst {i}:", "max_tokens": 2, "temperature": 0, "ignore_eos": True}
                )

            return await asyncio.gather(*(one(i) for i in range(BURST)))

    answers = asyncio.run(run())
    codes = Counter(a.status_code for a in answers)
    errors = [a.json()["error"] for a in answers if a.status_code != 200][:3]
    assert codes == {200: BURST}, f"{codes}; first errors: {errors}"
    assert all(len(a.json()["token_ids"]) == 2 for a in answers)
