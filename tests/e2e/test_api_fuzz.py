"""API fuzzing: schemathesis sends bodies generated from the gateway's own OpenAPI document (valid and
invalid) to every operation; no answer may be a 5xx, and every answer must match the document
(status, content type, headers, body schema)."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.support.cluster import cluster_fixture
from tests.support.openai_fixtures import MODEL
from tests.support.sim_reference import SIM

# Examples per mode, spread over every operation; valid ones that reach a worker run (on the simulated engine).
EXAMPLES = {GenerationMode.POSITIVE: 25, GenerationMode.NEGATIVE: 50}
SHORT_TIMEOUT_S = 10.0  # a fuzzed timeout below this may really expire on a busy test machine
MAX_TOKENS = 2  # generated requests that pass validation are really run: keep each one short


@schemathesis.check
def no_server_error(ctx, response, case):
    """not_a_server_error, except the 504 a request earns by asking for a timeout shorter than its work."""
    body = case.body if isinstance(case.body, dict) else {}
    asked = body.get("timeout")
    if response.status_code == 504 and isinstance(asked, (int, float)) and asked < SHORT_TIMEOUT_S:
        return None
    return not_a_server_error(ctx, response, case)


CHECKS = [
    no_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]


fuzzed = cluster_fixture(
    "fuzz", env={**SIM, "CONVEYOR_MAX_TOKENS_LIMIT": str(MAX_TOKENS), "CONVEYOR_DEFAULT_MAX_TOKENS": str(MAX_TOKENS)}
)


@pytest.fixture(scope="module")
def api_schema(fuzzed):
    """The document the running gateway serves (what a client generator would read)."""
    return schemathesis.openapi.from_url(f"{fuzzed.url}/openapi.json")


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=["valid", "invalid"])
def test_no_server_error_and_every_answer_matches_the_schema(api_schema, mode):
    @given(case=api_schema.as_strategy(generation_mode=mode))
    @settings(
        max_examples=EXAMPLES[mode],
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def fuzz(case):
        if isinstance(case.body, dict) and isinstance(case.body.get("model"), str):
            # A random model name is a 404 at once; name the served model so generation itself is fuzzed too.
            case.body["model"] = MODEL
        case.call_and_validate(checks=CHECKS, timeout=120)

    fuzz()
