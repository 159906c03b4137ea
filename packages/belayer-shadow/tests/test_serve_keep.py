"""`belayer-shadow serve --keep-running`: the one-machine service, SIGKILLed or hung, comes back
by itself on the same socket, its journal and the weights it last served.

Real processes: the keeper, its `serve` children (router + a slot of the built-in engine), the
memory servers and workers. The child is SIGKILLed mid-stream after a weight update, then stopped
(SIGSTOP) while idle."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import anyio
import anyio.abc
import httpx
import pytest
from serve_helpers import processes_mentioning, wait_until_gone, write_model_folder

from belayer_router import FinishEvent, RouterClient, TokenEvent
from belayer_router.testing import JsonLines, process_gone

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(900)]

PROMPT = [1, 2, 3]
MAX_TOKENS = 300
SEED = 11


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # real processes, minutes each: one event loop is enough


async def _collect(
    client: RouterClient, request_id: str, after: int, kill: int
) -> tuple[list[int], int, float]:
    """Stream the request; SIGKILL `kill` once `after` tokens arrived. Tokens, resumes, and the
    time of the kill."""
    tokens: list[int] = []
    resumes = -1
    killed = 0.0
    async for event in client.generate_stream(PROMPT, MAX_TOKENS, seed=SEED, request_id=request_id):
        if isinstance(event, FinishEvent):
            resumes = event.num_resumes
            continue
        assert isinstance(event, TokenEvent)
        tokens.append(event.token_id)
        if len(tokens) == after:
            os.kill(kill, signal.SIGKILL)  # the router and the slot's supervisor: the whole service
            killed = time.monotonic()
    return tokens, resumes, killed


async def test_a_kept_service_killed_or_hung_comes_back_on_its_journal_and_its_last_weights(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    root = tmp_path_factory.mktemp("keep")
    first, second = write_model_folder(root / "first", seed=0), write_model_folder(root / "second", seed=1)
    run_dir = root / "run"
    argv = [sys.executable, "-m", "belayer_shadow", "serve", str(first), "--json", "--port", "0"]
    argv += ["--keep-running", "--run-dir", str(run_dir), "--num-kv-blocks", "128"]
    # A cut stream waits for the restarted slot (Python start, memory servers, warm-up: minutes
    # on a loaded machine); checks 2 s apart, 3 misses: a busy router is not taken for hung.
    argv += ["--resume-wait-s", "300", "--hang-check-s", "2", "--hang-misses", "3"]
    log = root / "keeper.log"  # a pipe nobody reads would fill up with the children's logs
    with log.open("wb") as stderr_file:
        keeper = await anyio.open_process(argv, stderr=stderr_file)
    pids: list[int] = []
    try:
        lines = JsonLines(keeper)
        ready = await lines.next()
        url = ready["url"]
        pids.append(ready["pid"])
        async with httpx.AsyncClient(base_url=url, timeout=300) as http:
            update = await http.post("/update_weights", json={"weight_dir": str(second)})
            assert update.status_code == 200, update.text
        async with RouterClient(url, reconnect_timeout_s=400, timeout_s=600) as client:
            reference = (await client.generate(PROMPT, MAX_TOKENS, seed=SEED)).token_ids
            assert len(reference) == MAX_TOKENS

            # SIGKILL of the whole service mid-stream: the keeper starts it again on the same
            # socket and journal; the new router resumes the stream once the restarted slot
            # (on the updated weights, kept by the dead one) registers, token-exact.
            tokens, resumes, killed = await _collect(client, "cut-1", after=20, kill=pids[0])
            print(f"kept service: SIGKILL to the cut stream's end {time.monotonic() - killed:.1f} s")
            assert tokens == reference
            assert resumes >= 1
            again = await lines.next()
            assert again["url"] == url
            assert again["pid"] not in pids
            pids.append(again["pid"])
            assert (await client.generate(PROMPT, MAX_TOKENS, seed=SEED)).token_ids == reference

            # A hang (SIGSTOP): the keeper's health checks find it, SIGKILL it, start another.
            os.kill(pids[1], signal.SIGSTOP)
            stopped = time.monotonic()
            third = await lines.next()
            print(f"kept service: SIGSTOP to the new service's ready line {time.monotonic() - stopped:.1f} s")
            assert third["pid"] not in pids
            pids.append(third["pid"])
            assert (await client.generate(PROMPT, MAX_TOKENS, seed=SEED)).token_ids == reference
        keeper.send_signal(signal.SIGTERM)  # passed on: the service stops every slot
        with anyio.fail_after(120):
            assert await keeper.wait() == 130
        text = log.read_text()
        assert text.count("starting it again") == 2, text
    finally:
        if keeper.returncode is None:
            keeper.kill()
            await keeper.wait()
    assert all(process_gone(pid) for pid in pids)
    assert wait_until_gone(str(run_dir)) == [], processes_mentioning(str(run_dir))
    assert not list(run_dir.glob("slots/*/processes.json"))
    assert run_dir.exists()  # a run folder given by the user is kept


def test_keep_running_refuses_bad_flags_before_starting_anything(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    argv = [sys.executable, "-m", "belayer_shadow", "serve", str(model), "--keep-running"]
    done = subprocess.run(
        [*argv, "--hang-misses", "0"], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 2
    assert "--hang-misses 1 or more" in done.stderr
    assert "starting it again" not in done.stderr
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2  # the folder has no config.json: refused before the keeper starts
    assert done.stderr.count("belayer-shadow: error:") == 1
    assert "config.json" in done.stderr
