"""The dashboard in a real browser (issue 14): headless Chromium against a cluster of real processes (simulated
worker). Screenshots are saved under tests/artifacts/dashboard/ (the path is printed)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.support.browser import headless_page, unavailable_reason
from tests.support.cluster import KEY_A, Cluster, cluster_fixture
from tests.support.cluster import auth as _auth
from tests.e2e.test_dashboard_api import _submit

ARTIFACTS = Path(__file__).parents[1] / "artifacts" / "dashboard"
WAIT_MS = 30_000


@pytest.fixture(scope="module")
def page():
    if reason := unavailable_reason():
        pytest.skip(reason)
    try:
        with headless_page() as p:
            yield p
    except RuntimeError as e:
        pytest.skip(str(e))


cluster = cluster_fixture(
    "dashboard-browser",
    Cluster,
    env={
        "CONVEYOR_API_KEYS": KEY_A,
        "CONVEYOR_ENGINE": "sim",
        "CONVEYOR_TRACE_URL_TEMPLATE": "http://127.0.0.1:16686/trace/{trace_id}",
    },
)


def _shot(page, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    print(f"screenshot: {path}")


def _log_in(page, url: str, key: str) -> None:
    """As a person does: the page's login form (no key is taken from the address)."""
    page.context.clear_cookies()
    page.goto(f"{url}/dashboard")
    page.fill("#login-key", key)
    page.click("#login button[type=submit]")


def _row_state(rid: str) -> str:
    return f'#rows .row[data-rid="{rid}"] .state'


def test_page_shows_requests_live_opens_a_timeline_and_cancels_one(page, cluster):
    _log_in(page, cluster.url, KEY_A)
    page.wait_for_selector("#conn.on", timeout=WAIT_MS)
    page.evaluate("window.__sameLoad = true")  # gone if anything reloads the page
    reqs = [_submit(cluster, KEY_A, max_tokens=600) for _ in range(3)]
    short = _submit(cluster, KEY_A, max_tokens=4)
    for r in reqs:  # the rows appear and move on to DECODING without a reload
        page.wait_for_selector(_row_state(r["rid"]), timeout=WAIT_MS)
        page.wait_for_function(
            f"document.querySelector('{_row_state(r['rid'])}')?.textContent === 'DECODING'", timeout=WAIT_MS
        )
    assert page.evaluate("window.__sameLoad") is True
    page.wait_for_selector(".worker", timeout=WAIT_MS)  # the workers' figures arrived
    _shot(page, "1-table")

    page.select_option("#filter", "FINISHED")  # ended requests are under their own filters
    page.wait_for_function(
        f"document.querySelector('{_row_state(short['rid'])}')?.textContent === 'FINISHED'", timeout=WAIT_MS
    )
    page.select_option("#filter", "DECODING")  # the filter shows only that state
    page.wait_for_function(
        "[...document.querySelectorAll('#rows .state')].every(s => s.textContent === 'DECODING')"
        " && document.querySelectorAll('#rows .state').length === 3",
        timeout=WAIT_MS,
    )
    page.select_option("#filter", "")

    victim = reqs[0]["rid"]
    page.click(f'#rows .row[data-rid="{victim}"]')
    page.wait_for_selector("#detail:not([hidden]) #timeline .bar >> nth=4", timeout=WAIT_MS)
    labels = page.locator("#timeline .label").all_text_contents()
    assert [x.split(" ·")[0] for x in labels][:5] == ["RECEIVED", "PREPROCESSED", "QUEUED", "SCHEDULED", "PREFILLING"]
    assert "by scheduler" in labels[3]
    assert page.get_attribute("#detail-trace", "href").startswith("http://127.0.0.1:16686/trace/")
    _shot(page, "2-timeline")

    page.click("#detail-cancel")
    page.wait_for_function("document.querySelector('#detail-state')?.textContent === 'CANCELLED'", timeout=WAIT_MS)
    page.select_option("#filter", "CANCELLED")
    page.wait_for_function(
        f"document.querySelector('{_row_state(victim)}')?.textContent === 'CANCELLED'", timeout=WAIT_MS
    )
    _shot(page, "3-cancelled")
    state = httpx.get(f"{cluster.url}/v1/requests/{victim}", headers=_auth(KEY_A), timeout=10).json()["state"]
    assert state == "CANCELLED"
    for r in reqs[1:]:
        httpx.delete(f"{cluster.url}/v1/requests/{r['rid']}", headers=_auth(KEY_A), timeout=10)


