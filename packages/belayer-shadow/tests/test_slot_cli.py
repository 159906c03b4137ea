"""`belayer-shadow slot` and `worker` as commands: serve, stop on SIGTERM, refuse bad input clearly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
from handover_helpers import TOKEN, generate_all, router

pytestmark = [pytest.mark.timeout(240)]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
async def test_slot_command_serves_and_stops_cleanly_on_sigterm(tmp_path: Path) -> None:
    async with router() as (url, app):
        run_dir = tmp_path / "slot"
        command = [sys.executable, "-m", "belayer_shadow", "slot", "--slot", "cli", "--router", url]
        command += ["--run-dir", str(run_dir), "--num-kv-blocks", "64"]
        env = {**os.environ, "BELAYER_ROUTER_ADMIN_TOKEN": TOKEN}
        process = await anyio.open_process(command, env=env)
        try:
            with anyio.fail_after(120):
                while app.registry.slots.get("cli") is None or app.registry.slots["cli"].worker is None:  # noqa: ASYNC110
                    await anyio.sleep(0.05)
            (tokens,) = await generate_all(url, [[1, 2, 3]], 8)
            assert len(tokens) == 8
            process.send_signal(signal.SIGTERM)
            with anyio.fail_after(60):
                assert await process.wait() == 130  # ExitCode.INTERRUPTED
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
    assert not (run_dir / "mem").exists()
    assert (run_dir / "events.jsonl").exists()


def test_worker_command_without_memory_servers_says_what_is_wrong(tmp_path: Path) -> None:
    command = [
        sys.executable,
        "-m",
        "belayer_shadow",
        "worker",
        "--slot",
        "x",
        "--router",
        "http://127.0.0.1:9",
    ]
    command += ["--weights-socket", str(tmp_path / "w.sock"), "--kv-socket", str(tmp_path / "k.sock")]
    command += ["--heartbeat", str(tmp_path / "hb")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 2
    assert "belayer-shadow: error:" in result.stderr
    assert "w.sock" in result.stderr


def test_unknown_recovery_is_refused_by_the_parser() -> None:
    command = [sys.executable, "-m", "belayer_shadow", "slot", "--slot", "x", "--router", "http://x"]
    result = subprocess.run(
        [*command, "--run-dir", "/tmp/x", "--recovery", "magic"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert "invalid choice: 'magic'" in result.stderr


def test_reap_command_reports_as_json(tmp_path: Path) -> None:
    leftover = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        stat = Path(f"/proc/{leftover.pid}/stat").read_text()
        start = int(stat[stat.rindex(")") + 2 :].split()[19])
        entry = {"pid": leftover.pid, "start_time": start, "role": "main", "group": True}
        (tmp_path / "processes.json").write_text(json.dumps({"processes": [entry]}))
        command = [sys.executable, "-m", "belayer_shadow", "reap", "--run-dir", str(tmp_path), "--json"]
        result = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout) == {"run_dir": str(tmp_path), "killed": [leftover.pid]}
        assert leftover.wait(timeout=60) == -signal.SIGKILL
    finally:
        leftover.kill()
        leftover.wait()


def test_bad_model_is_one_error_line_and_usage_exit_code(tmp_path: Path) -> None:
    (tmp_path / "model.json").write_text("{not json")
    command = [
        sys.executable,
        "-m",
        "belayer_shadow",
        "slot",
        "--slot",
        "x",
        "--router",
        "http://127.0.0.1:9",
    ]
    command += ["--run-dir", str(tmp_path / "run"), "--model", str(tmp_path / "model.json")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 2
    assert result.stderr.startswith("belayer-shadow: error: model configuration")
    assert "Traceback" not in result.stderr
    debug = subprocess.run(
        [*command[:3], "--debug", *command[3:]], capture_output=True, text=True, timeout=120, check=False
    )
    assert "Traceback" in debug.stderr
    assert not (tmp_path / "run" / "processes.json").exists()  # nothing left running or recorded
