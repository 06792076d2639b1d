"""Per-request sampling over a batch of next-token logits.

Order (as transformers' logits processors, then vLLM's penalties): OpenAI's logit_bias, repetition penalty (prompt and output
tokens), OpenAI's frequency and presence penalties (output tokens only), min_tokens masking, then greedy argmax
(temperature 0) or temperature -> top_k -> top_p -> min_p -> draw (inverse CDF) with the request's own
torch.Generator (so a seed gives the same tokens whatever else is batched). Greedy rows are the exact argmax of
the (penalised/masked) logits.

Log probabilities (a request's `logprobs`), computed only for the rows that ask: log_softmax of the logits
after the penalties and min_tokens masking and divided by the temperature, before top-k/top-p/min-p truncation
(vLLM's "processed" log probabilities); a greedy row's are those of the penalised logits as they are (no
temperature). So with no penalty, temperature 0 or 1 gives the model's own log-softmax.
"""

from __future__ import annotations

import torch

from services.worker.engine.cpu import cpu_ops
from services.worker.engine.outputs import TokenLogprobs
from services.worker.engine.sampling.prompt_logprobs import ROWS_PER_HEAD_CALL, PromptJob
from services.worker.engine.request import Sequence


def generator_seed(seed: int) -> int:
    """A request's seed (any int64, as OpenAI's) as a torch.Generator's, which lies in [0, 2**64): its two's
    complement, so negative seeds land past the non-negative ones and no two int64 seeds share one. Done here, not
    left to Generator.manual_seed, whose taking of a negative value is its own undocumented detail (torch 2.13 maps
    it the same way, so a seed's tokens are what that version gave them)."""
    return seed % 2**64


def _needs_penalty(seq: Sequence) -> bool:
    o = seq.sampling
    return (
        bool(o.logit_bias)
        or o.repetition_penalty != 1.0
        or seq.num_outputs < o.min_tokens
        or (seq.num_outputs > 0 and (o.frequency_penalty != 0.0 or o.presence_penalty != 0.0))
    )


def _penalise(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """In place, per row that needs it: repetition penalty, frequency/presence penalties and EOS/stop masking
    before min_tokens."""
    for i, seq in enumerate(seqs):
        opts = seq.sampling
        if opts.logit_bias:  # OpenAI's: added to the logits as the model gave them, before any other change
            ids = torch.tensor([t for t, _ in opts.logit_bias], dtype=torch.long, device=logits.device)
            logits[i, ids] += torch.tensor([b for _, b in opts.logit_bias], dtype=logits.dtype, device=logits.device)
        if opts.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(seq.token_ids)), dtype=torch.long, device=logits.device)
            scores = logits[i, seen]
            scores = torch.where(scores < 0, scores * opts.repetition_penalty, scores / opts.repetition_penalty)
            logits[i, seen] = scores
        if (opts.frequency_penalty != 0.0 or opts.presence_penalty != 0.0) and seq.num_outputs > 0:
            out = torch.tensor(seq.output_token_ids, dtype=torch.long, device=logits.device)
            ids, counts = torch.unique(out, return_counts=True)
            logits[i, ids] -= counts.to(logits.dtype) * opts.frequency_penalty + opts.presence_penalty
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
        return cpu_ops.ops().sample_rows(x.contiguous(), inv_temp, u).tolist()
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
    ok = bits.flatten(1)[:, : logits.shape[1]].bool()
    return logits.masked_fill(~ok, float("-inf"))


def _logprobs(logits: torch.Tensor, seqs: list[Sequence], tokens: list[int]) -> list[TokenLogprobs | None]:
    """For the rows whose request asked: the sampled token's log probability and the k most likely tokens'
    (see the module's docstring for which distribution). logits: the penalised rows, left unchanged."""
    rows = [i for i, s in enumerate(seqs) if s.sampling.logprobs is not None]
    x = logits if len(rows) == len(seqs) else logits[torch.tensor(rows, device=logits.device)]
    temps = [seqs[i].sampling.temperature or 1.0 for i in rows]  # greedy: the penalised logits as they are
    if any(t != 1.0 for t in temps):
        x = x / torch.tensor(temps, dtype=x.dtype, device=x.device)[:, None]
    lp = torch.log_softmax(x, dim=-1)
    chosen = lp.gather(1, torch.tensor([tokens[i] for i in rows], device=lp.device)[:, None])  # [R, 1]
    k = max(seqs[i].sampling.logprobs for i in rows)
    top_v, top_i = lp.topk(k, dim=-1) if k else (chosen[:, :0], None)
    values = torch.cat([chosen, top_v], dim=1).tolist()  # one transfer: own logprob, then the top k
    ids = top_i.tolist() if k else [[] for _ in rows]
    out: list[TokenLogprobs | None] = [None] * len(seqs)
    for r, i in enumerate(rows):
        n = seqs[i].sampling.logprobs
        out[i] = TokenLogprobs(values[r][0], tuple(ids[r][:n]), tuple(values[r][1 : n + 1]))
    return out


