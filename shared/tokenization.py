"""Tokenizer loading and facts about the model every service agrees on."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from shared.errors import ModelLoadError
from shared.model_files import converted_by_conveyor


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
    (shared/model_files.py) names in tokenizer_config.json the class AutoTokenizer picked when it was written; when
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
