"""Router counters and gauges, rendered in the Prometheus text exposition format."""

from __future__ import annotations

import attrs

from belayer_router._core._registry import Registry

__all__ = ["Metrics"]


@attrs.define
class Metrics:
    """Counters the router bumps as it works; gauges are read from the registry at render time."""

    num_requests: int = 0
    num_requests_failed: int = 0
    num_tokens: int = 0
    num_resumes: int = 0
    num_tokens_regenerated: int = 0
    num_stale_events: int = 0
    num_version_resumes: int = 0
    num_pause_resumes: int = 0  # streams cut by /pause?mode=keep, continued after /resume
    num_weight_updates: int = 0  # weight folders loaded through the control plane
    num_in_flight: int = 0
    num_waiting: int = 0
    num_client_links: int = 0  # open ``POST /client-link`` connections

    def render(self, registry: Registry) -> str:
        """The whole ``/metrics`` page."""
        lines: list[str] = []

        def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
            lines.append(f"# HELP belayer_router_{name} {help_text}")
            lines.append(f"# TYPE belayer_router_{name} {kind}")
            lines.extend(f"belayer_router_{name}{labels} {value:g}" for labels, value in samples)

        metric("requests_total", "counter", "Generation requests accepted.", [("", self.num_requests)])
        metric(
            "requests_failed_total",
            "counter",
            "Requests that ended with an error.",
            [("", self.num_requests_failed)],
        )
        metric("tokens_total", "counter", "Tokens streamed to clients.", [("", self.num_tokens)])
        metric("resumes_total", "counter", "Interrupted worker streams resumed.", [("", self.num_resumes)])
        metric(
            "handovers_total",
            "counter",
            "Registrations that replaced a lower-epoch worker.",
            [("", registry.num_handovers)],
        )
        metric(
            "tokens_regenerated_total",
            "counter",
            "Tokens generated again because they were not in the preserved prefix.",
            [("", self.num_tokens_regenerated)],
        )
        metric(
            "stale_events_total",
            "counter",
            "Worker events refused because of a stale epoch.",
            [("", self.num_stale_events)],
        )
        metric(
            "version_resumes_total",
            "counter",
            "Streams cut because their slot's weight version was not the required one, resumed.",
            [("", self.num_version_resumes)],
        )
        metric(
            "pause_resumes_total",
            "counter",
            "Streams cut by a pause in keep mode, continued after the resume.",
            [("", self.num_pause_resumes)],
        )
        metric(
            "weight_updates_total",
            "counter",
            "Weight folders loaded into every slot (POST /update_weights, /update_weights_from_disk).",
            [("", self.num_weight_updates)],
        )
        metric(
            "paused",
            "gauge",
            "1 while generation is paused (POST /pause).",
            [("", int(registry.paused is not None))],
        )
        if registry.required_version is not None:
            metric(
                "required_weight_version",
                "gauge",
                "The weight version new tokens must come from.",
                [("", registry.required_version)],
            )
        metric("requests_in_flight", "gauge", "Requests being served.", [("", self.num_in_flight)])
        metric(
            "requests_waiting",
            "gauge",
            "Requests waiting for a worker (queue).",
            [("", self.num_waiting)],
        )
        metric(
            "client_links", "gauge", "Open client links (POST /client-link).", [("", self.num_client_links)]
        )
        slots = sorted(registry.slots.values(), key=lambda s: s.name)
        metric(
            "slot_outstanding",
            "gauge",
            "Outstanding worker streams per slot.",
            [(f'{{slot="{s.name}"}}', s.num_outstanding) for s in slots],
        )
        metric(
            "slot_healthy",
            "gauge",
            "1 if the slot is healthy.",
            [(f'{{slot="{s.name}"}}', int(s.healthy)) for s in slots],
        )
        metric(
            "slot_epoch",
            "gauge",
            "Highest epoch registered per slot.",
            [(f'{{slot="{s.name}"}}', s.max_epoch) for s in slots],
        )
        metric(
            "slot_stream_failures_total",
            "counter",
            "Streams per slot that broke on the worker's side (not the router's own cuts).",
            [(f'{{slot="{s.name}"}}', s.num_stream_failures) for s in slots],
        )
        metric(
            "slot_weight_version",
            "gauge",
            "Committed weight version per slot (slots that reported one).",
            [(f'{{slot="{s.name}"}}', s.weight_version) for s in slots if s.weight_version is not None],
        )
        return "\n".join(lines) + "\n"
