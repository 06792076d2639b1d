"""The engine's own forward pass for Llama-family decoders (llama, mistral, qwen2), over the weights of
the loaded transformers model.

Why not transformers' modules: at the step shapes of a serving batch (tens of rows) the model is many
small products, and each module call, view, transpose and mask costs time the product does not. Here
a layer is four GEMMs (q/k/v fused into one, gate/up fused into one, o, down), rotary applied to q and
k together with cos/sin computed once per step, and the engine's paged attention; the last layer past
its attention, the final norm and the LM head run on the sampled rows only. The arithmetic is transformers' own (same RMSNorm and rotary
formulas, same order of residual adds), so greedy outputs stay those of transformers.

With the CPU kernels loaded, the small ops run in csrc/layer_ops.cpp, and a step's whole layer loop in one call
(csrc/layer_stack.cpp, the same functions in the same order): at one sequence the Python between the kernels cost
~4 of a ~26 ms step.

The fused weights are new tensors; the transformers projections are re-pointed at views of them, so
memory is not doubled and the module forward (fused_model=False) still works on the same weights.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.engine.cpu import cpu_ops
from services.worker.engine.model.attention import PagedAttentionMetadata, paged_attention
from services.worker.engine.cpu.gemm import KERNEL_CODES

logger = logging.getLogger(__name__)

SUPPORTED_TYPES = ("llama", "mistral", "qwen2")


def _fuse(parts: list[nn.Linear]) -> nn.Linear:
    """One Linear computing the outputs of `parts` side by side; the parts become views of it."""
    w = torch.cat([p.weight.detach() for p in parts])
    has_bias = [p.bias is not None for p in parts]
    # Made on the meta device: its weight and bias are replaced just below, and a real one would first fill itself
    # with random values (kaiming init: 8 % of the engine tests' time, 88 engines built).
    fused = nn.Linear(w.shape[1], w.shape[0], bias=any(has_bias), device="meta", dtype=w.dtype)
    fused.weight = nn.Parameter(w, requires_grad=False)
    if any(has_bias):
        fused.bias = nn.Parameter(
            torch.cat(
                [
                    p.bias.detach()
                    if p.bias is not None
                    else torch.zeros(p.out_features, dtype=w.dtype, device=w.device)
                    for p in parts
                ]
            ),
            requires_grad=False,
        )
    row = 0
    for p in parts:
        p.weight = nn.Parameter(fused.weight[row : row + p.out_features], requires_grad=False)
        if p.bias is not None:
            p.bias = nn.Parameter(fused.bias[row : row + p.out_features], requires_grad=False)
        row += p.out_features
    return fused


@dataclass
class FusedLayer:
    index: int
    qkv: nn.Linear
    o: nn.Linear
    gate_up: nn.Linear
    down: nn.Linear
    norm1: tuple[torch.Tensor, float]
    norm2: tuple[torch.Tensor, float]
    window: int | None


def _norm(module) -> tuple[torch.Tensor, float]:
    return module.weight, module.variance_epsilon


def _window(attn, cfg) -> int | None:
    """The layer's sliding window: Qwen2 keeps it per layer (None on full-attention layers), Mistral in its config."""
    if hasattr(attn, "sliding_window"):
        return attn.sliding_window
    return getattr(cfg, "sliding_window", None)


def rms_norm(x: torch.Tensor, norm: tuple[torch.Tensor, float]) -> torch.Tensor:
    """transformers' LlamaRMSNorm, op for op (float32 statistics, weight applied in the input dtype)."""
    weight, eps = norm
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def unsupported_reason(model) -> str | None:
    """Why the fused forward cannot run this model (None: it can)."""
    cfg = model.config
    if cfg.model_type not in SUPPORTED_TYPES:
        return f"model_type {cfg.model_type!r} is not one of {SUPPORTED_TYPES}"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r} (only silu)"
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "rotary_emb") or not hasattr(model, "lm_head"):
        return "not a transformers *ForCausalLM with model.rotary_emb and lm_head"
    for layer in inner.layers:
        a, m = layer.self_attn, layer.mlp
        linears = (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj)
        if any(type(x) is not nn.Linear for x in linears):
            return "a projection is not a plain nn.Linear (quantized or patched)"
    return None


