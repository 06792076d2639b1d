"""The tokenizer service's prompts tokenized by the Rust tokenizer directly (shared.text.tokenization.encoder): the same
ids as transformers' encode, which it skips only where it gives them."""

from __future__ import annotations

import random

from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import TokenizersBackend

from shared.text.tokenization import encoder

VOCAB = {"[UNK]": 0, "<s>": 1, "hello": 2, "world": 3, "a": 4, "b": 5}


def _word_level(truncate_at: int) -> TokenizersBackend:
    """A tokenizer whose file asks for a BOS before each text and truncates at truncate_at tokens (transformers'
    encode turns truncation off unless asked)."""
    tk = Tokenizer(models.WordLevel(VOCAB, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tk.enable_truncation(truncate_at)
    return TokenizersBackend(tokenizer_object=tk, bos_token="<s>", unk_token="[UNK]")


class Prefixing(TokenizersBackend):
    """A tokenizer class whose encode adds a token of its own in Python, around its Rust tokenizer."""

    def encode(self, text, add_special_tokens=True, **kwargs):
        return [4, *super().encode(text, add_special_tokens=add_special_tokens, **kwargs)]


def test_the_served_models_prompts_tokenize_to_transformers_ids(tokenizer):
    rng = random.Random(0)
    encode = encoder(tokenizer)
    for _ in range(200):
        text = tokenizer.decode([rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 160))])
        for special in (True, False):
            assert encode(text, special) == tokenizer.encode(text, add_special_tokens=special)


def test_a_bos_template_applies_and_the_files_truncation_does_not():
    tok = _word_level(truncate_at=3)
    encode = encoder(tok)
    assert encode("hello world a b a b", True) == tok.encode("hello world a b a b") == [1, 2, 3, 4, 5, 4, 5]
    assert encode("hello world a b", False) == [2, 3, 4, 5]


def test_a_tokenizer_whose_encode_differs_from_its_rust_tokenizer_keeps_its_own():
    tok = Prefixing(tokenizer_object=_word_level(truncate_at=64).backend_tokenizer, bos_token="<s>", unk_token="[UNK]")
    assert encoder(tok)("hello world", True) == tok.encode("hello world") == [4, 1, 2, 3]
