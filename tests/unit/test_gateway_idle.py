"""A request waiting for output costs its gateway nothing until something happens (issue 12): no periodic poll of
its client (5,000 waiting streams polled every half second cost the gateway half its time), and a client that
leaves is still noticed at once."""

from __future__ import annotations

import asyncio
import time


from services.gateway.session.handle import RequestHandle
from services.gateway.session.drive import drive
from services.gateway.text.stop_strings import TextStream
from shared.wire.events import Cancelled
from tests.support.factories import completed

TIMEOUT_S = 60.0


class Client:
    """The ASGI side of one request whose body was read: receive() answers only when the client leaves."""

    def __init__(self):
        self.gone = asyncio.Event()

    async def receive(self) -> dict:
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def is_disconnected(self) -> bool:
        return self.gone.is_set()


class Core:
    def __init__(self):
        self.cancelled = asyncio.Event()
        self.reasons: list[str] = []

    async def cancel(self, request_id: str, reason: str, reply_to: str, traceparent: str = "") -> bool:
        self.reasons.append(reason)
        self.cancelled.set()
        return True


def handle_for(tokenizer) -> RequestHandle:
    return RequestHandle("r", "reply", TextStream(tokenizer), time.time() + TIMEOUT_S, time.perf_counter())


def test_a_waiting_request_sleeps_until_its_deadline_backstop_instead_of_polling(tokenizer):
    async def main():
        handle, waits = handle_for(tokenizer), []
        next_chunk = handle.next_chunk

        async def recording(timeout: float):
            waits.append(timeout)
            return await next_chunk(timeout)

        handle.next_chunk = recording
        handle.deliver(completed("r", "length", prompt_tokens=1, output_tokens=0, worker_id="w"))
        chunks = [c async for c in drive(Core(), handle, Client())]
        assert chunks[-1].end is not None
        return waits

    waits = asyncio.run(main())
    assert waits[0] > TIMEOUT_S - 5  # until the deadline (and its grace): no wakeup every half second


def test_a_client_leaving_while_its_request_waits_cancels_it_at_once(tokenizer):
    async def main():
        handle, core, client = handle_for(tokenizer), Core(), Client()
        chunks = drive(core, handle, client)
        first = asyncio.ensure_future(chunks.__anext__())
        await asyncio.sleep(0)  # it waits for output now
        client.gone.set()
        async with asyncio.timeout(5):
            await core.cancelled.wait()
        handle.deliver(Cancelled(request_id="r", reason="client_disconnect", service="gateway"))
        async with asyncio.timeout(5):
            end = await first
        await chunks.aclose()
        return core.reasons, end

    reasons, end = asyncio.run(main())
    assert reasons == ["client_disconnect"] and isinstance(end.end, Cancelled)
