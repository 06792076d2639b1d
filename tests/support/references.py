"""transformers' greedy continuations: the reference every greedy output of the suite is compared with.

`generate(do_sample=False)` one prompt at a time without padding, on transformers' own float32 model (never the
engine's: the engine switches its model's attention to the paged implementation). Computing them was a large part
of `make test`'s CPU (transformers decodes token by token in Python), so each is computed once per machine:

- Kept in one JSON file next to the converted model, shared by every test process of a run (pytest-xdist) and by
  later runs. The file's name holds transformers' and torch's versions and the CPU's identity: the same greedy
  tokens are what those decide, and a file written under others is never read (a near tie can go the other way
  on another CPU's kernels).
- A continuation of n tokens is the first n of any longer one of the same prompt (greedy decoding is causal and
  each step's forward pass is the same whatever the limit), and a continuation that ended before its limit (an EOS)
  is whole at any limit: so only the longest asked is kept, and a shorter ask is a slice of it.
- The model is loaded (`load_model()`) only when a continuation is missing.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import threading
from importlib.metadata import version
from pathlib import Path
from typing import Any, Callable

from filelock import FileLock

from services.worker.engine.cpu.cpu_info import this_cpu


def _stamp() -> str:
    what = f"transformers {version('transformers')} torch {version('torch')} {this_cpu().identity()}"
    return hashlib.sha256(what.encode()).hexdigest()[:12]


def _better(a: dict | None, b: dict | None) -> dict | None:
    """Of two records of one prompt, the one that answers more limits: an ended one, else the longer."""
    if a is None or b is None:
        return a or b
    return max(a, b, key=lambda r: (len(r["tokens"]) < r["asked"], len(r["tokens"])))


class GreedyReferences:
    """reference(prompt_ids, max_new_tokens) -> transformers' greedy tokens; .prompt_ids(prompt or messages) -> the
    ids transformers' tokenizer gives; .tokenizer and .model for tests that need transformers' text or logits."""

    def __init__(self, model_dir: Path, load_model: Callable[[], Any]):
        self.model_dir = model_dir
        self.path = model_dir.parent / f"{model_dir.name}.greedy-refs-{_stamp()}.json"
        self._load_model = load_model
        self._lock = threading.Lock()  # test threads of one process
        self._records: dict[str, dict] = {}
        self._merge_file()

    def __call__(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        key = hashlib.sha256(json.dumps(list(prompt)).encode()).hexdigest()
        with self._lock:
            if (tokens := self._answer(key, max_new_tokens)) is None:
                self._merge_file()  # another test process may have computed it since
                tokens = self._answer(key, max_new_tokens)
            if tokens is None:
                record = {"tokens": self._generate(prompt, max_new_tokens), "asked": max_new_tokens}
                self._records[key] = _better(self._records.get(key), record)
                self._save()
                tokens = self._answer(key, max_new_tokens)
            return tokens

    def _answer(self, key: str, n: int) -> list[int] | None:
        record = self._records.get(key)
        if record is None or (len(record["tokens"]) < n and len(record["tokens"]) == record["asked"]):
            return None
        return list(record["tokens"][:n])

    def _merge_file(self) -> None:
        with self._file_lock():
            self._read_into()

    def _save(self) -> None:
        """Under the file's lock: the records other processes wrote since, merged, then the whole file replaced."""
        with self._file_lock():
            self._read_into()
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(self._records))
            tmp.replace(self.path)

    def _read_into(self) -> None:
        if self.path.exists():
            for key, record in json.loads(self.path.read_text()).items():
                self._records[key] = _better(self._records.get(key), record)

    def _file_lock(self) -> FileLock:
        return FileLock(str(self.path.with_suffix(".lock")), timeout=120)

    def _generate(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        import torch

        ids = torch.tensor([list(prompt)])
        with torch.inference_mode():
            out = self.model.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens
            )
        return out[0, len(prompt) :].tolist()

    @property
    def model(self):
        """transformers' float32 model (loaded on first use; read only)."""
        return self._load_model()

    @functools.cached_property
    def tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(self.model_dir))

    def prompt_ids(self, prompt: str | None = None, messages: list | None = None) -> list[int]:
        if messages is not None:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            return self.tokenizer.encode(text, add_special_tokens=False)
        return self.tokenizer.encode(prompt)
