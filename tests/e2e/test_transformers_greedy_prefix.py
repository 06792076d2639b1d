"""What the suite's greedy reference relies on, on transformers' real model: a greedy continuation of n tokens is
the first n of a longer one (tests/support/references.py answers shorter asks by slicing)."""

from __future__ import annotations

import torch


def test_transformers_greedy_continuation_is_the_prefix_of_a_longer_one(hf_reference):
    ids = torch.tensor([hf_reference.prompt_ids("The history of the printing press begins")])
    mask = torch.ones_like(ids)
    with torch.inference_mode():
        short = hf_reference.model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=8)
        long = hf_reference.model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=24)
    assert long.shape[1] == ids.shape[1] + 24, "no EOS within 24 tokens: the test compares 8 of 24"
    assert short[0].tolist() == long[0, : short.shape[1]].tolist()
