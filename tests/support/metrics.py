"""A gateway's /metrics read back as numbers."""

from __future__ import annotations

import httpx


def scrape(url: str) -> dict[str, float]:
    """{sample name with its labels: value} of every sample at url/metrics."""
    out = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out
