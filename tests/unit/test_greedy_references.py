"""The suite's greedy reference (tests/support/references.py): each continuation computed once per machine, a
shorter ask answered from a longer one, the file shared by test processes and never read under another stamp."""

from __future__ import annotations

import json

import pytest

from tests.support import references
from tests.support.references import GreedyReferences

EOS = 0


class CountingModel:
    """Stands in for transformers' model here (the real one's prefix property is tests/e2e/test_greedy_references.py):
    greedy tokens 1, 2, 3, ... after the prompt, an EOS after `ends_after` of them; counts its generate calls."""

    def __init__(self, ends_after: int = 1000):
        self.calls, self.ends_after = 0, ends_after

    def generate(self, ids, attention_mask, do_sample, max_new_tokens):
        import torch

        self.calls += 1
        new = list(range(1, self.ends_after + 1)) + [EOS]
        return torch.cat([ids, torch.tensor([new[:max_new_tokens]])], dim=1)


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "model").mkdir()
    return tmp_path / "model"


def test_a_shorter_ask_is_a_slice_of_a_longer_continuation_without_generating(model_dir):
    model = CountingModel()
    refs = GreedyReferences(model_dir, lambda: model)
    assert refs([5, 6], 8) == list(range(1, 9))
    assert refs([5, 6], 3) == [1, 2, 3]
    assert model.calls == 1


def test_a_longer_ask_than_was_computed_generates_again(model_dir):
    model = CountingModel()
    refs = GreedyReferences(model_dir, lambda: model)
    refs([5, 6], 3)
    assert refs([5, 6], 8) == list(range(1, 9))
    assert model.calls == 2


def test_a_continuation_that_ended_answers_any_longer_ask(model_dir):
    model = CountingModel(ends_after=4)
    refs = GreedyReferences(model_dir, lambda: model)
    assert refs([5], 16) == [1, 2, 3, 4, EOS]
    assert refs([5], 64) == [1, 2, 3, 4, EOS]
    assert model.calls == 1


def test_a_continuation_another_process_computed_is_read_from_the_file(model_dir):
    first, second = CountingModel(), CountingModel()
    refs_a = GreedyReferences(model_dir, lambda: first)
    refs_b = GreedyReferences(model_dir, lambda: second)  # read the file before refs_a wrote anything
    refs_a([7], 4)
    assert refs_b([7], 4) == [1, 2, 3, 4]
    assert second.calls == 0


def test_each_instance_keeps_the_records_of_the_other_when_both_write(model_dir):
    refs_a = GreedyReferences(model_dir, CountingModel)
    refs_b = GreedyReferences(model_dir, CountingModel)
    refs_a([1], 2)
    refs_b([2], 2)
    assert len(json.loads(refs_a.path.read_text())) == 2


def test_a_file_written_under_other_versions_or_another_cpu_is_never_read(model_dir, monkeypatch):
    model = CountingModel()
    GreedyReferences(model_dir, lambda: model)([9], 4)
    monkeypatch.setattr(references, "_stamp", lambda: "another-cpu")
    GreedyReferences(model_dir, lambda: model)([9], 4)
    assert model.calls == 2
