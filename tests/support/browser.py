"""A headless Chromium for the tests and benchmarks that look at the dashboard: Debian's `chromium`, driven by
Playwright's Python API (no `playwright install`: the browser is the system's, `make test` installs it)."""

from __future__ import annotations

import shutil
from contextlib import contextmanager
from typing import Iterator

CANDIDATES = ("chromium", "chromium-browser")


def chromium_path() -> str | None:
    for name in CANDIDATES:
        if found := shutil.which(name):
            return found
    return None


def unavailable_reason() -> str | None:
    """Why no browser test can run here (None: it can)."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError as e:
        return f"playwright is not installed ({e}): pip install -e '.[test]'"
    if chromium_path() is None:
        return "no chromium on PATH: apt-get install chromium (make test does it)"
    return None


@contextmanager
def headless_page(width: int = 1440, height: int = 960) -> Iterator:
    """A page of a fresh headless Chromium; raises RuntimeError with the reason if it cannot start."""
    from playwright.sync_api import Error, sync_playwright

    with sync_playwright() as p:
        try:
            # --no-sandbox: the test may run as root (a container), where Chromium's sandbox refuses to start.
            browser = p.chromium.launch(
                executable_path=chromium_path(), headless=True, args=["--no-sandbox", "--disable-dev-shm-usage"]
            )
        except Error as e:
            raise RuntimeError(f"chromium at {chromium_path()} could not be launched: {e}") from e
        try:
            yield browser.new_page(viewport={"width": width, "height": height})
        finally:
            browser.close()
