"""Per-request sampling over a batch of next-token logits.

Order (as transformers' logits processors): repetition penalty, min_tokens masking,
then greedy argmax (temperature 0) or temperature -> top_k -> top_p -> min_p -> draw (inverse CDF) with the
request's own torch.Generator (so a seed gives the same tokens whatever else is batched).
Greedy rows are the exact argmax of the (penalised/masked) logits.
"""

from __future__ import annotations

import torch

from services.worker.engine.request import Sequence


def _penalise(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """In place, per row that needs it: repetition penalty and EOS/stop masking before min_tokens."""
    for i, seq in enumerate(seqs):
        opts = seq.sampling
        if opts.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(seq.token_ids)), dtype=torch.long, device=logits.device)
            scores = logits[i, seen]
            scores = torch.where(scores < 0, scores * opts.repetition_penalty, scores / opts.repetition_penalty)
            logits[i, seen] = scores
        if seq.num_outputs < opts.min_tokens and seq.stop_ids:
            stop = torch.tensor(sorted(seq.stop_ids), dtype=torch.long, device=logits.device)
            logits[i, stop] = float("-inf")


def _top_k(x: torch.Tensor, ks: list[int]) -> torch.Tensor:
    """Rows with k <= 0 are left alone; one topk call sized by the largest k."""
    kmax = min(max(ks), x.shape[1])
    k = torch.tensor([min(kk, kmax) if kk > 0 else kmax for kk in ks], device=x.device)
    top = torch.topk(x, kmax, dim=-1).values  # [N, kmax], descending
    kth = top.gather(1, (k - 1)[:, None])  # [N, 1]
    off = torch.tensor([kk <= 0 for kk in ks], device=x.device)[:, None]
    return x.masked_fill((x < kth) & ~off, float("-inf"))


def _top_p(x: torch.Tensor, ps: list[float]) -> torch.Tensor:
    p = torch.tensor(ps, dtype=x.dtype, device=x.device)[:, None]
    sorted_x, order = torch.sort(x, dim=-1, descending=True)
    probs = torch.softmax(sorted_x, dim=-1)
    # drop a token when the mass before it already reaches top_p; the first token always stays
    drop = (torch.cumsum(probs, dim=-1) - probs) >= p
    drop[:, 0] = False
    sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    return torch.empty_like(x).scatter_(1, order, sorted_x)


def _min_p(x: torch.Tensor, mps: list[float]) -> torch.Tensor:
    mp = torch.tensor(mps, dtype=x.dtype, device=x.device)[:, None]
    probs = torch.softmax(x, dim=-1)
    return x.masked_fill(probs < probs.max(dim=-1, keepdim=True).values * mp, float("-inf"))


def _draw(logits: torch.Tensor, seqs: list[Sequence], native: bool = False) -> list[int]:
    """Stochastic rows: logits [N, V] float32 -> one token per row. native: through csrc/sampling.cpp (loaded
    by the caller; CPU), the same inverse-CDF draw in two passes over the logits instead of ~six."""
    opts = [s.sampling for s in seqs]
    temps = torch.tensor([o.temperature for o in opts], dtype=logits.dtype, device=logits.device)
    filtered = any(o.top_k > 0 or o.top_p < 1.0 or o.min_p > 0.0 for o in opts)
    x = logits / temps[:, None] if filtered or not native else logits
    if any(o.top_k > 0 for o in opts):
        x = _top_k(x, [o.top_k for o in opts])
    if any(o.top_p < 1.0 for o in opts):
        x = _top_p(x, [o.top_p for o in opts])
    if any(o.min_p > 0.0 for o in opts):
        x = _min_p(x, [o.min_p for o in opts])
    # Inverse CDF, batched: one uniform per row from the row's own generator, then one cumsum and one
    # searchsorted over the whole batch. (torch.multinomial per row, or an exponential race drawing a
    # number per vocabulary entry from a per-row generator, cost ~1.5 ms a row on CPU: a quarter of a
    # batch-32 step.)
    u = torch.cat([torch.rand(1, generator=seq.generator, device=logits.device) for seq in seqs])
    if native:
        inv_temp = torch.ones_like(temps) if filtered else 1.0 / temps
        return torch.ops.conveyor.sample_rows(x.contiguous(), inv_temp, u).tolist()
    probs = torch.softmax(x, dim=-1)
    # side="right" lands on a token whose interval has width, i.e. p > 0; the last lines guard the one
    # float edge (u * total rounding up to total).
    cdf = probs.cumsum(dim=-1)
    idx = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], side="right").clamp_(max=probs.shape[1] - 1)
    bad = (probs.gather(1, idx) <= 0)[:, 0]
    if bool(bad.any()):
        idx[bad] = probs[bad].argmax(dim=-1, keepdim=True)
    return idx[:, 0].tolist()


def _allow_only(logits: torch.Tensor, allowed) -> torch.Tensor:
    """Grammar-constrained rows: -inf for every token the row's bitmask (numpy int32 [N, ceil(V / 32)], bit j of
    word w = token 32w + j; structured.py) does not allow."""
    words = torch.from_numpy(allowed).to(logits.device)
    bits = (words[:, :, None] >> torch.arange(32, dtype=torch.int32, device=logits.device)) & 1
    ok = bits.flatten(1)[:, :logits.shape[1]].bool()
    return logits.masked_fill(~ok, float("-inf"))


@torch.inference_mode()
def sample(logits: torch.Tensor, seqs: list[Sequence], native: bool = False, allowed=None) -> list[int]:
    """logits [N, V] (any float dtype) for seqs (len N) -> next token of each; native: see _draw; allowed: see
    _allow_only (None = no row is constrained)."""
    logits = logits.float()
    if allowed is not None:
        logits = _allow_only(logits, allowed)
    if any(s.sampling.repetition_penalty != 1.0 or s.num_outputs < s.sampling.min_tokens for s in seqs):
        logits = logits.clone()
        _penalise(logits, seqs)
    greedy = [i for i, s in enumerate(seqs) if s.sampling.greedy]
    if len(greedy) == len(seqs):
        return logits.argmax(dim=-1).tolist()
    out = [0] * len(seqs)
    if greedy:
        idx = torch.tensor(greedy, device=logits.device)
        for i, tok in zip(greedy, logits[idx].argmax(dim=-1).tolist()):
            out[i] = tok
    if not greedy:  # every row drawn: no copy of the rows
        return _draw(logits, seqs, native)
    rest = [i for i in range(len(seqs)) if not seqs[i].sampling.greedy]
    idx = torch.tensor(rest, device=logits.device)
    for i, tok in zip(rest, _draw(logits[idx], [seqs[i] for i in rest], native)):
        out[i] = tok
    return out
