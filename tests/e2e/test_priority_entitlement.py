"""A priority more urgent than CONVEYOR_PRIORITY_FLOOR is an entitlement of admin keys: another key's request is
clamped to the floor (it would otherwise starve every other key until their timeouts), never refused."""

from __future__ import annotations

import httpx
import pytest

from tests.support.cluster import ADMIN, KEY_A, auth as _auth

SMALL = {"prompt": "Hello", "max_tokens": 2, "temperature": 0}


def _priority(url: str, key: str | None, priority: int, path: str = "/generate") -> int:
    headers = _auth(key) if key else {}
    body = {**SMALL, "priority": priority, **({"model": "SmolLM2-135M-Instruct"} if path != "/generate" else {})}
    r = httpx.post(f"{url}{path}", json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    rid = r.json().get("request_id") or r.json()["id"].split("-", 1)[1]
    meta = httpx.get(f"{url}/v1/requests/{rid}", headers=_auth(ADMIN) if key else {}, timeout=10).json()["meta"]
    return meta["priority"]


@pytest.mark.parametrize("path", ["/generate", "/v1/completions"])
def test_a_plain_keys_urgent_priority_is_clamped_to_the_floor(keyed_cluster, path):
    assert _priority(keyed_cluster.url, KEY_A, -1000, path) == 0


def test_a_plain_key_may_lower_its_own_priority(keyed_cluster):
    assert _priority(keyed_cluster.url, KEY_A, 50) == 50


def test_an_admin_key_may_ask_for_any_priority(keyed_cluster):
    assert _priority(keyed_cluster.url, ADMIN, -1000) == -1000


def test_without_api_keys_every_caller_may_ask_for_any_priority(sim_cluster):
    assert _priority(sim_cluster.url, None, -1000) == -1000
