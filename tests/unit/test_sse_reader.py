"""The tests' SSE reader: a record is found whichever event carried it (the dashboard batches its feed)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.support.sse_reader import SseReader

pytestmark = pytest.mark.unit


class _OneBatch(BaseHTTPRequestHandler):
    """Sends one `feed` event holding two records of one request, as the gateway does when two moves land in one
    flush, then keeps the stream open until the client goes."""

    def do_GET(self):  # noqa: N802 (http.server's name)
        batch = [{"rid": "r1", "to": "RECEIVED", "at": 1.0}, {"rid": "r1", "to": "QUEUED", "at": 1.1}]
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        self.wfile.write(f"event: feed\ndata: {json.dumps(batch)}\n\n".encode())
        self.wfile.flush()

    def log_message(self, *args):
        return  # no access log on the test's output


def test_records_carried_by_one_event_are_each_found():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _OneBatch)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    reader = SseReader(f"http://127.0.0.1:{server.server_port}/")
    try:
        assert reader.record("r1", "RECEIVED", timeout=5)[1]["to"] == "RECEIVED"
        assert reader.record("r1", "QUEUED", timeout=2)[1]["to"] == "QUEUED"
    finally:
        reader.close()
        server.shutdown()
