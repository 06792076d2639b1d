"""A request the tokenizer cannot preprocess fails alone, at once, with the outcome its fault calls for: never its
batch-mates, never the process (issue 24, item 4). The service's real code on a test's own Redis, with the real
tokenizer of the bundled model; its chat template replaced by one that refuses some conversations, as Mistral's
and Llama 2's refuse two user turns in a row (transformers raises jinja2's TemplateError from `raise_exception`)."""

from __future__ import annotations

import asyncio
import shutil

import pytest

from services.tokenizer.service import TokenizerService
from shared.process import telemetry
from shared.wire.constants import EVENT_FIELD, GROUP_TOKENIZER
from shared.wire.events import decode
from shared.settings import TokenizerSettings
from services.gateway.session.request import GenerateRequest, Message
from tests.support.cache import CACHE_DIR
from tests.support.inproc import gateway_core, mark_live

ALTERNATE = "Conversation roles must alternate user/assistant/user/assistant/..."
REFUSING_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.index0 > 0 and message['role'] == 'user' and messages[loop.index0 - 1]['role'] == 'user' %}"
    "{{ raise_exception('" + ALTERNATE + "') }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
GOOD = [("user", "Hi"), ("assistant", "Hello!"), ("user", "How are you?")]
TWO_USERS = [("user", "Hi"), ("user", "Are you there?")]


@pytest.fixture
def refusing_model(tmp_path, model_dir):
    """The bundled model's folder with a chat template that calls raise_exception on two user turns in a row."""
    folder = tmp_path / "refusing-model"
    folder.mkdir()
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, folder / name)
    (folder / "chat_template.jinja").write_text(REFUSING_TEMPLATE)
    return folder


@pytest.fixture
def tokenizer(redis_server, redis_client, names, refusing_model):
    svc = TokenizerService(
        TokenizerSettings(
            redis_url=redis_server.url, namespace=names.ns, cache_dir=CACHE_DIR, model=str(refusing_model)
        )
    )
    svc.bus.ensure_group(names.received_stream(0), GROUP_TOKENIZER)
    svc.tick()  # nothing to read yet: its liveness refresh and sweep are done
    mark_live(redis_client, names)
    return svc


def submit(redis_server, names, chats: list[list[tuple[str, str]]]) -> list[str]:
    """Create the requests as a gateway does; they wait on the received stream for the tokenizer's next read."""

    async def run():
        core = gateway_core(redis_server.url, names)
        try:
            out = []
            for chat in chats:
                req = GenerateRequest(messages=[Message(role=r, content=c) for r, c in chat], max_tokens=2)
                out.append((await core.submit(req, 2)).request_id)
            return out
        finally:
            await core.r.aclose()

    return asyncio.run(run())


def _state(redis_client, names, rid: str) -> str:
    return redis_client.hget(names.layer(rid, "meta"), "state").decode()


def _ending(redis_client, names, rid: str):
    """The Failed event the tokenizer sent the request's gateway, if any."""
    for stream in redis_client.keys(f"{names.ns}:stream:reply:*"):
        for _, fields in redis_client.xrange(stream):
            ev = decode(fields[EVENT_FIELD])
            if getattr(ev, "request_id", None) == rid:
                return ev
    return None


def test_a_chat_template_refusal_fails_that_request_alone_as_invalid(tokenizer, redis_server, redis_client, names):
    rids = submit(redis_server, names, [GOOD, TWO_USERS, GOOD, GOOD])
    tokenizer.tick()  # one read, one batch: all four (this tick raised TemplateError and the process died)
    bad = rids[1]
    assert [_state(redis_client, names, r) for r in rids] == ["PREPROCESSED", "FAILED", "PREPROCESSED", "PREPROCESSED"]
    ending = _ending(redis_client, names, bad)
    assert ending.reason == "invalid" and ending.param == "messages" and ALTERNATE in ending.message
    assert redis_client.hget(names.layer(bad, "meta"), "reason") == b"invalid"
    assert redis_client.xpending(names.received_stream(0), GROUP_TOKENIZER)["pending"] == 0


def test_an_unexpected_error_on_one_request_fails_it_alone_as_internal(
    tokenizer, redis_server, redis_client, names, monkeypatch
):
    rids = submit(redis_server, names, [GOOD, [("user", "poison")], GOOD])
    token_ids = tokenizer.pre.token_ids

    def broken(ev):  # a bug met by one request's input only
        if ev.messages and ev.messages[0].content == "poison":
            raise RuntimeError("tokenizer bug")
        return token_ids(ev)

    monkeypatch.setattr(tokenizer.pre, "token_ids", broken)
    tokenizer.tick()
    assert [_state(redis_client, names, r) for r in rids] == ["PREPROCESSED", "FAILED", "PREPROCESSED"]
    ending = _ending(redis_client, names, rids[1])
    assert ending.reason == "internal" and "tokenizer bug" in ending.message
    assert redis_client.xpending(names.received_stream(0), GROUP_TOKENIZER)["pending"] == 0


def test_with_tracing_on_a_chat_template_refusal_is_answered_at_once(
    tokenizer, redis_server, redis_client, names, monkeypatch
):
    monkeypatch.setattr(telemetry, "enabled", lambda: True)  # each request in its own spans: the per-request path
    rids = submit(redis_server, names, [TWO_USERS, GOOD])
    tokenizer.tick()  # (this left the refused one pending, to be retried and dead-lettered as internal)
    assert [_state(redis_client, names, r) for r in rids] == ["FAILED", "PREPROCESSED"]
    assert _ending(redis_client, names, rids[0]).reason == "invalid"
    assert redis_client.xpending(names.received_stream(0), GROUP_TOKENIZER)["pending"] == 0
