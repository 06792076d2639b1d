"""The burst client: an async httpx client in the benchmark's own process, OpenAI /v1/completions, prompts as vLLM's
random dataset makes them; each request's times (first token, last token, status) recorded as it streams.

Used where `vllm bench serve` cannot say what is asked (burst, chaos, overload): the status of every refused request,
a request's own timeline, many requests launched at one instant.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from pathlib import Path

import httpx

from benchmarks.common import MODEL_NAME

# The burst client: an async httpx client in this process, OpenAI /v1/completions, as vLLM's random dataset.


def random_prompts(model: Path, n: int, length: int, seed: int) -> list[str]:
    """Random token ids decoded to text, as vLLM's random dataset does (re-encoded, the length may vary by a few)."""
    from transformers import AutoTokenizer  # only the httpx client needs it

    tok = AutoTokenizer.from_pretrained(str(model))
    rng = random.Random(seed)
    return [tok.decode([rng.randrange(100, tok.vocab_size) for _ in range(length)]) for _ in range(n)]


async def one_request(
    client: httpx.AsyncClient, url: str, prompt: str, stream: bool, max_tokens: int, t_burst: float | None = None
) -> dict:
    """One completion; the record says its status, error code, Retry-After, tokens, TTFT and latency (seconds
    from its own send), and when it was sent and ended relative to t_burst (perf_counter) when given."""
    body = {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
        **({"stream_options": {"include_usage": True}} if stream else {}),
    }
    rec = {
        "stream": stream,
        "status": None,
        "ttft": None,
        "tokens": 0,
        "error": None,
        "message": None,
        "retry_after": None,
    }
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            rec["status"] = r.status_code
            rec["retry_after"] = r.headers.get("retry-after")
            if r.status_code != 200 or not stream:
                data = json.loads(await r.aread())
                err = data.get("error") or {}
                rec["error"] = (err.get("code") or err.get("message")) if isinstance(err, dict) else str(err)
                if isinstance(err, dict) and err.get("message"):
                    rec["message"] = str(err["message"])[:200]  # e.g. the state a timed-out request was in
                rec["tokens"] = (data.get("usage") or {}).get("completion_tokens", 0)
            else:
                await read_stream(r, rec, t0)
    except (httpx.HTTPError, OSError, ValueError) as e:
        rec["error"] = f"{type(e).__name__}: {str(e)[:120]}"
    t1 = time.perf_counter()
    rec["latency"] = t1 - t0
    if t_burst is not None:
        rec["sent_at"], rec["ended_at"] = t0 - t_burst, t1 - t_burst
    return rec


async def read_stream(r: httpx.Response, rec: dict, t0: float) -> None:
    async for line in r.aiter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        if "error" in event:
            rec["error"] = event["error"].get("code") or event["error"].get("message")
            rec["message"] = str(event["error"].get("message"))[:200]
        if event.get("choices") and event["choices"][0].get("text") and rec["ttft"] is None:
            rec["ttft"] = time.perf_counter() - t0
        if event.get("usage"):
            rec["tokens"] = event["usage"]["completion_tokens"]


async def httpx_burst(
    url: str,
    prompts: list[str],
    max_tokens: int,
    stream_share: float,
    seed: int,
    max_concurrency: int = 0,
    client_timeout: float = 0,
) -> tuple[list[dict], float, dict]:
    """One warm-up request (not counted: first requests pay one-off costs), then every prompt at once (or
    max_concurrency at a time); a stream_share of them streamed. Returns the records, the burst's duration (s)
    and the warm-up's record. client_timeout 0: none, the server's deadlines apply."""
    rng = random.Random(seed)
    streams = [rng.random() < stream_share for _ in prompts]
    sem = asyncio.Semaphore(max_concurrency or len(prompts))
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(client_timeout or None)) as client:
        warm = await one_request(client, url, prompts[0], False, 4)
        print(f"warm-up (not counted): {warm['status']} {warm['error'] or 'ok'} in {warm['latency']:.1f} s", flush=True)
        t0 = time.perf_counter()

        async def limited(p: str, s: bool) -> dict:
            async with sem:
                return await one_request(client, url, p, s, max_tokens, t0)

        recs = await asyncio.gather(*[limited(p, s) for p, s in zip(prompts, streams)])
        return list(recs), time.perf_counter() - t0, warm