class FusedLlama:
    def __init__(self, model):
        inner = model.model
        cfg = model.config
        self.embed = inner.embed_tokens.weight
        self.rotary = inner.rotary_emb
        self.final_norm = _norm(inner.norm)
        self.lm_head = model.lm_head
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        self.scaling = self.head_dim**-0.5
        self.native_ops = False  # set by the runner once the CPU kernels are loaded (use_native_ops)
        self.stacked = False  # steps through csrc/layer_stack.cpp (use_native_ops)
        self.split_rows = 0  # a decode step in runs of at least this many sequences, one a thread (0: never)
        # its operands that do not change, and its kernel codes per bucket of rows: both taken at the first
        # step through it, when the GEMM plans are on the layers (gemm.tune_linears, at the engine's start)
        self._stack: tuple | None = None
        self._stack_codes: dict[int, list[int]] = {}
        self.layers = []
        for i, layer in enumerate(inner.layers):
            a, m = layer.self_attn, layer.mlp
            self.layers.append(
                FusedLayer(
                    i,
                    _fuse([a.q_proj, a.k_proj, a.v_proj]),
                    a.o_proj,
                    _fuse([m.gate_proj, m.up_proj]),
                    m.down_proj,
                    _norm(layer.input_layernorm),
                    _norm(layer.post_attention_layernorm),
                    _window(a, cfg),
                )
            )
            self.scaling = getattr(a, "scaling", self.scaling)

    @classmethod
    def build(cls, model) -> FusedLlama | None:
        reason = unsupported_reason(model)
        if reason:
            logger.info("fused forward not used (%s): transformers' module forward instead", reason)
            return None
        return cls(model)

    def use_native_ops(self, stacked: bool = True, split_rows: int = 0) -> bool:
        """Run the small per-layer ops through csrc/layer_ops.cpp (loaded by the caller); float32 on CPU only
        (other dtypes keep the torch ops). Returns whether it is on. stacked: a step's layers in one call
        (csrc/layer_stack.cpp), where every norm has one epsilon (the kernel takes one); split_rows: there, a step
        of decode rows alone in runs of at least this many sequences, each run on a thread of its own (0: never)."""
        self.native_ops = self.embed.dtype == torch.float32 and self.embed.device.type == "cpu"
        eps = {n[1] for x in self.layers for n in (x.norm1, x.norm2)}
        self.stacked = self.native_ops and stacked and len(eps) == 1
        self.split_rows = split_rows if self.stacked else 0
        return self.native_ops

    def linears(self) -> list[nn.Linear]:
        """Every Linear the fused forward calls (for GEMM tuning); the LM head is the last."""
        return [lin for x in self.layers for lin in (x.qkv, x.o, x.gate_up, x.down)] + [self.lm_head]

    def _rotate(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """transformers' apply_rotary_pos_emb on q and k heads together: qk [T, H + KVH, D], cos/sin [T, 1, D]."""
        half = qk.shape[-1] // 2
        rotated = torch.cat((-qk[..., half:], qk[..., :half]), dim=-1)
        return (qk * cos) + (rotated * sin)

    def _layer(
        self,
        x: FusedLayer,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: PagedAttentionMetadata,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One layer over h [T, H] -> [T, H], or past its attention only the rows `keep` -> [N, H]."""
        t = h.shape[0]
        nq, nkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = x.qkv(rms_norm(h, x.norm1))
        qk = self._rotate(qkv[:, : (nq + nkv) * d].view(t, nq + nkv, d), cos, sin)
        v = qkv[:, (nq + nkv) * d :].view(t, nkv, d)
        attn = paged_attention(qk[:, :nq], qk[:, nq:], v, meta, x.index, self.scaling, x.window).reshape(t, nq * d)
        if keep is not None:
            h, attn = h[keep], attn[keep]
            if h.shape[0] == 0:  # a chunk no row of which is read (a long prompt's middle)
                return h
        h = h + x.o(attn)
        gate, up = x.gate_up(rms_norm(h, x.norm2)).chunk(2, dim=-1)
        return h + x.down(F.silu(gate) * up)

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: PagedAttentionMetadata, logits_rows: torch.Tensor
    ) -> torch.Tensor:
        """input_ids/positions [T] -> logits [N, V] of the packed rows `logits_rows`."""
        return self.lm_head(self.hidden(input_ids, positions, meta, logits_rows))

    @torch.inference_mode()
    def hidden(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: PagedAttentionMetadata, rows: torch.Tensor
    ) -> torch.Tensor:
        """input_ids/positions [T] -> the final-normed hidden states [N, H] of the packed rows `rows` (what
        lm_head turns into logits)."""
        h = F.embedding(input_ids, self.embed)
        cos, sin = self.rotary(h.unsqueeze(0), positions.unsqueeze(0))  # [1, T, D]
        # Past its attention the last layer runs on `rows` only: the other rows' K/V are written by then, and
        # nothing reads their hidden state (a prefill chunk's rows but the last of a prompt that ends here).
        keep = rows if rows.numel() < h.shape[0] else None
        if self.native_ops:
            layers = self._stacked_layers if self._all_kernels(meta, h.shape[0]) else self._native_layers
            h = layers(h, cos[0].contiguous(), sin[0].contiguous(), meta, keep)
        else:
            cos, sin = cos[0].unsqueeze(1), sin[0].unsqueeze(1)
            for x in self.layers:
                h = self._layer(x, h, cos, sin, meta, keep if x is self.layers[-1] else None)
        return rms_norm(h if keep is not None else h[rows], self.final_norm)

    def _native_layers(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: PagedAttentionMetadata,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The layers through csrc/layer_ops.cpp: h is the residual stream (updated in place); each residual add
        is fused with the RMSNorm after it (the next layer's input norm included); cos/sin [T, D]. -> the final
        residual of the rows `keep` (all: h), which alone the last layer computes past its attention; their rows of
        h are set to it, the others keep the residual from before that attention (what csrc/layer_stack.cpp does)."""
        ops = cpu_ops.ops()
        t = h.shape[0]
        nq, nkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        normed = torch.empty_like(h)
        ops.add_rms_norm(normed, h, None, *self.layers[0].norm1)
        for i, x in enumerate(self.layers):
            qkv = x.qkv(normed)
            qk = qkv[:, : (nq + nkv) * d].view(t, nq + nkv, d)
            ops.rotary(qk, cos, sin)
            attn = paged_attention(
                qk[:, :nq], qk[:, nq:], qkv[:, (nq + nkv) * d :].view(t, nkv, d), meta, x.index, self.scaling, x.window
            )
            if keep is not None and i + 1 == len(self.layers):
                return self._native_tail(x, h, attn.reshape(t, nq * d), keep)
            ops.add_rms_norm(normed, h, x.o(attn.reshape(t, nq * d)), *x.norm2)
            gate_up = x.gate_up(normed)
            act = gate_up.new_empty(t, gate_up.shape[1] // 2)
            ops.silu_mul(act, gate_up)
            mlp = x.down(act)
            if i + 1 < len(self.layers):
                ops.add_rms_norm(normed, h, mlp, *self.layers[i + 1].norm1)
            else:
                h += mlp
        return h

    @staticmethod
    def _native_tail(x: FusedLayer, h: torch.Tensor, attn: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """The last layer past its attention on the rows `keep` of h and attn [T, ...] (_native_layers)."""
        ops = cpu_ops.ops()
        hs = h.index_select(0, keep)
        if hs.shape[0] == 0:  # a chunk no row of which is read (a long prompt's middle)
            return hs
        normed = torch.empty_like(hs)
        ops.add_rms_norm(normed, hs, x.o(attn.index_select(0, keep)), *x.norm2)
        gate_up = x.gate_up(normed)
        act = gate_up.new_empty(hs.shape[0], gate_up.shape[1] // 2)
        ops.silu_mul(act, gate_up)
        hs += x.down(act)
        h.index_copy_(0, keep, hs)
        return hs

    def _all_kernels(self, meta: PagedAttentionMetadata, t: int) -> bool:
        """Whether this step can take _stacked_layers: every attention group through a CPU kernel (decode rows with
        context_lens, prefill chunks with spans), over a float32 pool."""
        d = meta.decode
        groups = ([] if d is None else [d.context_lens]) + [p.spans for p in meta.prefills]
        return (
            self.stacked
            and bool(groups)
            and all(g is not None for g in groups)
            and meta.kv_cache.key.dtype == torch.float32
        )

    def _stacked_layers(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: PagedAttentionMetadata,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """_native_layers in one C++ call (csrc/layer_stack.cpp): the same kernels in the same order, each linear
        through the kernel its GEMM plan picked for this many rows (the last layer's tail: for the kept rows), so
        the same bits."""
        if self._stack is None:
            self._stack = self._stack_arguments()
        linears, weights, biases, packed, panels, coded, windows, eps = self._stack
        t, cache, d = h.shape[0], meta.kv_cache, meta.decode
        parts = self._parts(meta, t, keep)
        codes = self._codes(linears, -(-t // parts))  # a run's rows
        tail = [] if keep is None else self._codes(linears, keep.numel())[-3:]  # the last o, gate_up, down
        groups = ([] if d is None else [(meta.num_decode_tokens, d.block_tables, d.context_lens)]) + [
            (p.num_rows, p.block_tables, p.spans) for p in meta.prefills
        ]
        key, value = cache.slots()
        cpu_ops.ops().layer_stack(
            h,
            cos,
            sin,
            weights,
            biases,
            packed,
            panels,
            coded,
            codes,
            key,
            value,
            meta.slot_mapping,
            [g[1] for g in groups],
            [g[2] for g in groups],
            [g[0] for g in groups],
            d is not None,
            cache.block_size,
            self.scaling,
            windows,
            eps,
            self.num_heads,
            keep,
            tail,
            parts,
        )
        return h if keep is None else h.index_select(0, keep)

    def _parts(self, meta: PagedAttentionMetadata, t: int, keep: torch.Tensor | None) -> int:
        """The runs of sequences a step's stack computes at once (csrc/layer_stack.cpp's layer_stack says why):
        one a thread, each of at least split_rows decode rows, else 1 (never fewer runs than threads: a thread
        without a run would idle through the step); 1 for a step with a prompt's or a draft's rows."""
        threads = torch.get_num_threads()
        split = self.split_rows and threads > 1 and t >= threads * self.split_rows
        return threads if split and keep is None and not meta.prefills and meta.num_decode_tokens == t else 1

    def _stack_arguments(self) -> tuple:
        """The layer stack's per-layer lists, gathered once (the plans' copies are made before the first forward)."""
        linears = [lin for x in self.layers for lin in (x.qkv, x.o, x.gate_up, x.down)]
        weights = [
            w
            for x in self.layers
            for w in (x.qkv.weight, x.o.weight, x.gate_up.weight, x.down.weight, x.norm1[0], x.norm2[0])
        ]
        copies = [getattr(lin, "conveyor_copies", {}) for lin in linears]  # gemm.apply_plan's
        packed, panels = ([c.get(n) for c in copies] for n in ("packed", "panel"))
        coded = [c.get("q4", c.get("q8")) for c in copies]  # a weight is one or the other (coded.py)
        windows = [x.window or 0 for x in self.layers]
        biases = [lin.bias for lin in linears]
        return linears, weights, biases, packed, panels, coded, windows, self.layers[0].norm1[1]

    def _codes(self, linears: list[nn.Linear], rows: int) -> list[int]:
        """Each linear's kernel code at this many rows, kept per bucket of rows (the plans' granularity)."""
        bucket = (rows - 1).bit_length()
        codes = self._stack_codes.get(bucket)
        if codes is None:
            codes = self._stack_codes[bucket] = [_kernel_code(lin, rows) for lin in linears]
        return codes


def _kernel_code(linear: nn.Linear, rows: int) -> int:
    """The code (gemm.KERNEL_CODES) of the kernel linear's GEMM plan runs at this many rows; F.linear unplanned."""
    plan = getattr(linear, "conveyor_gemm_plan", None)
    return KERNEL_CODES[plan.kernel_for(rows) if plan is not None else "linear"]
