"""Float32 weights that are 4-bit blocks: find each block's d, m and codes, exactly, or say the weight is not one.

A GGUF file's Q4_1 tensor stores each run of 32 values of a weight row as two float16 numbers d and m and 32 4-bit
codes q; the float32 weight the engine loads (shared/model_files converts the file once) holds fl(fl(d * q) + m) for
each. Read as codes, the weight is 5 bits a value instead of 32, and each float32 value can be rebuilt to the bit
next to the FMAs that use it (csrc/q4_gemm.cpp): the same numbers, a sixth of the bytes from memory.

Nothing is assumed of where a weight came from: `recover` takes the block's smallest value as m (code 0), tries the
float16 numbers nearest (largest - smallest) / 15 as d, and keeps a weight only if every value of every block is
rebuilt exactly; any other weight (a float32 or bfloat16 checkpoint, another GGUF type) gets None and keeps its
float32 kernels.
"""

from __future__ import annotations

import torch

BLOCK = 32  # values of a row sharing one d and one m (csrc/q4_gemm.cpp's kQ4Block)
_D_STEPS = (0, -1, 1, -2, 2)  # float16 neighbours of the estimate of d tried, nearest first
_ROWS_AT_ONCE = 1 << 16  # blocks recovered per pass (bounds the temporaries)


def recover(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """w [N, K] float32 -> (codes [N, K] uint8, d [N, K / 32], m [N, K / 32] float32) with w == fl(fl(d * codes) +
    m) in every value, or None when w is no such weight."""
    if w.dtype != torch.float32 or w.dim() != 2 or w.shape[1] % BLOCK or w.numel() == 0 or w.device.type != "cpu":
        return None
    blocks = w.detach().contiguous().view(-1, BLOCK)
    if not torch.isfinite(blocks).all():
        return None
    codes = torch.empty(blocks.shape, dtype=torch.uint8)
    d_all, m_all = torch.empty(blocks.shape[0]), torch.empty(blocks.shape[0])
    for s in range(0, blocks.shape[0], _ROWS_AT_ONCE):
        found = _recover_blocks(blocks[s : s + _ROWS_AT_ONCE])
        if found is None:
            return None
        codes[s : s + _ROWS_AT_ONCE], d_all[s : s + _ROWS_AT_ONCE], m_all[s : s + _ROWS_AT_ONCE] = found
    n, k = w.shape
    return codes.view(n, k), d_all.view(n, k // BLOCK), m_all.view(n, k // BLOCK)


def _recover_blocks(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    m = b.min(dim=1, keepdim=True).values
    estimate = ((b.max(dim=1, keepdim=True).values - m) / 15).half()
    done = torch.zeros(b.shape[0], dtype=torch.bool)
    codes = torch.zeros(b.shape, dtype=torch.uint8)
    d = torch.zeros(b.shape[0], 1)
    for step in _D_STEPS:
        cand = (estimate.view(torch.int16) + step).view(torch.float16).float() if step else estimate.float()
        cand = torch.where(torch.isfinite(cand) & (cand >= 0), cand, torch.zeros_like(cand))
        q = torch.round((b - m) / torch.where(cand > 0, cand, torch.ones_like(cand))).clamp_(0, 15)
        rebuilt = cand * q  # two roundings, as the file's converter and the kernel do: never one FMA
        rebuilt = rebuilt + m
        ok = (rebuilt == b).all(dim=1) & ~done
        codes[ok], d[ok] = q[ok].to(torch.uint8), cand[ok]
        done |= ok
        if bool(done.all()):
            return codes, d.view(-1), m.view(-1)
    return None
