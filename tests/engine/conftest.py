"""Engine test fixtures: one engine model and one reference model per session, cached HF outputs.

Reference outputs come from transformers' `generate(do_sample=False)` run one prompt at a time
without padding, on a separate model instance (the engine switches its model's attention to
the paged implementation). They are cached in a JSON file next to the converted model.
"""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.worker.engine import EngineConfig, LLMEngine


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path):
    return AutoTokenizer.from_pretrained(str(model_dir))


@pytest.fixture(scope="session")
def chat(tokenizer):
    def encode(question: str, system: str | None = None, history: list[dict] | None = None) -> list[int]:
        messages = ([{"role": "system", "content": system}] if system else []) + (history or [])
        messages.append({"role": "user", "content": question})
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"])
    return encode


@pytest.fixture(scope="session")
def engine_model(model_dir: Path):
    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


class ReferenceOutputs:
    """HF greedy continuations, computed lazily on a model of their own and cached on disk."""

    def __init__(self, model_dir: Path):
        self.model_dir = model_dir
        self.path = model_dir.parent / f"{model_dir.name}.engine-test-refs.json"
        self._model = None
        self._lock = threading.Lock()
        self._cache: dict[str, list[int]] = json.loads(self.path.read_text()) if self.path.exists() else {}

    def __call__(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        key = hashlib.sha256(json.dumps([prompt, max_new_tokens]).encode()).hexdigest()
        with self._lock:
            if key not in self._cache:
                self._cache[key] = self._generate(prompt, max_new_tokens)
                tmp = self.path.with_suffix(".tmp")
                tmp.write_text(json.dumps(self._cache))
                tmp.replace(self.path)
            return list(self._cache[key])

    def _generate(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        if self._model is None:
            self._model = AutoModelForCausalLM.from_pretrained(str(self.model_dir), dtype=torch.float32).eval()
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = self._model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                       max_new_tokens=max_new_tokens)
        return out[0, len(prompt):].tolist()


@pytest.fixture(scope="session")
def hf_greedy(model_dir: Path) -> ReferenceOutputs:
    return ReferenceOutputs(model_dir)


@pytest.fixture
def make_engine(engine_model):
    def build(**overrides) -> LLMEngine:
        cfg = {"num_kv_blocks": 256, "max_num_batched_tokens": 512, "max_num_seqs": 64} | overrides
        return LLMEngine.from_model(engine_model, EngineConfig(**cfg))
    return build
