"""The simulated model runner: the real engine (scheduler, paged block manager, prefix cache) with a
modelled step time instead of a forward pass, and deterministic tokens instead of sampled ones.

A step sleeps SimTiming.step_time(uncached prompt tokens computed, decoding sequences, KV tokens they
attend over); what a step computes is decided by the engine's own scheduler, so chunked prefill,
prefix-cache hits, preemption and batching shape the timing exactly as they shape the real engine's.
Its tokens are plain words of the served tokenizer, a function of (prompt, seed, output index), so the
gateway's detokenizer and stop strings see ordinary text, and a request resumed on another worker
continues the same sequence.

It holds no K/V: read_blocks hands out SIM_BLOCK_BYTES zero bytes per block and write_blocks only checks the
size, so a simulated swap to the disk tier (kv_tier.py) runs the tier's whole code path (files, checksums, the
byte bound) at a small cost per block, and moves no real KV.
"""

from __future__ import annotations

import logging
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, TextIO

import numpy as np

from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import LLMEngine
from services.worker.engine.outputs import TokenLogprobs
from services.worker.engine.sampling.prompt_logprobs import PromptJob, prompt_jobs
from services.worker.engine.request import Sequence, SequenceStatus
from services.worker.engine.sim.sim_model import SimTiming, SimVocab, kv_pool_blocks, load_vocab, sequence_key
from services.worker.engine.sampling.structured import StructuredOutputs

logger = logging.getLogger(__name__)

# A step log line: wall time at the step's end (epoch s), modelled seconds, uncached prompt tokens computed,
# decoding sequences, KV tokens they attend over, sequences that got a token.
# Bytes per block of a simulated swap's payload: small, so the disk tier's bound counts entries rather than the real
# model's KV size (the simulator has none to move).
SIM_BLOCK_BYTES = 64

STEP_LOG_COLUMNS = ("t_end", "modelled_s", "prefill_tokens", "decode_seqs", "kv_tokens", "sampled")


@dataclass
class SimStep:
    """A prepared simulated step: what its time is made of, and who gets a token."""

    sample_seqs: list[Sequence] = field(default_factory=list)
    drafted: list[Sequence] = field(default_factory=list)  # always empty: the simulator checks no drafts (spec.py)
    prefill_tokens: int = 0
    decode_seqs: int = 0
    kv_tokens: int = 0
    prompt_jobs: list[PromptJob] = field(default_factory=list)  # prompt log probabilities this step owes
    prompt_logprobs: list[list[TokenLogprobs]] = field(default_factory=list)  # forward's, one list per job


