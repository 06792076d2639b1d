"""Client-controlled work stays off the gateway's event loop (issue 24, item 9): a body of many tokens with their
log probabilities is built and encoded, and a request's tool schemas are compiled, while the loop keeps running
other coroutines. The real app on a test's own Redis; a fake worker delivers every choice's output at once.

How "off the loop" is seen, without timing anything: the first token string the body needs (TokenStrings.get,
what every shape calls per token) or the first grammar check waits until a coroutine on the loop has run. Called
on the loop, that coroutine cannot run and the wait gives up (after WAIT_S, a guard against a hung test)."""

from __future__ import annotations

import asyncio
import json
import threading
import uuid
from contextlib import asynccontextmanager

import httpx
import pytest

from services.gateway.text import logprobs as gateway_logprobs
from services.gateway.app import create_app
from shared.text import grammar
from shared.wire.events import TokenDelta
from shared.wire.logprobs import TokenLogprob, pack
from shared.settings import GatewaySettings
from tests.support.cache import CACHE_DIR
from tests.support.inproc import mark_live
from tests.support.factories import completed

TOKENS = 600  # per choice: more than one slice of the encoder, and heavy enough to leave the loop
TOP = 20
WAIT_S = 3.0
MODEL = "test-model"


class LoopWitness:
    """Records, for each piece of guarded work, whether the event loop ran while it was being done."""

    def __init__(self):
        self.started, self.ran = threading.Event(), threading.Event()
        self.seen: list[bool] = []

    def arm(self) -> None:
        self.started.clear()
        self.ran.clear()

    def check(self) -> None:
        """Called at the start of guarded work, in whatever thread does it."""
        if self.started.is_set():
            return
        self.started.set()
        self.seen.append(self.ran.wait(WAIT_S))

    async def watch(self) -> None:
        while True:
            if self.started.is_set():
                self.ran.set()
            await asyncio.sleep(0.002)


@pytest.fixture
def witness(monkeypatch):
    w = LoopWitness()
    get = gateway_logprobs.TokenStrings.get
    checked = grammar._checked

    def guarded_get(self, tid):
        w.check()
        return get(self, tid)

    def guarded_checked(g):
        w.check()
        return checked(g)

    monkeypatch.setattr(gateway_logprobs.TokenStrings, "get", guarded_get)
    monkeypatch.setattr(grammar, "_checked", guarded_checked)
    return w


def _entries(ids: list[int]) -> list[TokenLogprob]:
    return [
        TokenLogprob(-0.5 - i * 1e-3, tuple(ids[:TOP]), tuple(-1.0 - j * 1e-6 for j in range(TOP)))
        for i in range(len(ids))
    ]


async def _fake_worker(core, ids: list[int], logprobs: bool) -> None:
    """Answer every request the gateway creates: its whole output in one delta, then its end."""
    done: set[str] = set()
    packed = pack(_entries(ids)) if logprobs else None
    while True:
        for rid, handle in list(core.handles.items()):
            if rid in done or not handle.exists:
                continue
            done.add(rid)
            handle.deliver(TokenDelta(rid, 0, tuple(ids), packed))
            handle.deliver(completed(rid, "length", prompt_tokens=5, output_tokens=len(ids), worker_id="w1"))
        await asyncio.sleep(0.005)


async def _keep_live(redis_client, names) -> None:
    """The other services stay live for /ready (a test held up by a loop that did not run outlasts their TTL)."""
    while True:
        await asyncio.to_thread(mark_live, redis_client, names)
        await asyncio.sleep(1.0)


@asynccontextmanager
async def _gateway(redis_server, redis_client, names, logprobs: bool):
    mark_live(redis_client, names)
    app = create_app(
        GatewaySettings(redis_url=redis_server.url, namespace=names.ns, cache_dir=CACHE_DIR, model_name=MODEL)
    )
    async with app.router.lifespan_context(app):
        core = app.state.core
        word = core.tokenizer.encode(" river")[0]
        ids = [word + (i % 50) for i in range(TOKENS)]
        tasks = [
            asyncio.create_task(_fake_worker(core, ids, logprobs)),
            asyncio.create_task(_keep_live(redis_client, names)),
        ]
        await asyncio.sleep(0.1)  # the tasks have started (a request held up on the loop would hold them back)
        try:
            async with httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://gw", timeout=60
            ) as client:
                yield client, tasks
        finally:
            for t in tasks:
                t.cancel()