@torch.inference_mode()
def sample(
    logits: torch.Tensor, seqs: list[Sequence], native: bool = False, allowed=None
) -> tuple[list[int], list[TokenLogprobs | None] | None]:
    """logits [N, V] (any float dtype) for seqs (len N) -> (next token of each, and per row its TokenLogprobs
    where the request asked for them, else None; None alone when no row asked: nothing extra is computed).
    native: see _draw; allowed: see _allow_only (None = no row is constrained). A constrained row's log
    probabilities are those of the distribution it was sampled from: the tokens its grammar forbids have -inf."""
    logits = logits.float()
    if allowed is not None:
        logits = _allow_only(logits, allowed)
    if any(_needs_penalty(s) for s in seqs):
        logits = logits.clone()
        _penalise(logits, seqs)
    tokens = _tokens(logits, seqs, native)  # reads logits, never writes them
    if all(s.sampling.logprobs is None for s in seqs):
        return tokens, None
    return tokens, _logprobs(logits, seqs, tokens)


def _argmax(logits: torch.Tensor) -> list[int]:
    """Each row's first index of its largest value: torch.max's indices, the same as argmax's (both document the
    first of equal maxima) at a third of its time on CPU (32 x 49,152 logits: 0.45 against 1.2 ms, torch 2.13)."""
    return logits.max(dim=-1).indices.tolist()


def _tokens(logits: torch.Tensor, seqs: list[Sequence], native: bool) -> list[int]:
    greedy = [i for i, s in enumerate(seqs) if s.sampling.greedy]
    if len(greedy) == len(seqs):
        return _argmax(logits)
    out = [0] * len(seqs)
    if greedy:
        idx = torch.tensor(greedy, device=logits.device)
        for i, tok in zip(greedy, _argmax(logits[idx])):
            out[i] = tok
    if not greedy:  # every row drawn: no copy of the rows
        return _draw(logits, seqs, native)
    rest = [i for i in range(len(seqs)) if not seqs[i].sampling.greedy]
    idx = torch.tensor(rest, device=logits.device)
    for i, tok in zip(rest, _draw(logits[idx], [seqs[i] for i in rest], native)):
        out[i] = tok
    return out


@torch.inference_mode()
def prompt_logprobs(scores, jobs: list[PromptJob]) -> list[list[TokenLogprobs]]:
    """The jobs' prompt log probabilities, one list per job: log_softmax of the model's raw logits in float32 (no
    penalty, temperature or grammar: vLLM's raw prompt logprobs), the prompt token's own, its rank, and the job's k
    most likely. scores(a, b): the logits of the jobs' rows a..b (all jobs' rows in order), asked ROWS_PER_HEAD_CALL
    at a time so that only that many rows of vocabulary-wide logits exist at once."""
    targets = [t for job in jobs for t in job.targets]
    kmax = max(job.seq.sampling.prompt_logprobs for job in jobs)
    own, ranks, tops, top_ids = [], [], [], []
    for a in range(0, len(targets), ROWS_PER_HEAD_CALL):
        lp = torch.log_softmax(scores(a, a + ROWS_PER_HEAD_CALL).float(), dim=-1)
        chosen = lp.gather(1, torch.tensor(targets[a : a + ROWS_PER_HEAD_CALL], device=lp.device)[:, None])
        own += chosen[:, 0].tolist()
        ranks += ((lp > chosen).sum(dim=1) + 1).tolist()
        if kmax:
            v, i = lp.topk(kmax, dim=-1)
            tops += v.tolist()
            top_ids += i.tolist()
        else:
            tops += [[]] * lp.shape[0]
            top_ids += [[]] * lp.shape[0]
    out, r = [], 0
    for job in jobs:
        k = job.seq.sampling.prompt_logprobs
        n = len(job.targets)
        out.append(
            [TokenLogprobs(own[j], tuple(top_ids[j][:k]), tuple(tops[j][:k]), ranks[j]) for j in range(r, r + n)]
        )
        r += n
    return out
