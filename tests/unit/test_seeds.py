"""Seeds take OpenAI's whole int64 range: the engine's generator is seeded from any of them the same way every time,
and the choices of n > 1 (seed + index) wrap within that range, choice 0 keeping the request's own seed."""

from __future__ import annotations

import pytest
import torch

from services.gateway.session.groups import choice_body
from services.gateway.session.request import INT64_MAX, INT64_MIN, GenerateRequest
from services.worker.engine.sampling.sampler import generator_seed

SEEDS = [INT64_MIN, -123456789, -1, 0, 1, INT64_MAX]


def _draws(seed: int) -> list[float]:
    return torch.rand(8, generator=torch.Generator().manual_seed(generator_seed(seed))).tolist()


@pytest.mark.parametrize("seed", SEEDS)
def test_every_int64_seed_seeds_a_generator_in_its_range_and_the_same_way_again(seed):
    assert 0 <= generator_seed(seed) < 2**64
    assert _draws(seed) == _draws(seed)


def test_no_two_int64_seeds_share_a_generator_seed():
    # (What torch then draws is its own: its CPU generator keeps only a seed's low 32 bits.)
    assert len({generator_seed(s) for s in SEEDS}) == len(SEEDS)
    assert generator_seed(-1) == 2**64 - 1 and generator_seed(INT64_MIN) == 2**63  # past every non-negative seed


@pytest.mark.parametrize(
    "seed, index, expected",
    [(-1, 0, -1), (-1, 1, 0), (INT64_MIN, 0, INT64_MIN), (INT64_MAX, 0, INT64_MAX), (INT64_MAX, 1, INT64_MIN)],
)
def test_choice_seeds_wrap_within_int64_and_choice_0_keeps_the_seed(seed, index, expected):
    assert choice_body(GenerateRequest(prompt="Hi", seed=seed), index).seed == expected