CHAT = [{"role": "user", "content": "hi"}]
LOGPROB_CASES = {
    "generate": ("/generate", {"prompt": "hi", "logprobs": TOP}),
    "generate_n2": ("/generate", {"prompt": "hi", "logprobs": TOP, "n": 2}),
    "generate_stream": ("/generate", {"prompt": "hi", "logprobs": TOP, "stream": True}),
    "generate_n2_stream": ("/generate", {"prompt": "hi", "logprobs": TOP, "n": 2, "stream": True}),
    "completions": ("/v1/completions", {"model": MODEL, "prompt": "hi", "logprobs": TOP}),
    "completions_stream": ("/v1/completions", {"model": MODEL, "prompt": "hi", "logprobs": TOP, "stream": True}),
    "chat": ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "logprobs": True, "top_logprobs": TOP}),
    "chat_n2": (
        "/v1/chat/completions",
        {"model": MODEL, "messages": CHAT, "logprobs": True, "top_logprobs": TOP, "n": 2},
    ),
    "chat_stream": (
        "/v1/chat/completions",
        {"model": MODEL, "messages": CHAT, "logprobs": True, "top_logprobs": TOP, "stream": True},
    ),
    "chat_n2_stream": (
        "/v1/chat/completions",
        {"model": MODEL, "messages": CHAT, "logprobs": True, "top_logprobs": TOP, "n": 2, "stream": True},
    ),
}


@pytest.mark.parametrize("case", list(LOGPROB_CASES))
def test_a_body_of_many_log_probabilities_is_built_while_the_loop_runs(
    redis_server, redis_client, names, witness, case
):
    path, body = LOGPROB_CASES[case]

    async def run():
        async with _gateway(redis_server, redis_client, names, logprobs=True) as (client, tasks):
            tasks.append(asyncio.create_task(witness.watch()))
            witness.arm()
            r = await client.post(path, json={**body, "max_tokens": TOKENS})
            return r

    r = asyncio.run(run())
    assert r.status_code == 200, r.text
    if body.get("stream"):
        assert r.text.rstrip().endswith("data: [DONE]")
    else:
        assert len(r.json()) > 0
    assert witness.seen and all(witness.seen), f"the loop did not run while the body was built: {witness.seen}"


def _tools(count: int) -> list[dict]:
    """count tools, each with schemas of its own (a schema is compiled once per process: a fresh mark)."""
    mark = uuid.uuid4().hex[:8]
    return [
        {
            "type": "function",
            "function": {
                "name": f"tool_{i}",
                "parameters": {
                    "type": "object",
                    "properties": {
                        f"p{j}_{i}_{mark}": {"type": "string", "pattern": "^[a-z]{1,8}[0-9]{2,4}$"} for j in range(4)
                    },
                    "required": [],
                },
            },
        }
        for i in range(count)
    ]


def test_tool_schemas_are_compiled_while_the_loop_runs_and_not_again_for_the_same_schemas(
    redis_server, redis_client, names, witness
):
    compiled: list[str] = []
    checked = grammar._checked  # the witness's guard

    def counting(g):
        compiled.append(g)
        return checked(g)

    async def run():
        async with _gateway(redis_server, redis_client, names, logprobs=False) as (client, tasks):
            tasks.append(asyncio.create_task(witness.watch()))
            body = {"model": MODEL, "messages": CHAT, "tools": _tools(128), "max_tokens": 4}
            out = []
            for _ in range(2):
                witness.arm()
                first = len(compiled)
                out.append(((await client.post("/v1/chat/completions", json=body)), len(compiled) - first))
            return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(grammar, "_checked", counting)
        (first, n_first), (second, n_second) = asyncio.run(run())
    assert first.status_code == 200 and second.status_code == 200, (first.text, second.text)
    assert json.loads(first.text)["choices"][0]["message"]["content"]
    assert witness.seen and all(witness.seen), f"the loop did not run while the schemas compiled: {witness.seen}"
    assert n_first == 128 and n_second == 0, "the second request's schemas, the same, are not compiled again"
