"""`belayer-router serve --keep-running`: the router SIGKILLed comes back by itself, on its journal.

Real processes: the keeper, its router children, a fake worker; the router child is SIGKILLed
mid-stream and again while no request runs."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from pathlib import Path

import anyio
import anyio.abc
import httpx
import pytest
from router_helpers import ADMIN_TOKEN

from belayer_router import ExitCode, FinishEvent, RouterClient, TokenEvent
from belayer_router.testing import JsonLines, expected_tokens, process_gone, running_worker

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(300)]


async def test_a_kept_router_killed_mid_stream_comes_back_on_its_journal_and_serves(tmp_path: Path) -> None:
    journal = tmp_path / "router.jsonl"
    argv = [sys.executable, "-m", "belayer_router", "serve", "--port", "0", "--json", "--keep-running"]
    argv += ["--journal", str(journal), "--prefix-interval", "4", "--admin-token", ADMIN_TOKEN]
    # stderr to a file: a pipe nobody reads until the end fills up (64 KiB) with the routers' logs
    # on a loaded machine, and a router blocked writing to it answers nothing.
    log = tmp_path / "keeper.log"
    with log.open("wb") as stderr_file:
        keeper = await anyio.open_process(argv, stderr=stderr_file)
    pids: list[int] = []
    try:
        lines = JsonLines(keeper)
        first = await lines.next()
        url = first["url"]
        pids.append(first["pid"])
        assert first["pid"] != keeper.pid
        async with (
            running_worker(1, token_delay_s=0.01) as (worker_url, _worker),
            RouterClient(url, admin_token=ADMIN_TOKEN, reconnect_timeout_s=60) as client,
        ):
            await client.register("s0", worker_url, 1)
            tokens: list[int] = []
            finish = None
            async for event in client.generate_stream([1, 2], 40, seed=21, request_id="req-1"):
                if isinstance(event, FinishEvent):
                    finish = event
                    continue
                assert isinstance(event, TokenEvent)
                tokens.append(event.token_id)
                if len(tokens) == 10:
                    os.kill(pids[0], signal.SIGKILL)  # nobody but the keeper starts it again
                    killed = time.monotonic()
            # The in-flight stream: the client reconnected to the new router, which resumed it
            # from the journal's preserved prefix: one token-exact stream.
            assert tokens == expected_tokens(21, 40)
            assert finish is not None
            assert finish.num_resumes == 1
            second = await lines.next()
            print(
                f"kept router: SIGKILL to the stream's end and the new router's line {time.monotonic() - killed:.2f} s"
            )
            assert second["url"] == url  # the same socket: the keeper kept it open
            assert second["pid"] not in pids
            pids.append(second["pid"])
            # Killed again with no request running: a plain HTTP client that connects meanwhile
            # waits in the socket's backlog (no connection refused) and gets its answer.
            os.kill(pids[1], signal.SIGKILL)
            async with httpx.AsyncClient(base_url=url, timeout=120) as http:
                response = await http.get("/health")
            assert response.status_code == 200
            third = await lines.next()
            pids.append(third["pid"])
            # New requests succeed: the restarted router knows the worker from its journal.
            completion = await client.generate([3, 4], 12, seed=5)
            assert completion.token_ids == expected_tokens(5, 12)
        assert process_gone(pids[0])
        assert process_gone(pids[1])
        keeper.send_signal(signal.SIGTERM)  # passed on to the router; the keeping ends
        with anyio.fail_after(60):
            assert await keeper.wait() == ExitCode.INTERRUPTED
        stderr = log.read_text()
        assert stderr.count("starting it again") == 2, stderr
        assert "signal SIGKILL" in stderr
    finally:
        if keeper.returncode is None:
            keeper.kill()
            await keeper.wait()
    with anyio.fail_after(30):
        while not all(process_gone(pid) for pid in pids):  # noqa: ASYNC110  (the children die with it)
            await anyio.sleep(0.05)


async def test_a_kept_router_that_hangs_is_killed_by_its_health_checks_and_replaced(tmp_path: Path) -> None:
    journal = tmp_path / "router.jsonl"
    argv = [sys.executable, "-m", "belayer_router", "serve", "--port", "0", "--json", "--keep-running"]
    argv += ["--journal", str(journal), "--prefix-interval", "4", "--admin-token", ADMIN_TOKEN]
    # Checks 2 s apart, 3 misses: a router merely slow on a loaded machine is not taken for hung.
    argv += ["--hang-check-s", "2", "--hang-misses", "3"]
    # stderr to a file: a pipe nobody reads until the end fills up (64 KiB) with the routers' logs
    # on a loaded machine, and a router blocked writing to it answers nothing.
    log = tmp_path / "keeper.log"
    with log.open("wb") as stderr_file:
        keeper = await anyio.open_process(argv, stderr=stderr_file)
    pids: list[int] = []
    try:
        lines = JsonLines(keeper)
        first = await lines.next()
        url = first["url"]
        pids.append(first["pid"])
        async with (
            running_worker(1, token_delay_s=0.01) as (worker_url, _worker),
            # timeout_s: a stream that hears nothing for 1 s reconnects (and finds the new router)
            RouterClient(url, admin_token=ADMIN_TOKEN, reconnect_timeout_s=90, timeout_s=1.0) as client,
        ):
            await client.register("s0", worker_url, 1)
            tokens: list[int] = []
            async for event in client.generate_stream([1, 2], 60, seed=8, request_id="hung-1"):
                if isinstance(event, TokenEvent):
                    tokens.append(event.token_id)
                    if len(tokens) == 10:
                        os.kill(pids[0], signal.SIGSTOP)  # alive, silent: no exit to notice
            assert tokens == expected_tokens(8, 60)
            second = await lines.next()
            pids.append(second["pid"])
            assert second["pid"] != pids[0]
            assert process_gone(pids[0])  # SIGKILLed while stopped
            completion = await client.generate([3, 4], 12, seed=5)
            assert completion.token_ids == expected_tokens(5, 12)
        keeper.send_signal(signal.SIGTERM)
        with anyio.fail_after(60):
            assert await keeper.wait() == ExitCode.INTERRUPTED
        stderr = log.read_text()
        assert "did not answer 3 checks in a row" in stderr, stderr
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pids[0], signal.SIGCONT)
        if keeper.returncode is None:
            keeper.kill()
            await keeper.wait()


async def test_keep_running_without_a_journal_is_a_usage_error() -> None:
    argv = [sys.executable, "-m", "belayer_router", "serve", "--port", "0", "--keep-running"]
    done = await anyio.run_process(argv, check=False)
    assert done.returncode == ExitCode.USAGE
    assert (
        done.stderr.decode()
        .strip()
        .splitlines()[-1]
        .startswith("belayer-router: error: --keep-running needs --journal")
    )


async def test_an_abbreviated_keep_running_flag_makes_one_keeper_whose_child_serves(tmp_path: Path) -> None:
    # argparse takes `--keep` for `--keep-running`; a child still given it would be a keeper
    # itself, starting keepers without end and never a router.
    argv = [sys.executable, "-m", "belayer_router", "serve", "--port", "0", "--json", "--keep"]
    argv += ["--journal", str(tmp_path / "router.jsonl"), "--hang-check-s", "0"]
    with (tmp_path / "keeper.log").open("wb") as stderr_file:
        keeper = await anyio.open_process(argv, stderr=stderr_file)
    pids: list[int] = []
    try:
        ready = await JsonLines(keeper).next(limit_s=90)
        pids.append(ready["pid"])
        stat = await anyio.Path(f"/proc/{ready['pid']}/stat").read_text()
        assert int(stat.rsplit(")", 1)[1].split()[1]) == keeper.pid  # the router is the keeper's child
        async with httpx.AsyncClient(base_url=ready["url"], timeout=60) as http:
            assert (await http.get("/health")).status_code == 200
    finally:
        with contextlib.suppress(ProcessLookupError):
            keeper.send_signal(signal.SIGTERM)
        with anyio.move_on_after(30):
            await keeper.wait()
        if keeper.returncode is None:
            keeper.kill()
            await keeper.wait()
    with anyio.fail_after(30):
        while not all(process_gone(pid) for pid in pids):  # noqa: ASYNC110  (the child dies with it)
            await anyio.sleep(0.05)
