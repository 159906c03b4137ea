"""`RouterAdmin`: the typed, synchronous admin client (slots, counters, the weight-version barrier)
against a real router and workers, and its typed errors."""

from __future__ import annotations

import socket

import anyio
import pytest
from router_helpers import ADMIN_TOKEN

from belayer_router import (
    RouterAdmin,
    RouterClient,
    RouterClientError,
    RouterConfig,
    RouterCounters,
    RouterUnreachableError,
    running_router,
)
from belayer_router.testing import expected_tokens, running_worker

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("http_server")]  # on both servers


async def test_the_admin_client_reads_slots_and_counters_and_moves_the_weight_barrier() -> None:
    config = RouterConfig(admin_token=ADMIN_TOKEN)
    async with (
        running_worker(1) as (url_a, _),
        running_worker(1) as (url_b, _),
        running_router(config) as (router_url, _app),
        RouterClient(router_url, admin_token=ADMIN_TOKEN) as client,
    ):
        await client.register("a", url_a, 1)
        await client.register("b", url_b, 3)
        done = await client.generate([1, 2], 12, seed=5)
        assert done.token_ids == expected_tokens(5, 12)

        def admin_calls() -> None:
            with RouterAdmin(router_url, ADMIN_TOKEN) as admin:
                workers = admin.workers()
                assert [s.slot for s in workers.slots] == ["a", "b"]
                assert workers.required_version is None
                b = workers.slot("b")
                assert b is not None
                assert (b.url, b.epoch, b.max_epoch, b.healthy, b.current) == (url_b, 3, 3, True, True)
                assert (b.num_outstanding, b.num_stream_failures, b.last_stream_failure_at) == (0, 0, None)
                assert workers.slot("c") is None
                counters = admin.counters()
                assert counters.tokens_total == 12
                assert counters.requests_total == 1
                assert (counters.resumes_total, counters.requests_failed_total) == (0, 0)
                assert counters.values["requests_in_flight"] == 0
                assert counters.per_slot["slot_epoch"] == {"a": 1, "b": 3}
                # The weight-version barrier.
                assert admin.report_weight_version("a", 2) is True
                assert admin.report_weight_version("nowhere", 2) is False  # never registered
                admin.require_weight_version(2)
                after = admin.workers()
                assert after.required_version == 2
                assert [(s.slot, s.weight_version, s.current) for s in after.slots] == [
                    ("a", 2, True),
                    ("b", None, False),
                ]
                with pytest.raises(RouterClientError) as lower:
                    admin.require_weight_version(1)  # only moves forward
                assert lower.value.status == 409
                assert admin.mark_unhealthy("b") is True
                assert admin.mark_unhealthy("nowhere") is False
                b_after = admin.workers().slot("b")
                assert b_after is not None
                assert not b_after.healthy
                assert b_after.unhealthy_since is not None

        await anyio.to_thread.run_sync(admin_calls)


async def test_a_wrong_token_and_a_router_away_are_typed_errors() -> None:
    async with running_router(RouterConfig(admin_token=ADMIN_TOKEN)) as (router_url, _app):

        def refused() -> None:
            with (
                RouterAdmin(router_url, "not-the-token") as admin,
                pytest.raises(RouterClientError) as caught,
            ):
                admin.workers()
            assert caught.value.status == 401
            assert "admin token" in str(caught.value)

        await anyio.to_thread.run_sync(refused)
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with (
        RouterAdmin(f"http://127.0.0.1:{port}", timeout_s=5.0) as away,
        pytest.raises(RouterUnreachableError),
    ):
        away.counters()
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        RouterAdmin("http://127.0.0.1:1", timeout_s=0)


def test_counters_parse_the_routers_lines_only() -> None:
    page = "\n".join(
        [
            "# HELP belayer_router_tokens_total Tokens streamed to clients.",
            "# TYPE belayer_router_tokens_total counter",
            "belayer_router_tokens_total 42",
            "belayer_router_resumes_total 3",
            'belayer_router_slot_outstanding{slot="s0"} 2',
            "belayer_router_bogus nan",
            "process_cpu_seconds_total 9.5",
            "garbage line",
        ]
    )
    counters = RouterCounters.parse(page)
    assert (counters.tokens_total, counters.resumes_total, counters.requests_total) == (42, 3, 0)
    assert counters.per_slot == {"slot_outstanding": {"s0": 2}}
    assert "bogus" not in counters.values
    assert "process_cpu_seconds_total" not in counters.values
