"""The one backoff: how long to wait before trying again, growing with each failure, capped.

Used wherever a loop waits out Redis (a service's tick, a worker's step publish, the gateway's token reads) and
for a crash-looping child of the launcher, so their pauses grow the same way. The Redis clients' own retries
(shared/redis_io/redis_client.py) take the same base and cap.
"""

from __future__ import annotations

REDIS_BASE_S = 0.05  # the first pause after Redis failed: a blip (a failover's few hundred ms) costs little
REDIS_CAP_S = 2.0  # never longer: Redis back, the service resumes within this


def backoff_s(failures: int, base_s: float = REDIS_BASE_S, cap_s: float = REDIS_CAP_S) -> float:
    """The pause after `failures` failures in a row (0: the first retry waits base_s): base_s doubled each time,
    at most cap_s."""
    return min(cap_s, base_s * 2 ** min(max(failures, 0), 32))  # the exponent bounded: no overflow, the cap holds
