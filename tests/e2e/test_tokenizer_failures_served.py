"""A chat template's refusal through the whole cluster: the client gets a 400 naming the field while the requests read
in the same batch are served (the tokenizer service in process: tests/redis/test_tokenizer_failures.py)."""

from __future__ import annotations

import asyncio
import signal

import httpx

from tests.redis import test_tokenizer_failures as in_process
from tests.support.sim_reference import SIM
from tests.support.waiting import wait_for

ALTERNATE, GOOD, TWO_USERS = in_process.ALTERNATE, in_process.GOOD, in_process.TWO_USERS
refusing_model = in_process.refusing_model  # the fixture: the bundled model with a template that refuses


def test_a_chat_template_refusal_is_answered_400_while_its_batch_mates_are_served(start_cluster, refusing_model):
    """End to end: the client gets a 400 naming the field and what the template said; the requests read in the
    same batch are answered 200; the tokenizer process lives on."""
    c = start_cluster(env={**SIM, "CONVEYOR_MODEL": str(refusing_model)})
    try:
        r = c.client()
        tok = c.procs["tokenizer"]
        tok.send_signal(signal.SIGSTOP)  # the four wait on its stream, to be read in one batch

        async def send():
            async with httpx.AsyncClient(base_url=c.url, timeout=120) as http:
                bodies = [
                    {"messages": [{"role": ro, "content": co} for ro, co in chat], "max_tokens": 2}
                    for chat in (GOOD, TWO_USERS, GOOD, GOOD)
                ]
                return await asyncio.gather(*[http.post("/generate", json=b) for b in bodies])

        async def run():
            task = asyncio.create_task(send())
            await asyncio.to_thread(
                wait_for,
                lambda: r.xlen(c.names.received_stream(0)) >= 4,
                30,
                0.05,
                "the four requests on the tokenizer's stream",
            )
            tok.send_signal(signal.SIGCONT)
            return await task

        answers = asyncio.run(run())
        assert [a.status_code for a in answers] == [200, 400, 200, 200], [a.text for a in answers]
        err = answers[1].json()["error"]
        assert err["param"] == "messages" and ALTERNATE in err["message"] and err["type"] == "invalid_request_error"
        assert tok.poll() is None, c.logs("tokenizer")
    finally:
        c.procs["tokenizer"].send_signal(signal.SIGCONT)  # so that it stops when the cluster does
