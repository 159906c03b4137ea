"""What the trainer reads of the router on Ray: its counters and a slot's requests in flight."""

from __future__ import annotations

import re

import httpx

__all__ = ["metrics", "outstanding"]

_METRIC = re.compile(r"^belayer_router_(\w+)\s+([0-9.eE+-]+)$")


def metrics(url: str) -> dict[str, float]:
    """The router's counters (`/metrics`), by name without the prefix; {} when it does not answer."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=10.0).text
    except httpx.HTTPError:
        return {}
    found = {}
    for line in text.splitlines():
        match = _METRIC.match(line.strip())
        if match:
            found[match.group(1)] = float(match.group(2))
    return found


def outstanding(url: str, token: str, slot: str) -> int:
    """The requests in flight on ``slot`` (`/workers`); 0 when the router does not answer."""
    try:
        answer = httpx.get(f"{url}/workers", headers={"Authorization": f"Bearer {token}"}, timeout=10.0)
        return sum(int(w["num_outstanding"]) for w in answer.json()["slots"] if w["slot"] == slot)
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return 0
