"""The torch model runner: a scheduled step becomes one packed forward pass of a transformers causal LM,
and its logits are sampled (sampler.py).

Packed layout of a step (T tokens, one [1, T] batch):
  rows [0, Nd)   one token per decode-format sequence (a decode, or a 1-token prefill chunk)
  rows [Nd, T)   prefill chunks, one sequence after another
Every index tensor is built once per step here and shared by all layers.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from services.worker.engine.model.attention import AttnGroup, PagedAttentionMetadata
from services.worker.engine.config import EngineConfig
from services.worker.engine.cpu import cpu_ops
from services.worker.engine.model import huge_pages
from services.worker.engine.model.fused_llama import FusedLlama
from services.worker.engine.cpu.gemm import plain_linears, tune_linears, unmeasured_plans
from services.worker.engine.kv.kv_cache import PagedKVCache
from services.worker.engine.model.loader import install_paged_attention, kv_pool_blocks
from services.worker.engine.outputs import TokenLogprobs
from services.worker.engine.sampling.prompt_logprobs import PromptJob, prompt_jobs
from services.worker.engine.request import Sequence
from services.worker.engine.sampling.sampler import generator_seed, prompt_logprobs, sample

logger = logging.getLogger(__name__)


@dataclass
class PreparedStep:
    input_ids: torch.Tensor  # [1, T]
    positions: torch.Tensor  # [1, T]
    logits_rows: torch.Tensor  # [N] packed rows whose next-token logits are needed
    sample_seqs: list[Sequence]  # the sequences of logits_rows' first rows, in order
    meta: PagedAttentionMetadata
    prompt_jobs: list[PromptJob] = field(default_factory=list)  # prompt log probabilities this step owes
    prompt_logprobs: list[list[TokenLogprobs]] = field(default_factory=list)  # forward's, one list per job
    # sequences with drafts (spec.py): their 1 + len(draft) rows each follow the sampled rows in logits_rows
    drafted: list[Sequence] = field(default_factory=list)


class ModelRunner:
    verifies_drafts = True  # computes every row of a drafted sequence (spec.py)

    def __init__(
        self,
        model,
        kv_cache: PagedKVCache,
        device: torch.device,
        fused: FusedLlama | None = None,
        decode_kernel: bool = False,
        prefill_kernel: bool = False,
    ):
        """fused: the engine's own forward for this model (else transformers' modules); decode_kernel: decode
        attention through the CPU kernel (cpu_ops.py) instead of gather + SDPA; prefill_kernel: prefill chunks'
        attention through the CPU kernel instead of torch's flash kernel."""
        self.model = model
        self.fused = fused
        self.decode_kernel = decode_kernel
        self.prefill_kernel = prefill_kernel
        self.kv_cache = kv_cache
        self.device = device
        self.block_size = kv_cache.block_size
        self.q_per_kv = model.config.num_attention_heads // kv_cache.num_kv_heads
        self.num_blocks = kv_cache.num_blocks
        self._arange = torch.arange(0, dtype=torch.long, device=device)  # grown on demand

    @classmethod
    def for_model(cls, model, config: EngineConfig) -> ModelRunner:
        """Switch the model's attention to paged, fuse its forward where supported, tune its GEMMs (CPU),
        build the CPU kernels, and size and allocate its KV pool."""
        install_paged_attention(model)
        device = next(model.parameters()).device
        fused = FusedLlama.build(model) if config.fused_model else None
        kernel = config.cpu_kernels and device.type == "cpu"
        kernel = kernel and cpu_ops.load(config.tuning_cache_dir, config.cpu_isa)
        gemv = bool(kernel and config.gemv_kernel and cpu_ops.vector_path())
        layers = (fused.linears() if fused else plain_linears(model)) if device.type == "cpu" else []
        if config.gemm_tuning and layers:
            head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
            tune_linears(
                layers, head, config.max_num_batched_tokens, config.max_num_seqs, config.tuning_cache_dir, gemv
            )
        elif gemv and layers:
            unmeasured_plans(layers)
        native = bool(kernel and fused and fused.use_native_ops(config.layer_stack, config.decode_split_rows))
        prefill = bool(kernel and cpu_ops.prefill_kernel_pays())
        num_blocks = kv_pool_blocks(config, model, device)
        with torch.inference_mode():
            kv_cache = PagedKVCache(model.config, num_blocks, config.block_size, model.dtype, device)
        if config.huge_pages and device.type == "cpu":
            huge_pages.advise()  # the weights, their packed copies and the pool, all allocated by now
        logger.info(
            "torch runner on %s (%s): %d KV blocks, %s forward, decode attention by %s, prefill attention by %s",
            device,
            model.dtype,
            num_blocks,
            (("fused, C++ layer ops" + (", layers in one call" if fused.stacked else "")) if native else "fused")
            if fused
            else "transformers",
            f"CPU kernel ({cpu_ops.active_isa()})" if kernel else "gather + SDPA",
            f"CPU kernel ({cpu_ops.active_isa()})" if prefill else "torch",
        )
        return cls(model, kv_cache, device, fused, kernel, prefill)

    def init_sequence(self, seq: Sequence) -> None:
        """A sampled (non-greedy) request draws from its own generator: same seed, same tokens, whatever
        the batch."""
        if seq.sampling.greedy:
            return
        gen = torch.Generator(device=self.device)
        if seq.sampling.seed is None:
            gen.seed()
        else:
            gen.manual_seed(generator_seed(seq.sampling.seed))
        seq.generator = gen

    def sample(
        self, logits: torch.Tensor, seqs: list[Sequence], allowed=None
    ) -> tuple[list[int], list[TokenLogprobs | None] | None]:
        return sample(logits, seqs, native=self.decode_kernel, allowed=allowed)

    @property
    def block_bytes(self) -> int:
        return self.kv_cache.block_bytes

    def read_blocks(self, block_ids: list[int]) -> np.ndarray:
        """K and V of the blocks, all layers, as one uint8 CPU array (PagedKVCache.read_blocks)."""
        return self.kv_cache.read_blocks(block_ids)

    def read_slabs(self, block_ids: list[int]):
        """read_blocks' payload in slabs from one reused buffer (PagedKVCache.read_slabs)."""
        return self.kv_cache.read_slabs(block_ids)

    def write_blocks(self, block_ids: list[int], payload) -> None:
        """read_blocks' payload back into these blocks; ValueError if it is not len(block_ids) blocks."""
        self.kv_cache.write_blocks(block_ids, payload)

    def is_out_of_memory(self, error: BaseException) -> bool:
        return isinstance(error, torch.OutOfMemoryError)

    def free_memory(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _iota(self, n: int) -> torch.Tensor:
        if self._arange.numel() < n:
            self._arange = torch.arange(max(n, 2 * self._arange.numel()), dtype=torch.long, device=self.device)
        return self._arange[:n]

    def _block_tables(self, rows: list[list[int]]) -> torch.Tensor:
        width = max(len(r) for r in rows)
        return torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.long, device=self.device)

    def _decode_group(self, items: list[tuple[Sequence, int]]) -> tuple[AttnGroup, list[int], list[int], list[int]]:
        bs = self.block_size
        tokens, positions, slots, tables = [], [], [], []
        for seq, _ in items:
            pos = seq.num_computed_tokens
            tokens.append(seq.token_ids[pos])
            positions.append(pos)
            slots.append(seq.block_table[pos // bs] * bs + pos % bs)
            tables.append(seq.block_table[: pos // bs + 1])
        bt = self._block_tables(tables)
        pos_t = torch.tensor(positions, dtype=torch.long, device=self.device)
        if self.decode_kernel:
            return AttnGroup(bt, None, pos_t[:, None], context_lens=pos_t + 1), tokens, positions, slots
        return AttnGroup(bt, None, pos_t[:, None], num_keys=bt.shape[1] * bs), tokens, positions, slots

    def _prefill_group(self, items: list[tuple[Sequence, int]]) -> tuple[AttnGroup, list[int], list[int], list[int]]:
        bs, dev = self.block_size, self.device
        tokens, positions, slots, tables, starts, lens = [], [], [], [], [], []
        for seq, n in items:
            start = seq.num_computed_tokens
            tokens.extend(seq.tokens_at(start, n))
            positions.extend(range(start, start + n))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            tables.append(table[: (start + n - 1) // bs + 1])
            starts.append(start)
            lens.append(n)
        bt = self._block_tables(tables)
        lens_t = torch.tensor(lens, dtype=torch.long, device=dev)
        starts_t = torch.tensor(starts, dtype=torch.long, device=dev)
        group = AttnGroup(
            bt,
            None,
            None,
            causal=not any(starts),  # no chunk has cached context: attention within each chunk (attention.py)
            num_rows=len(tokens),
            starts=tuple(starts),
            lens=tuple(lens),
            num_keys=bt.shape[1] * bs,
        )
        if self.prefill_kernel:  # the kernel reads (start, len) per sequence: no padded rows, no mask
            group.spans = torch.stack((starts_t, lens_t), 1)
        else:
            group.row_pos, group.q_index, group.out_index = self._padded_rows(starts_t, lens_t, max(lens))
        return group, tokens, positions, slots

    def _padded_rows(self, starts_t: torch.Tensor, lens_t: torch.Tensor, longest: int) -> tuple[torch.Tensor, ...]:
        """torch's prefill paths attend [S, Q] padded rows: each row's position (G-major like the regrouped
        queries), the packed row each padded one reads, the padded rows that are real tokens."""
        offsets = torch.cumsum(lens_t, 0) - lens_t  # first packed row of each chunk (within the group)
        j = self._iota(longest)[None, :]  # [1, Q]
        valid = j < lens_t[:, None]  # [S, Q]
        q_index = torch.where(valid, offsets[:, None] + j, offsets[:, None])  # pads repeat a real row
        q_pos = torch.where(valid, starts_t[:, None] + j, 0)  # pad rows see key 0 only (never all-masked)
        rows_pos = q_pos.repeat(1, self.q_per_kv)  # [S, G*Q]
        return rows_pos, q_index, valid.reshape(-1).nonzero().squeeze(1)

    def prepare(self, items: list[tuple[Sequence, int]]) -> PreparedStep:
        """items: (sequence, number of tokens to compute from its num_computed_tokens)."""
        decode = [it for it in items if it[1] == 1]
        fresh = [it for it in items if it[1] > 1 and it[0].num_computed_tokens == 0]  # no cached context
        resumed = [it for it in items if it[1] > 1 and it[0].num_computed_tokens > 0]
        tokens, positions, slots = [], [], []
        groups: list[AttnGroup | None] = []
        for part, build in ((decode, self._decode_group), (fresh, self._prefill_group), (resumed, self._prefill_group)):
            if not part:
                groups.append(None)
                continue
            group, t, p, s = build(part)
            groups.append(group)
            tokens += t
            positions += p
            slots += s
        rows, sample_seqs, drafted, draft_rows, row = [], [], [], [], 0
        for seq, n in decode + fresh + resumed:  # the packing order of the groups above
            row += n
            if seq.draft:  # its token and its drafts: every row's logits, after the sampled rows' (spec.py)
                drafted.append(seq)
                draft_rows.extend(range(row - n, row))
            elif seq.num_computed_tokens + n == seq.num_tokens:  # computes the last token: sample
                rows.append(row - 1)
                sample_seqs.append(seq)
        dev = self.device
        meta = PagedAttentionMetadata(
            self.kv_cache,
            torch.tensor(slots, dtype=torch.long, device=dev),
            len(decode),
            groups[0],
            tuple(g for g in groups[1:] if g is not None),
        )
        return PreparedStep(
            torch.tensor([tokens], dtype=torch.long, device=dev),
            torch.tensor([positions], dtype=torch.long, device=dev),
            torch.tensor(rows + draft_rows, dtype=torch.long, device=dev),
            sample_seqs,
            meta,
            prompt_jobs(decode + fresh + resumed),
            drafted=drafted,
        )

    @torch.inference_mode()
    def forward(self, step: PreparedStep) -> tuple[torch.Tensor, float]:
        """-> (logits [N, V] for step.sample_seqs, seconds spent in the model call)."""
        t0 = time.perf_counter()
        if step.prompt_jobs:
            logits = self._forward_with_prompt(step)
        elif self.fused is not None:
            logits = self.fused.forward(step.input_ids[0], step.positions[0], step.meta, step.logits_rows)
        else:
            logits = self._model_logits(step, step.logits_rows)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # so the measured time is the device's, not the launch's
        return logits, time.perf_counter() - t0

    def _model_logits(self, step: PreparedStep, rows: torch.Tensor) -> torch.Tensor:
        return self.model(
            input_ids=step.input_ids,
            position_ids=step.positions,
            logits_to_keep=rows,
            use_cache=False,
            conveyor_attn=step.meta,
        ).logits[0]

    def _forward_with_prompt(self, step: PreparedStep) -> torch.Tensor:
        """A step owing prompt log probabilities: the sampled rows' logits, and step.prompt_logprobs filled. The fused
        forward hands out the prompt rows' hidden states and the LM head runs over them a slice at a time;
        transformers' own forward (whose head may do more than a linear layer) gives all their logits at once."""
        n = step.logits_rows.numel()
        rows = [r for job in step.prompt_jobs for r in job.rows]
        every = torch.cat([step.logits_rows, torch.tensor(rows, dtype=torch.long, device=self.device)])
        if self.fused is not None:
            h = self.fused.hidden(step.input_ids[0], step.positions[0], step.meta, every)
            head = self.fused.lm_head
            step.prompt_logprobs = prompt_logprobs(lambda a, b: head(h[n + a : n + b]), step.prompt_jobs)
            return head(h[:n])
        logits = self._model_logits(step, every)
        step.prompt_logprobs = prompt_logprobs(lambda a, b: logits[n + a : n + b], step.prompt_jobs)
        return logits[:n]