def test_rows_that_appear_below_the_screen_get_their_token_counts(page, cluster):
    """More new requests than the table shows at once: each row's prompt length arrives, seen or not (with many in
    flight the list slides past the screen, and a row asked about only while on screen could stay blank)."""
    _log_in(page, cluster.url, KEY_A)
    page.wait_for_selector("#conn.on", timeout=WAIT_MS)
    rows_on_screen = page.evaluate("Math.ceil(document.getElementById('scroller').clientHeight / ROW_H)")
    reqs = [_submit(cluster, KEY_A, max_tokens=600) for _ in range(2 * rows_on_screen + 10)]
    rids = [r["rid"] for r in reqs]
    try:
        page.wait_for_function(f"{rids}.every(id => S.rows.get(id)?.prompt > 0)", timeout=WAIT_MS)
        # and the rows on screen go on being refreshed: their output counts grow
        page.wait_for_function("S.order.slice(0, 5).every(r => r.output > 0)", timeout=WAIT_MS)
    finally:
        _shot(page, "4-many-rows")
        for rid in rids:
            httpx.delete(f"{cluster.url}/v1/requests/{rid}", headers=_auth(KEY_A), timeout=10)


def test_the_login_form_says_when_a_key_is_wrong(page, cluster):
    _log_in(page, cluster.url, "not-a-key")
    page.wait_for_function(
        "document.getElementById('login-error').textContent.includes('invalid API key')", timeout=WAIT_MS
    )
    assert page.is_visible("#login") and not page.context.cookies()


def test_the_workers_line_counts_the_sessions_paused_on_them(page, cluster):
    _log_in(page, cluster.url, KEY_A)
    page.wait_for_selector(".worker", timeout=WAIT_MS)
    body = {"prompt": "Keep this conversation going " * 8, "max_tokens": 4, "session_id": "dash-1"}  # full blocks
    assert httpx.post(f"{cluster.url}/generate", json=body, headers=_auth(KEY_A), timeout=60).status_code == 200
    page.wait_for_function(
        "[...document.querySelectorAll('.worker .sessions')].some(s => Number(s.textContent) >= 1)", timeout=WAIT_MS
    )
    _shot(page, "4-sessions")
    httpx.delete(f"{cluster.url}/v1/sessions/dash-1", headers=_auth(KEY_A), timeout=10)


def test_a_turns_row_shows_its_session_paused_then_closed_from_the_feed(page, cluster):
    _log_in(page, cluster.url, KEY_A)
    page.wait_for_selector(".worker", timeout=WAIT_MS)
    page.select_option("#filter", "ended")  # the turn has ended: its row is under the ended filter
    body = {"prompt": "Keep this conversation going " * 8, "max_tokens": 4, "session_id": "dash-2"}  # full blocks
    assert httpx.post(f"{cluster.url}/generate", json=body, headers=_auth(KEY_A), timeout=60).status_code == 200
    shows = "[...document.querySelectorAll('#rows .session')].some(s => s.textContent === 'dash-2 %s')"
    page.wait_for_function(shows % "PAUSED", timeout=WAIT_MS)
    _shot(page, "5-session-paused")
    assert httpx.delete(f"{cluster.url}/v1/sessions/dash-2", headers=_auth(KEY_A), timeout=10).status_code == 200
    page.wait_for_function(shows % "CLOSED", timeout=WAIT_MS)
