"""`RouterAdmin`: the router's admin API for operators and orchestrators, synchronous and typed.

What a cluster's watcher, a weight sync or a chaos driver asks of the router, outside any event
loop: the slots (`GET /workers`), the counters (`GET /metrics`, parsed here, beside the code that
renders them), taking a slot out of service, and the weight-version barrier. Errors are typed: an
answer with an error status is `RouterClientError` (``status``), no answer `RouterUnreachableError`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from types import TracebackType
from typing import Any, Self

import attrs
import httpx

from belayer_router._errors import RouterClientError, RouterUnreachableError
from belayer_router._wire._protocol import CLIENT_KEEP_ALIVE_S

__all__ = ["RouterAdmin", "RouterCounters", "RouterWorkers", "SlotState"]

_SAMPLE = re.compile(r'^belayer_router_(\w+)(?:\{slot="([^"]*)"\})?\s+(\S+)$')


@attrs.frozen
class SlotState:
    """One slot as the router sees it (`GET /workers`)."""

    slot: str
    url: str | None  # its active worker's, None without one
    epoch: int | None  # its active worker's
    link: bool  # the worker serves the multiplexed link
    max_epoch: int
    healthy: bool
    num_outstanding: int  # worker streams open now
    weight_version: int | None  # the committed version it reported, None before any
    current: bool  # at the required weight version (or no version is required)
    num_stream_failures: int  # streams that broke on the worker's side (not the router's own cuts)
    last_stream_failure_at: float | None  # time.time() of the last one
    unhealthy_since: float | None = None  # time.time() it was marked unhealthy
    vacant_since: float | None = None  # time.time() its worker was unregistered (none since)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SlotState:
        """A slot of the ``GET /workers`` answer (`RouterClientError` 502 if it is malformed)."""
        try:
            last = data.get("last_stream_failure_at")
            unhealthy, vacant = data.get("unhealthy_since"), data.get("vacant_since")
            return cls(
                slot=str(data["slot"]),
                url=None if data.get("url") is None else str(data["url"]),
                epoch=None if data.get("epoch") is None else int(data["epoch"]),
                link=bool(data.get("link", False)),
                max_epoch=int(data.get("max_epoch") or 0),
                healthy=bool(data["healthy"]),
                num_outstanding=int(data.get("num_outstanding") or 0),
                weight_version=None if data.get("weight_version") is None else int(data["weight_version"]),
                current=bool(data.get("current", True)),
                num_stream_failures=int(data.get("num_stream_failures") or 0),
                last_stream_failure_at=None if last is None else float(last),
                unhealthy_since=None if unhealthy is None else float(unhealthy),
                vacant_since=None if vacant is None else float(vacant),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise RouterClientError(
                502, f"GET /workers gave a malformed slot ({exc!r}): {dict(data)!r}"
            ) from exc


@attrs.frozen
class RouterWorkers:
    """The ``GET /workers`` answer: every slot, and the weight version new tokens must come from."""

    slots: tuple[SlotState, ...]
    required_version: int | None

    def slot(self, name: str) -> SlotState | None:
        """The slot called ``name``, None if the router does not know it."""
        return next((s for s in self.slots if s.slot == name), None)


@attrs.frozen
class RouterCounters:
    """The router's counters and gauges (`GET /metrics`), by name without ``belayer_router_``.

    The totals every caller reads are fields; `values` has every unlabelled sample and
    `per_slot` every sample labelled with a slot (``slot_outstanding``, ``slot_healthy``, ...).
    """

    requests_total: float = 0.0
    requests_failed_total: float = 0.0
    tokens_total: float = 0.0
    resumes_total: float = 0.0
    handovers_total: float = 0.0
    tokens_regenerated_total: float = 0.0
    values: Mapping[str, float] = attrs.field(factory=dict)
    per_slot: Mapping[str, Mapping[str, float]] = attrs.field(factory=dict)

    @classmethod
    def parse(cls, text: str) -> RouterCounters:
        """The counters of a ``/metrics`` page (Prometheus text); lines of other exporters are skipped."""
        values: dict[str, float] = {}
        per_slot: dict[str, dict[str, float]] = {}
        for line in text.splitlines():
            match = _SAMPLE.match(line.strip())
            if match is None:
                continue
            name, slot, raw = match.groups()
            try:
                value = float(raw)
            except ValueError:
                continue
            if not math.isfinite(value):
                continue
            if slot is None:
                values[name] = value
            else:
                per_slot.setdefault(name, {})[slot] = value
        fields = {f.name for f in attrs.fields(cls)} - {"values", "per_slot"}
        return cls(**{k: v for k, v in values.items() if k in fields}, values=values, per_slot=per_slot)


class RouterAdmin:
    """The router's admin API from a thread (``with RouterAdmin(url, admin_token) as admin:``).

    ``timeout_s`` bounds each call. Every call raises `RouterUnreachableError` when the router
    does not answer and `RouterClientError` (``status``) when it answers with an error status; a
    slot the router does not know is ``False`` where that is an expected answer (a slot never
    registered serves nothing).
    """

    def __init__(self, url: str, admin_token: str | None = None, *, timeout_s: float = 30.0) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0 (got {timeout_s!r})")
        self.url = url.rstrip("/")
        headers = {} if admin_token is None else {"Authorization": f"Bearer {admin_token}"}
        limits = httpx.Limits(keepalive_expiry=CLIENT_KEEP_ALIVE_S)
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout_s, limits=limits)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()

    def _call(self, method: str, path: str, body: Any = None) -> httpx.Response:
        try:
            response = self._http.request(method, path, json=body)
        except httpx.TransportError as exc:
            raise RouterUnreachableError(
                f"the router at {self.url} did not answer {method} {path}: {exc!r}; it may be restarting, "
                "try again"
            ) from exc
        if response.status_code >= 400:
            try:
                message = str(response.json()["error"]["message"])
            except (ValueError, KeyError, TypeError):
                message = response.text[:500] or response.reason_phrase
            hint = " (check the admin token)" if response.status_code in (401, 403) else ""
            raise RouterClientError(response.status_code, f"{method} {path}: {message}{hint}")
        return response

    def workers(self) -> RouterWorkers:
        """Every slot with its worker, health, open streams, broken streams and weight version."""
        try:
            data = self._call("GET", "/workers").json()
            slots, required = data["slots"], data["required_version"]
            return RouterWorkers(
                tuple(SlotState.from_json(s) for s in slots), None if required is None else int(required)
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise RouterClientError(502, f"GET /workers gave a malformed answer ({exc!r})") from exc

    def counters(self) -> RouterCounters:
        """The router's counters and gauges."""
        return RouterCounters.parse(self._call("GET", "/metrics").text)

    def mark_unhealthy(self, slot: str) -> bool:
        """Take ``slot`` out of service for good (its requests resume on the healthy slots);
        False when the router does not know the slot (never registered: it serves nothing)."""
        return self._known("POST", f"/slots/{slot}/unhealthy")

    def report_weight_version(self, slot: str, version: int) -> bool:
        """Record that ``slot`` committed weight ``version``; False for a slot the router does not
        know. A version lower than the slot's is `RouterClientError` 409."""
        return self._known("POST", f"/slots/{slot}/weights", {"version": version})

    def require_weight_version(self, version: int) -> None:
        """Serve new tokens from slots at ``version`` only (the others are held out until they
        report it); the required version only moves forward (a lower one: `RouterClientError` 409)."""
        self._call("POST", "/weights/required", {"version": version})

    def _known(self, method: str, path: str, body: Any = None) -> bool:
        try:
            self._call(method, path, body)
        except RouterClientError as exc:
            if exc.status == 404:
                return False
            raise
        return True
