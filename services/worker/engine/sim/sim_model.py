"""What the simulated engine knows of the model: its step-time model and its vocabulary (data only).

Built from the model folder's config.json, generation_config.json and tokenizer.json, read with the
`tokenizers` library: no weights are loaded and torch is never imported.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

from services.worker.engine.config import EngineConfig
from shared.wire.errors import ModelLoadError
from shared.text.tokenization import model_info

_MIN_WORDS = 64  # fewer plain-word tokens than this: the tokenizer is unusual, emit any non-special id


@dataclass(frozen=True)
class SimTiming:
    """Modelled time of one engine step (seconds): a fixed overhead, plus prefill per uncached prompt token
    computed, plus decode per sequence and per KV token it attends over; all divided by speedup."""

    step_overhead_s: float
    prefill_s_per_token: float
    decode_s_per_seq: float
    decode_s_per_kv_token: float
    speedup: float = 1.0

    def step_time(self, prefill_tokens: int, decode_seqs: int, kv_tokens: int) -> float:
        t = (
            self.step_overhead_s
            + self.prefill_s_per_token * prefill_tokens
            + self.decode_s_per_seq * decode_seqs
            + self.decode_s_per_kv_token * kv_tokens
        )
        return t / self.speedup


@dataclass(frozen=True)
class SimVocab:
    """The served model's facts the simulator needs, and the ids it emits."""

    vocab_size: int  # ids in [0, vocab_size) are valid input
    context_len: int
    eos_token_ids: frozenset[int]
    words: tuple[int, ...]  # what the simulator emits: plain words (" the", " river"), never special tokens

    def next_token(
        self, key: bytes, index: int, stop_ids: frozenset[int], may_stop: bool, eos_probability: float
    ) -> int:
        """Output token `index` of the sequence keyed by (prompt, seed): the same whatever the batch, the
        worker or the step it is computed on. A stop id is never chosen before may_stop (min_tokens)."""
        pick, draw = _hash(key, index)
        eos = sorted(stop_ids & self.eos_token_ids)  # empty with ignore_eos
        if may_stop and eos and draw < eos_probability:
            return eos[0]
        for token in self._words_from(pick, stop_ids, may_stop, 1):
            return token
        raise ModelLoadError("every word the simulator can emit is a stop token")

    def _words_from(self, pick: int, stop_ids: frozenset[int], may_stop: bool, n: int) -> list[int]:
        """The first n words next_token would try, in its order (stop ids skipped while they may not end it)."""
        out = []
        for i in range(len(self.words)):
            token = self.words[(pick + i) % len(self.words)]
            if may_stop or token not in stop_ids:
                out.append(token)
                if len(out) == n:
                    break
        return out

    def logprobs(
        self,
        key: bytes,
        index: int,
        token: int,
        stop_ids: frozenset[int],
        may_stop: bool,
        eos_probability: float,
        k: int,
    ) -> tuple[float, tuple[int, ...], tuple[float, ...]]:
        """Synthetic log probabilities of output `index` (no model computes them): the simulator's stand-in
        distribution gives EOS eos_probability where EOS may end the output, and the words next_token tries,
        in its order, (1 - that) times 1/2, 1/4, 1/8, ... (the first is what it emits unless it emits EOS).
        -> (log probability of `token`, the k most likely ids, their log probabilities)."""
        pick, _ = _hash(key, index)
        eos = sorted(stop_ids & self.eos_token_ids)
        e = eos_probability if may_stop and eos else 0.0
        words = self._words_from(pick, stop_ids, may_stop, k + 1)
        dist = [(t, (1.0 - e) * 0.5 ** (j + 1)) for j, t in enumerate(words)]
        if e > 0.0:
            dist.append((eos[0], e))
        dist.sort(key=lambda tp: -tp[1])
        probs = dict(dist)
        top = dist[:k]
        return _log(probs.get(token, 0.0)), tuple(t for t, _ in top), tuple(_log(p) for _, p in top)

    def prompt_logprob(self, before: int, position: int, token: int, k: int) -> tuple[float, tuple, tuple, int]:
        """Synthetic log probability of prompt token `token` at `position` after token `before`: the stand-in
        distribution gives the words next_token would try after that pair 1/2, 1/4, ... and every other token
        2^-(k + 2) at rank k + 2. -> (its log probability, the k most likely ids, their log probabilities, its rank)."""
        pick, _ = _hash(before.to_bytes(8, "little"), position)
        words = self._words_from(pick, frozenset(), True, k + 1)
        rank = words.index(token) + 1 if token in words else k + 2
        return math.log(0.5**rank), tuple(words[:k]), tuple(math.log(0.5 ** (j + 1)) for j in range(k)), rank


def _hash(key: bytes, index: int) -> tuple[int, float]:
    """(which word, a uniform draw) for output `index` of the sequence keyed by key."""
    h = hashlib.blake2b(key + index.to_bytes(8, "little"), digest_size=16).digest()
    return int.from_bytes(h[:8], "little"), int.from_bytes(h[8:], "little") / 2.0**64


def _log(p: float) -> float:
    return math.log(p) if p > 0.0 else float("-inf")


def sequence_key(prompt: list[int], seed: int) -> bytes:
    """What a simulated sequence's tokens are a function of: its prompt and its seed."""
    h = hashlib.blake2b(b"conveyor-sim", digest_size=16)
    h.update(seed.to_bytes(16, "little", signed=True))
    h.update(b",".join(str(t).encode() for t in prompt))
    return h.digest()


def _config(model_dir: Path) -> dict:
    try:
        return json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {model_dir / 'config.json'}: {e}") from e


def load_vocab(model_dir: Path) -> SimVocab:
    from tokenizers import Tokenizer  # the Rust tokenizer alone: no transformers, no torch

    path = Path(model_dir) / "tokenizer.json"
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises its own exception types for a bad file
        raise ModelLoadError(f"the simulated engine needs {path}: {e}") from e
    info = model_info(Path(model_dir))
    vocab_size = info.vocab_size or tok.get_vocab_size()
    special = set(tok.get_added_tokens_decoder()) | set(info.eos_token_ids)
    ids = [i for i in range(min(vocab_size, tok.get_vocab_size())) if i not in special]
    texts = tok.decode_batch([[i] for i in ids])
    words = [i for i, s in zip(ids, texts) if len(s) >= 3 and s[0] == " " and s[1:].isascii() and s[1:].isalpha()]
    return SimVocab(
        vocab_size, info.max_len, frozenset(info.eos_token_ids), tuple(words if len(words) >= _MIN_WORDS else ids)
    )


def kv_pool_blocks(model_dir: Path, config: EngineConfig) -> int:
    """As many KV blocks as the torch engine would have on CPU with the same byte budget (float32 unless
    dtype says otherwise), so preemption and prefix-cache eviction happen where they would for real."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    cfg = _config(Path(model_dir))
    cfg = cfg.get("text_config", cfg)
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    itemsize = 2 if config.dtype in ("bfloat16", "float16") else 4
    per_block = 2 * cfg["num_hidden_layers"] * config.block_size * kv_heads * head_dim * itemsize
    return max(1, config.kv_cache_bytes // per_block)
