"""Float32 weights that are coded blocks: find each block's scales and codes, exactly, or say the weight is not one.

A GGUF file stores each run of 32 values of a weight row as a few numbers and 32 codes: Q4_1 as float16 d and m and
4-bit codes q, the value fl(fl(d * q) + m); Q8_0 as float16 d and 8-bit codes, fl(d * q). The float32 weight the
engine loads (shared/model_files converts the file once) holds exactly those values. Read as codes, the weight is 5
or 9 bits a value instead of 32, and each float32 value can be rebuilt to the bit next to the FMAs that use it
(csrc/coded_gemm.cpp): the same numbers, a sixth or a third of the bytes from memory.

Nothing is assumed of where a weight came from: `recover_q4` takes a block's smallest value as m (code 0) and tries
the float16 numbers nearest (largest - smallest) / 15 as d; `recover_q8` tries those nearest the largest magnitude /
127; a weight is kept only if every value of every block is rebuilt exactly. Any other weight (a float32 or bfloat16
checkpoint, another GGUF type) gets None and keeps its float32 kernels.

The engine runs the same search in C++ (csrc/coded_recover.cpp, one pass over the weight: 0.54 s of one thread for
the bundled model's weights against 2.49 s here, at every engine's start); this file is its reference, which the tests
hold it to, code for code.
"""

from __future__ import annotations

import torch

BLOCK = 32  # values of a row sharing one d (and m) (csrc/coded_gemm.cpp's kCodeBlock)
_D_STEPS = (0, -1, 1, -2, 2)  # float16 neighbours of the estimate of d tried, nearest first
_BLOCKS_AT_ONCE = 1 << 16  # blocks recovered per pass (bounds the temporaries)
_FIRST_BLOCKS = 256  # the first pass's

Codes = tuple[torch.Tensor, ...]  # (codes [N, K], d [N, K / 32]) and for Q4 m [N, K / 32]


def recover_q4(w: torch.Tensor) -> Codes | None:
    """w [N, K] float32 -> (codes uint8 0..15, d, m) with w == fl(fl(d * codes) + m) in every value, or None."""
    return _recover(w, _q4_blocks)


def recover_q8(w: torch.Tensor) -> Codes | None:
    """w [N, K] float32 -> (codes int8 -127..127, d) with w == fl(d * codes) in every value, or None."""
    return _recover(w, _q8_blocks)


def _recover(w: torch.Tensor, blocks_fn) -> Codes | None:
    if w.dtype != torch.float32 or w.dim() != 2 or w.shape[1] % BLOCK or w.numel() == 0 or w.device.type != "cpu":
        return None
    blocks = w.detach().contiguous().view(-1, BLOCK)
    if not torch.isfinite(blocks).all():
        return None
    parts: list[Codes] = []
    # a first pass over a few blocks: a weight that is not coded (most of a float32 checkpoint's) is refused in
    # microseconds rather than after a pass over all of it
    for s, e in _spans(blocks.shape[0]):
        found = blocks_fn(blocks[s:e])
        if found is None:
            return None
        parts.append(found)
    n, k = w.shape
    codes, *scales = (torch.cat(p) for p in zip(*parts))
    return (codes.view(n, k), *(x.view(n, k // BLOCK) for x in scales))


def _spans(n: int):
    """[start, end) of the passes over n blocks: _FIRST_BLOCKS, then _BLOCKS_AT_ONCE at a time."""
    start, step = 0, _FIRST_BLOCKS
    while start < n:
        end = min(n, start + step)
        yield start, end
        start, step = end, _BLOCKS_AT_ONCE


def _candidates(estimate: torch.Tensor):
    """float16 estimates of d and their neighbours (as float32), non-negative and finite; 0 for none."""
    for step in _D_STEPS:
        cand = (estimate.view(torch.int16) + step).view(torch.float16).float() if step else estimate.float()
        yield torch.where(torch.isfinite(cand) & (cand >= 0), cand, torch.zeros_like(cand))


def _q4_blocks(b: torch.Tensor) -> Codes | None:
    m = b.min(dim=1, keepdim=True).values
    return _search(b, ((b.max(dim=1, keepdim=True).values - m) / 15).half(), m, 0, 15, torch.uint8)


def _q8_blocks(b: torch.Tensor) -> Codes | None:
    return _search(b, (b.abs().max(dim=1, keepdim=True).values / 127).half(), None, -127, 127, torch.int8)


def _search(b: torch.Tensor, estimate, m, lo: int, hi: int, dtype) -> Codes | None:
    done = torch.zeros(b.shape[0], dtype=torch.bool)
    codes = torch.zeros(b.shape, dtype=dtype)
    d = torch.zeros(b.shape[0], 1)
    base = b if m is None else b - m
    for cand in _candidates(estimate):
        q = torch.round(base / torch.where(cand > 0, cand, torch.ones_like(cand))).clamp_(lo, hi)
        q = q.to(dtype).float()  # the codes as the kernel reads them (a rounded -0.0 is the code 0)
        rebuilt = cand * q  # Q4: two roundings, as the file's converter and the kernel do, never one FMA
        if m is not None:
            rebuilt = rebuilt + m
        ok = (rebuilt.view(torch.int32) == b.view(torch.int32)).all(dim=1) & ~done  # to the bit: -0.0 is not 0.0
        codes[ok], d[ok] = q[ok].to(dtype), cand[ok]
        done |= ok
        if bool(done.all()):
            return (codes, d.view(-1)) if m is None else (codes, d.view(-1), m.view(-1))
    return None
