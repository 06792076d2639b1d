"""API keys: with keys set, every endpoint but the probes (/health, /ready) wants one, and a request is visible only
to its own key."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.support.cluster import KEY_A, KEY_B, auth as _auth
from tests.support.openai_fixtures import MODEL, openai_client, request_id

SMALL = {"model": MODEL, "prompt": "Hello", "max_tokens": 2, "temperature": 0}


def test_missing_key_is_401_in_openai_shape(keyed_cluster):
    r = httpx.post(f"{keyed_cluster.url}/v1/completions", json=SMALL, timeout=30)
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    err = r.json()["error"]
    assert err["code"] == "missing_api_key" and set(err) == {"message", "type", "param", "code"}


def test_wrong_key_raises_the_clients_authentication_error(keyed_cluster):
    with pytest.raises(openai.AuthenticationError) as e:
        openai_client(keyed_cluster.url, api_key="not-a-key").completions.create(**SMALL)
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"


@pytest.mark.parametrize(
    "method, path",
    [
        ("GET", "/v1/models"),
        ("POST", "/generate"),
        ("GET", "/v1/requests/" + "0" * 32),
        ("GET", "/openapi.json"),
    ],
)
def test_every_endpoint_but_the_probes_wants_a_key(keyed_cluster, method, path):
    assert httpx.request(method, f"{keyed_cluster.url}{path}", timeout=30).status_code == 401


def test_the_probes_answer_without_a_key(keyed_cluster):
    assert httpx.get(f"{keyed_cluster.url}/health", timeout=30).status_code == 200
    ready = httpx.get(f"{keyed_cluster.url}/ready", timeout=30)
    assert ready.status_code == 200 and ready.json()["status"] == "ready"


def test_right_key_is_served(keyed_cluster):
    out = openai_client(keyed_cluster.url, api_key=KEY_B).completions.create(**SMALL)
    assert out.choices[0].finish_reason in ("stop", "length")


def test_a_request_is_visible_and_cancellable_only_by_its_own_key(keyed_cluster):
    out = openai_client(keyed_cluster.url, api_key=KEY_A).completions.create(**SMALL)
    rid = request_id(out.id)
    assert httpx.get(f"{keyed_cluster.url}/v1/requests/{rid}", headers=_auth(KEY_A), timeout=10).status_code == 200
    assert httpx.get(f"{keyed_cluster.url}/v1/requests/{out.id}", headers=_auth(KEY_A), timeout=10).status_code == 200
    other = httpx.get(f"{keyed_cluster.url}/v1/requests/{rid}", headers=_auth(KEY_B), timeout=10)
    assert other.status_code == 404 and other.json()["error"]["code"] == "not_found"
    assert httpx.delete(f"{keyed_cluster.url}/v1/requests/{rid}", headers=_auth(KEY_B), timeout=10).status_code == 404
    snap = httpx.get(f"{keyed_cluster.url}/v1/requests/{rid}", headers=_auth(KEY_A), timeout=10).json()
    assert snap["meta"]["owner"] and KEY_A not in str(snap)  # recorded by a hash, never the key itself


def test_gateway_without_keys_warns_at_start(caplog):
    from services.gateway.app import create_app
    from shared.settings import GatewaySettings

    create_app(GatewaySettings(api_keys=[KEY_A]))
    assert "no API keys are set" not in caplog.text
    create_app(GatewaySettings(api_keys=[]))
    assert any(r.levelname == "WARNING" and "no API keys are set" in r.message for r in caplog.records)
