"""vLLM's truncate_prompt_tokens in the tokenizer (services/tokenizer/service.py): the prompt's last k tokens are
kept, and -1 keeps as many as the context window leaves after max_tokens."""

from __future__ import annotations

import pytest

from services.tokenizer.service import Preprocessor
from shared.wire.events import RequestReceived, Sampling
from shared.text.tokenization import load_tokenizer

WINDOW = 64


@pytest.fixture(scope="module")
def pre(model_dir):
    return Preprocessor(load_tokenizer(model_dir), WINDOW)


def _ids(pre, keep: int, max_tokens: int = 4, ids: tuple[int, ...] = tuple(range(100, 300))) -> list[int]:
    ev = RequestReceived(
        request_id="r",
        reply_to="x",
        prompt_token_ids=ids,
        sampling=Sampling(max_tokens=max_tokens),
        deadline=0.0,
        received_at=0.0,
        truncate_prompt_tokens=keep,
    )
    return pre.token_ids(ev)


def test_the_prompts_last_k_tokens_are_kept(pre):
    assert _ids(pre, 10) == list(range(290, 300))


def test_minus_one_keeps_what_the_window_leaves_after_max_tokens(pre):
    assert _ids(pre, -1, max_tokens=24) == list(range(300 - (WINDOW - 24), 300))


def test_a_prompt_shorter_than_k_is_kept_whole(pre):
    assert _ids(pre, 50, ids=(5, 6, 7)) == [5, 6, 7]