class SimRunner:
    verifies_drafts = False  # its tokens are a function of the output index, not of logits rows: no drafts

    def __init__(
        self,
        timing: SimTiming,
        vocab: SimVocab,
        num_blocks: int,
        eos_probability: float = 0.0,
        sleep: Callable[[float], None] = time.sleep,
        step_log: TextIO | None = None,
    ):
        self.timing = timing
        self.vocab = vocab
        self.num_blocks = num_blocks
        self.eos_probability = eos_probability  # chance per token of ending with EOS, when EOS may end it
        self._sleep = sleep
        self.step_log = step_log  # one line per step (STEP_LOG_COLUMNS), for benchmarks; None = off

    def init_sequence(self, seq: Sequence) -> None:
        # Greedy ignores the seed, as the real sampler does; a sampled request without one gets a random one.
        opts = seq.sampling
        seed = 0 if opts.greedy else (opts.seed if opts.seed is not None else random.getrandbits(63))
        seq.generator = sequence_key(seq.token_ids[: seq.num_prompt_tokens], seed)

    def prepare(self, items: list[tuple[Sequence, int]]) -> SimStep:
        step = SimStep()
        for seq, n in items:
            if n == 1 and seq.status == SequenceStatus.DECODING:
                step.decode_seqs += 1
                step.kv_tokens += seq.num_computed_tokens + 1
            else:  # a prefill chunk: prompt (or recomputed) tokens not served by the prefix cache
                step.prefill_tokens += n
            if seq.num_computed_tokens + n == seq.num_tokens:
                step.sample_seqs.append(seq)
        step.prompt_jobs = prompt_jobs(items)
        return step

    def forward(self, step: SimStep) -> tuple[list[None], float]:
        """Sleeps the modelled time; -> (a placeholder row per sampled sequence, the modelled time)."""
        modelled = self.timing.step_time(step.prefill_tokens, step.decode_seqs, step.kv_tokens)
        self._sleep(modelled)
        if self.step_log is not None:
            self.step_log.write(
                f"{time.time():.6f} {modelled:.6f} {step.prefill_tokens} {step.decode_seqs} "
                f"{step.kv_tokens} {len(step.sample_seqs)}\n"
            )
        step.prompt_logprobs = [self._prompt_logprobs(job) for job in step.prompt_jobs]
        return [None] * len(step.sample_seqs), modelled

    def _prompt_logprobs(self, job: PromptJob) -> list[TokenLogprobs]:
        """Synthetic ones (SimVocab.prompt_logprob): a function of each prompt token and the one before it."""
        tokens, k = job.seq.token_ids, job.seq.sampling.prompt_logprobs
        return [
            TokenLogprobs(*self.vocab.prompt_logprob(tokens[p - 1], p, tokens[p], k))
            for p in range(job.first, job.first + len(job.targets))
        ]

    def sample(
        self, rows: list[None], seqs: list[Sequence], allowed: np.ndarray | None = None
    ) -> tuple[list[int], list[TokenLogprobs | None] | None]:
        """Each sequence's next word (a constrained one keeps to its grammar: _constrained); where a request asks
        for log probabilities, synthetic ones of the simulator's stand-in distribution (SimVocab.logprobs).
        Penalties, temperature and the top-k/top-p/min-p filters do not change what the simulator emits (seeds
        and min_tokens do)."""
        tokens = []
        for i, seq in enumerate(seqs):
            token = self.vocab.next_token(
                seq.generator,
                seq.num_outputs,
                seq.stop_ids,
                seq.num_outputs >= seq.sampling.min_tokens,
                self.eos_probability,
            )
            if allowed is not None and seq.grammar is not None:
                token = self._constrained(token, allowed[i], seq)
            tokens.append(token)
        if all(seq.sampling.logprobs is None for seq in seqs):
            return tokens, None
        return tokens, [
            None
            if seq.sampling.logprobs is None
            else TokenLogprobs(
                *self.vocab.logprobs(
                    seq.generator,
                    seq.num_outputs,
                    token,
                    seq.stop_ids,
                    seq.num_outputs >= seq.sampling.min_tokens,
                    self.eos_probability,
                    seq.sampling.logprobs,
                )
            )
            for seq, token in zip(seqs, tokens)
        ]

    def _constrained(self, token: int, row: np.ndarray, seq: Sequence) -> int:
        """A constrained sequence keeps to its grammar: EOS as soon as the grammar may end, else the word it would
        have emitted if allowed, else an allowed token picked by (prompt, seed, index). Such a walk closes its
        JSON only by chance: most constrained sim outputs end with "length"."""
        eos = [t for t in sorted(seq.stop_ids) if t < row.size * 32 and _bit(row, t)]
        if eos:
            return eos[0]
        if _bit(row, token):
            return token
        ids = np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))
        return int(ids[(int.from_bytes(seq.generator[:8], "little") + seq.num_outputs) % len(ids)])

    block_bytes = SIM_BLOCK_BYTES

    def read_blocks(self, block_ids: list[int]) -> np.ndarray:
        """Zeros, SIM_BLOCK_BYTES per block: there is no K/V to read."""
        self._check_ids(block_ids)
        return np.zeros(len(block_ids) * SIM_BLOCK_BYTES, dtype=np.uint8)

    def read_slabs(self, block_ids: list[int]) -> list[memoryview]:
        """read_blocks' zeros as one slab."""
        return [memoryview(self.read_blocks(block_ids))]

    def write_blocks(self, block_ids: list[int], payload) -> None:
        """Checks what the torch runner checks (the size, the ids) and stores nothing."""
        self._check_ids(block_ids)
        if len(set(block_ids)) != len(block_ids):
            raise ValueError("write_blocks: a block id appears twice")
        size = memoryview(payload).nbytes
        if size != len(block_ids) * SIM_BLOCK_BYTES:
            raise ValueError(f"payload of {size} bytes for {len(block_ids)} blocks of {SIM_BLOCK_BYTES} bytes each")

    def _check_ids(self, block_ids: list[int]) -> None:
        bad = [b for b in block_ids if not 0 <= b < self.num_blocks]
        if bad:
            raise ValueError(f"block ids outside [0, {self.num_blocks}): {bad[:20]}")

    def is_out_of_memory(self, error: BaseException) -> bool:
        return False  # nothing is allocated: a simulated step never runs out of memory

    def free_memory(self) -> None:
        return None


def _bit(row: np.ndarray, token: int) -> bool:
    return bool((int(row[token // 32]) >> (token % 32)) & 1)


def open_step_log(folder: str) -> TextIO | None:
    """The step log of this process in `folder` (sim-steps-PID.log), line-buffered so a killed worker loses at
    most the line being written; None when folder is empty."""
    if not folder:
        return None
    Path(folder).mkdir(parents=True, exist_ok=True)
    return open(Path(folder) / f"sim-steps-{os.getpid()}.log", "a", buffering=1)


def build_sim_engine(
    model_dir: Path | str, config: EngineConfig, timing: SimTiming, eos_probability: float = 0.0, step_log_dir: str = ""
) -> LLMEngine:
    """An LLMEngine whose steps are simulated: reads the model folder's config and tokenizer, no weights."""
    vocab = load_vocab(Path(model_dir))
    runner = SimRunner(
        timing, vocab, kv_pool_blocks(Path(model_dir), config), eos_probability, step_log=open_step_log(step_log_dir)
    )
    logger.info(
        "simulated runner: %s, %d words to emit, EOS probability %.3f", timing, len(vocab.words), eos_probability
    )
    structured = StructuredOutputs(Path(model_dir) / "tokenizer.json", vocab.vocab_size, vocab.eos_token_ids)
    return LLMEngine(runner, config, vocab.eos_token_ids, vocab.vocab_size, vocab.context_len, structured)
