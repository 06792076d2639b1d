"""A real OTLP/HTTP receiver standing in for Jaeger in the compose test (no Jaeger image can be had here).

Runs inside Conveyor's image (it has opentelemetry-proto) as the `jaeger` service, on Jaeger's ports: POST
:4318/v1/traces takes ExportTraceServiceRequest protobuf (gzip or not) as Jaeger's OTLP receiver does; GET
:16686/spans lists what arrived as JSON ({service, name, trace_id}), for the test on the host to read.
Standalone on purpose: it is mounted into the container alone, without the rest of tests/.
"""

from __future__ import annotations

import gzip
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

SPANS: list[dict] = []
LOCK = threading.Lock()


def _decode(body: bytes) -> list[dict]:
    req = ExportTraceServiceRequest()
    req.ParseFromString(body)
    out = []
    for rs in req.resource_spans:
        attrs = {kv.key: kv.value.string_value for kv in rs.resource.attributes}
        for ss in rs.scope_spans:
            out += [
                {"service": attrs.get("service.name", ""), "name": sp.name, "trace_id": sp.trace_id.hex()}
                for sp in ss.spans
            ]
    return out


class Handler(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 (http.server's name)
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        spans = _decode(body)
        with LOCK:
            SPANS.extend(spans)
        self._answer(200, "application/x-protobuf", ExportTraceServiceResponse().SerializeToString())

    def do_GET(self):  # noqa: N802
        with LOCK:
            body = json.dumps(SPANS).encode()
        self._answer(200, "application/json", body)

    def _answer(self, status: int, ctype: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:  # one line per export would drown the container's log
        return None


if __name__ == "__main__":
    servers = [ThreadingHTTPServer(("0.0.0.0", port), Handler) for port in (4318, 16686)]
    threading.Thread(target=servers[1].serve_forever, daemon=True).start()
    servers[0].serve_forever()
