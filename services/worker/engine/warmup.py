"""Warm-up: every step shape a first round of traffic meets, run once before the worker takes work.

The first call of a shape pays one-off costs the later ones do not: oneDNN creates (and caches) a primitive per
GEMM shape, the allocator grows its pools, the C++ kernels and the sampler touch their buffers for a new batch
size. A worker that warmed up on one tiny request paid them on its first clients instead (the first round after
/ready ran slower than the later ones: docs/benchmarks.md, issue 29). So the warm-up runs, on the real engine
path (scheduler, runner, sampler), one step of each shape bucket:

  prefill  one prompt of each power-of-two size from a block to the step budget (max_num_batched_tokens), the
           budget itself, and a prompt of twice the budget: its second chunk continues a computed context, the
           runner's other prefill group
  decode   max_num_seqs one-block prompts decoding together, then halving (64, 32, ..., 1): each batch size of
           the GEMM plans' power-of-two buckets, two steps each

It is bounded in time (`budget_s`: what is left when the time is up is skipped, logged; the smallest prefill
runs whatever the budget, so budget 0 is the one-request warm-up of old), uses prompts of random
token ids no client sends (so its blocks, left evictable in the prefix cache, are never a false hit), and leaves
the engine as it found it: nothing running, nothing waiting, every block free or evictable. Its products that
outlive the process (the GEMM plans, the kernel build) are cached on disk by those who make them (gemm.py,
cpu_ops.py); what it warms here lives in the process and is redone at each start, in a few seconds.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field

from services.worker.engine.request import EngineRequest, SamplingOptions

logger = logging.getLogger(__name__)

_PREFIX = "warmup-"


@dataclass
class WarmUpReport:
    prefill_sizes: list[int] = field(default_factory=list)  # prompt tokens of the prefills run
    decode_batches: list[int] = field(default_factory=list)  # batch sizes decoded
    skipped: list[str] = field(default_factory=list)  # shapes left out when the time was up
    seconds: float = 0.0


def powers_of_two(lo: int, hi: int) -> list[int]:
    """lo, 2 lo, 4 lo, ... up to hi, and hi itself."""
    out, n = [], lo
    while n < hi:
        out.append(n)
        n *= 2
    return out + [hi]


def plan(config, max_len: int) -> tuple[list[int], list[int]]:
    """-> (prefill prompt sizes, decode batch sizes) the engine's config makes a first round meet."""
    bs, budget = config.block_size, config.max_num_batched_tokens
    prefill = [n for n in powers_of_two(bs, budget) if n < max_len]
    if 2 * budget < max_len:
        prefill.append(2 * budget)  # its second chunk attends to the first: a continued prefill
    decode = sorted(set(powers_of_two(1, config.max_num_seqs)), reverse=True)
    return prefill, decode


class WarmUp:
    def __init__(self, engine, budget_s: float, seed: int = 0):
        self.engine = engine
        self.deadline = time.monotonic() + budget_s
        self.rng = random.Random(seed)
        self.count = 0

    def _prompt(self, n: int) -> list[int]:
        hi = self.engine.vocab_size - 1
        return [self.rng.randrange(1, hi) for _ in range(n)]

    def _add(self, n: int, max_tokens: int) -> str:
        rid = f"{_PREFIX}{self.count}"
        self.count += 1
        sampling = SamplingOptions(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        self.engine.add_request(EngineRequest(request_id=rid, prompt_token_ids=self._prompt(n), sampling=sampling))
        return rid

    def out_of_time(self) -> bool:
        return time.monotonic() >= self.deadline

    def run(self) -> WarmUpReport:
        t0 = time.monotonic()
        report = WarmUpReport()
        prefill, decode = plan(self.engine.config, self.engine.max_len)
        try:
            self._prefills(prefill, report)
            self._decodes(decode, report)
        finally:
            self._clear()
        report.seconds = time.monotonic() - t0
        return report

    def _prefills(self, sizes: list[int], report: WarmUpReport) -> None:
        for n in sizes:
            if report.prefill_sizes and self.out_of_time():  # the smallest always runs: the first forward's costs
                report.skipped.append(f"prefill {n}")
                continue
            self._add(n, max_tokens=1)
            while self.engine.has_unfinished():
                self.engine.step()
            report.prefill_sizes.append(n)

    def _decodes(self, batches: list[int], report: WarmUpReport) -> None:
        if not batches or self.out_of_time():
            report.skipped += [f"decode {b}" for b in batches]
            return
        bs = self.engine.config.block_size
        running = [self._add(bs - 2, max_tokens=2 * len(batches) + 2) for _ in range(batches[0])]
        sched = self.engine.scheduler
        while sched.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in sched.running):
            self.engine.step()  # the prompts, in chunks of the step budget
        for b in batches:
            if self.out_of_time():
                report.skipped.append(f"decode {b}")
                continue
            for rid in running[b:]:
                self.engine.abort_request(rid)
            running = running[:b]
            for _ in range(2):
                self.engine.step()
            report.decode_batches.append(b)

    def _clear(self) -> None:
        """Abort what is left (aborted requests get no output), so the engine is as before."""
        for seq in list(self.engine.scheduler.running) + list(self.engine.scheduler.waiting):
            self.engine.abort_request(seq.request_id)
        while self.engine.has_unfinished():
            self.engine.step()


def warm_up(engine, budget_s: float) -> WarmUpReport:
    report = WarmUp(engine, budget_s).run()
    logger.info(
        "warm-up in %.1f s: prefills of %s tokens, decode batches %s%s",
        report.seconds,
        report.prefill_sizes,
        report.decode_batches,
        f"; skipped (out of time): {', '.join(report.skipped)}" if report.skipped else "",
    )
    return report
