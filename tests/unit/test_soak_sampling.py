"""benchmarks.cluster.soak's sample schedule: one sample in each interval, at a varied point of it, so that periodic work
of the cluster (the janitor's 10 s sweeps) is not seen at one phase and its slow drift read as a step."""

import random

import pytest

from benchmarks.cluster.soak import next_sample

pytestmark = pytest.mark.unit

INTERVAL = 10.0
SAMPLE_COST = 0.3  # seconds a sample takes (the census)


def schedule(n: int) -> list[float]:
    rng, k, at, out = random.Random(0), 0, 0.0, []
    for _ in range(n):
        k, at = next_sample(k, at + SAMPLE_COST, INTERVAL, rng)
        out.append(at)
    return out


def test_soak_samples_fall_one_in_each_interval():
    times = schedule(200)
    assert [int(t // INTERVAL) for t in times] == list(range(1, 201))


def test_soak_samples_fall_at_varied_points_of_their_intervals():
    phases = [t % INTERVAL for t in schedule(200)]
    # A grid-locked sampler sees one phase: every point of the interval must be visited, in each fifth of it.
    assert {int(p // (INTERVAL / 5)) for p in phases} == set(range(5))


def test_a_slow_sample_skips_the_intervals_it_overran():
    k, at = next_sample(3, 5.5 * INTERVAL, INTERVAL, random.Random(0))
    assert k == 5 and 5.5 * INTERVAL <= at < 6 * INTERVAL
