"""Tokenizer loading and facts about the model every service agrees on."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from shared.wire.errors import ModelLoadError
from shared.text.model_files import converted_by_conveyor


@dataclass(frozen=True)
class ModelInfo:
    model_dir: Path  # folder from_pretrained loads
    max_len: int  # context window in tokens (prompt + output)
    eos_token_ids: tuple[int, ...]  # tokens that end generation
    vocab_size: int = 0  # rows of the model's embedding: valid token ids are [0, vocab_size); 0 = not stated


def model_info(model_dir: Path) -> ModelInfo:
    try:
        cfg = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {model_dir / 'config.json'}: {e}") from e
    max_len = cfg.get("max_position_embeddings") or cfg.get("n_positions") or cfg.get("max_sequence_length")
    if not max_len:
        raise ModelLoadError(f"{model_dir}: config.json names no context window")
    eos = cfg.get("eos_token_id")
    gen = model_dir / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id", eos)
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    vocab_size = cfg.get("vocab_size") or cfg.get("text_config", {}).get("vocab_size") or 0
    return ModelInfo(model_dir, int(max_len), eos_ids, int(vocab_size))


def load_tokenizer(model_dir: Path):
    """The model's tokenizer, of the class transformers' AutoTokenizer picks. A folder Conveyor converted from GGUF
    (shared/text/model_files.py) names in tokenizer_config.json the class AutoTokenizer picked when it was written; when
    that is the plain `TokenizersBackend` it is loaded by that name, without AutoTokenizer, whose imports load torch:
    3 s of CPU and 250 MB more in each tokenizer and gateway process, which never run the model."""
    try:
        if _converted_with_tokenizers_backend(model_dir):
            from transformers import TokenizersBackend

            return TokenizersBackend.from_pretrained(str(model_dir))
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(model_dir))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot load the tokenizer of {model_dir}: {e}") from e


def _converted_with_tokenizers_backend(model_dir: Path) -> bool:
    if not converted_by_conveyor(model_dir):
        return False
    try:
        cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False  # AutoTokenizer says what is wrong with the folder
    return cfg.get("tokenizer_class") == "TokenizersBackend" and "auto_map" not in cfg


Encode = Callable[[str, bool], list[int]]  # (text, add_special_tokens) -> token ids

# Texts an encoder must tokenize as the tokenizer's own encode does before it is used: words, spaces, digits,
# accents and emoji, a special token written in the text, a newline run.
_PROBES = ("Hello, world!  It's 2026: ", "\n\n  tabs\tand  spaces ", "éèà ñ 中文 🙂", "<|im_start|>user\nhi<|im_end|>")


def encoder(tokenizer) -> Encode:
    """tokenizer.encode(text, add_special_tokens=...)'s ids, from its Rust tokenizer directly when it has one (a
    transformers "fast" tokenizer) and that gives the same ids on _PROBES: without transformers' work around each
    call (truncation and padding reset, a batch of one, its conversion), which is most of a cold call on a VM (a
    128-token prompt 0.8-2.4 ms instead of 3.6-6.9 after an idle 1.5 s, docs/benchmarks.md 2026-12-07). Else the
    tokenizer's own encode."""

    def own(text: str, special: bool) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=special)

    backend = getattr(tokenizer, "backend_tokenizer", None)  # a transformers "fast" tokenizer's Rust tokenizer
    if backend is None or not all(hasattr(backend, a) for a in ("encode", "no_truncation", "no_padding")):
        return own
    backend.no_truncation()  # transformers' encode turns them off on each call; its other callers set their own
    backend.no_padding()
    backend.encode_special_tokens = bool(getattr(tokenizer, "split_special_tokens", False))

    def direct(text: str, special: bool) -> list[int]:
        return backend.encode(text, add_special_tokens=special).ids

    same = all(direct(t, s) == own(t, s) for t in _PROBES for s in (True, False))
    return direct if same else own
