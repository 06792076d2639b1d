"""A lean HTTP/1.1 + Server-Sent Events client on bare asyncio streams, for thousands of concurrent streams.

httpx (h11 under it) spends tens of microseconds per event in pure Python; at 5,000 streams the client shares
the machine's two cores with the cluster it measures, so this one parses only what a stream needs: the status
line, the headers, chunked transfer encoding and `data:` lines. One keep-alive connection per client loop.
Each stream's record holds what the benchmark checks (status, every text piece in order, native token indices)
and times (time to first token, gaps between token events) on this process's perf_counter.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

MAX_LINE = 1 << 20  # a status, header or chunk-size line longer than this is not a server we measure


@dataclass
class StreamRecord:
    prompt_i: int  # which prompt it sent (its expected text is known)
    t_start: float  # perf_counter when the request was written (before connecting, for a new connection)
    status: int | None = None
    ttft: float | None = None  # seconds from t_start to the first event with text
    gaps: list[float] = field(default_factory=list)  # seconds between consecutive events with text
    text: list[str] = field(default_factory=list)
    indices: list[tuple[int, int]] = field(default_factory=list)  # /generate: (index, tokens) of each event
    completion_tokens: int | None = None  # from the final usage
    prompt_tokens: int | None = None  # from the final usage
    cached_tokens: int | None = None  # from the final usage: prompt tokens served from the prefix cache
    finish_reason: str | None = None
    error: str | None = None
    t_end: float | None = None
    done: bool = False  # [DONE] seen

    def on_text(self, text: str, now: float) -> None:
        if self.ttft is None:
            self.ttft, self._last = now - self.t_start, now
        else:
            self.gaps.append(now - self._last)
            self._last = now
        self.text.append(text)


def event_text(api: str, ev: dict) -> tuple[str | None, str | None]:
    """(text, finish_reason) of one SSE event of `api` (completions, chat or generate)."""
    if api == "generate":
        return ev.get("text"), ev.get("finish_reason")
    choices = ev.get("choices") or [{}]
    c = choices[0]
    text = (c.get("delta") or {}).get("content") if api == "chat" else c.get("text")
    return text, c.get("finish_reason")


class Connection:
    """One keep-alive HTTP/1.1 connection; reopened when the server closes it."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def _ensure(self) -> None:
        if self.writer is None or self.writer.is_closing():
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port, limit=MAX_LINE)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    async def stream(self, path: str, body: dict, api: str, rec: StreamRecord) -> StreamRecord:
        """POST body to path and read its SSE answer into rec (a non-200 answer: status and error body)."""
        payload = json.dumps(body).encode()
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json\r\n"
            f"Accept: text/event-stream\r\nContent-Length: {len(payload)}\r\n\r\n"
        ).encode()
        try:
            await self._ensure()
            self.writer.write(head + payload)
            rec.status, headers = await self._head()
            if rec.status != 200:
                rec.error = f"http {rec.status}: {(await self._body(headers)).decode(errors='replace')[:200]}"
            else:
                await self._events(headers, api, rec)
            if headers.get("connection", "").lower() == "close":
                self.close()
        except (OSError, asyncio.IncompleteReadError, ValueError) as e:
            rec.error = rec.error or f"{type(e).__name__}: {str(e)[:160]}"
            self.close()
        rec.t_end = time.perf_counter()
        return rec

    async def _head(self) -> tuple[int, dict[str, str]]:
        status = int((await self.reader.readuntil(b"\r\n")).split(b" ", 2)[1])
        headers = {}
        while (line := await self.reader.readuntil(b"\r\n")) != b"\r\n":
            k, _, v = line.decode("latin-1").partition(":")
            headers[k.strip().lower()] = v.strip()
        return status, headers

    async def _chunks(self, headers: dict):
        """The body's pieces as they arrive (chunked transfer encoding, or a Content-Length body)."""
        if headers.get("transfer-encoding", "").lower() != "chunked":
            yield await self.reader.readexactly(int(headers.get("content-length", 0)))
            return
        while True:
            size = int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16)
            data = await self.reader.readexactly(size + 2)  # the chunk and its CRLF
            if size == 0:
                return
            yield data[:-2]

    async def _body(self, headers: dict) -> bytes:
        return b"".join([c async for c in self._chunks(headers)])

    async def _events(self, headers: dict, api: str, rec: StreamRecord) -> None:
        buf = b""
        async for chunk in self._chunks(headers):
            now = time.perf_counter()
            buf += chunk
            *events, buf = buf.split(b"\n\n")
            for raw in events:
                self._event(raw, api, rec, now)

    @staticmethod
    def _event(raw: bytes, api: str, rec: StreamRecord, now: float) -> None:
        for line in raw.split(b"\n"):
            if not line.startswith(b"data: "):
                continue
            data = line[6:]
            if data == b"[DONE]":
                rec.done = True
                continue
            ev = json.loads(data)
            if "error" in ev:
                err = ev["error"]
                rec.error = f"error event: {err.get('code') or err.get('message')}"
            text, finish = event_text(api, ev)
            if api == "generate" and ev.get("token_ids"):
                rec.indices.append((ev["index"], len(ev["token_ids"])))
            if text:
                rec.on_text(text, now)
            rec.finish_reason = finish or rec.finish_reason
            if ev.get("usage"):
                usage = ev["usage"]
                rec.completion_tokens, rec.prompt_tokens = usage["completion_tokens"], usage.get("prompt_tokens")
                rec.cached_tokens = (usage.get("prompt_tokens_details") or {}).get(
                    "cached_tokens", usage.get("cached_tokens")
                )


def request_body(api: str, model: str, prompt: str, max_tokens: int) -> tuple[str, dict]:
    """(path, body) of one greedy streamed request of `api`."""
    common = {"max_tokens": max_tokens, "temperature": 0, "stream": True}
    if api == "completions":
        return "/v1/completions", {
            **common,
            "model": model,
            "prompt": prompt,
            "stream_options": {"include_usage": True},
        }
    if api == "chat":
        return "/v1/chat/completions", {
            **common,
            "model": model,
            "messages": [{"role": "user", "content": prompt}],
            "stream_options": {"include_usage": True},
        }
    return "/generate", {**common, "prompt": prompt}


def check(rec: StreamRecord, expected: str, max_tokens: int) -> str | None:
    """Why this stream is not a complete, in-order answer (None when it is): the status, an error event, a
    missing end, a token count other than max_tokens, a gap or repeat in the native indices, or text that is not
    exactly the simulator's sequence for its prompt (a lost, repeated or reordered token changes it)."""
    if rec.error:
        return rec.error
    if not rec.done or rec.finish_reason is None:
        return "stream ended without a final event and [DONE]"
    if rec.completion_tokens not in (None, max_tokens):
        return f"{rec.completion_tokens} completion tokens, not {max_tokens}"
    if rec.indices:
        at = 0
        for index, n in rec.indices:
            if index != at:
                return f"token index {index} where {at} was next"
            at += n
        if at != max_tokens:
            return f"indices cover {at} tokens, not {max_tokens}"
    if "".join(rec.text) != expected:
        return "text differs from the simulator's sequence for the prompt"
    return None
