"""Greedy rows take the first index of the largest logit, as torch.argmax does (and transformers' greedy search)."""

from __future__ import annotations

import torch

from services.worker.engine.sampling.sampler import _argmax


def test_greedy_takes_the_first_of_equal_maxima():
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0], [5.0, 5.0, 5.0, 5.0], [-1.0, -2.0, -1.0, -3.0]])
    assert _argmax(logits) == [1, 0, 0]


def test_greedy_equals_argmax_over_a_vocabulary_with_ties():
    torch.manual_seed(0)
    logits = torch.randn(32, 49152).round(decimals=1)  # rounded: many rows hold their maximum twice or more
    assert _argmax(logits) == logits.argmax(dim=-1).tolist()
