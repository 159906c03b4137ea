from __future__ import annotations

import json
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import anyio.abc
import pytest
from router_helpers import ADMIN_TOKEN, StartRouter

# litellm (imported by test modules) would fetch its model price map from the internet at import;
# the machines reach only package registries: use the copy it ships.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")


@pytest.fixture
def anyio_backend() -> str:
    # uvicorn serves on asyncio only.
    return "asyncio"


@pytest.fixture(params=["uvicorn", "belayer"])
def http_server(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run the test once per HTTP server (``$BELAYER_ROUTER_SERVER``): its in-process routers,
    ``belayer-router serve`` processes and fake workers are served by uvicorn, then by the
    router's own server.  Modules opt in with ``pytest.mark.usefixtures("http_server")``."""
    monkeypatch.setenv("BELAYER_ROUTER_SERVER", request.param)
    return str(request.param)


@pytest.fixture
async def router_process() -> AsyncIterator[StartRouter]:
    """``start(journal, port=0) -> (process, url)``: a real ``belayer-router serve`` process.

    Each router journals to ``journal`` with a prefix every 4 tokens and the admin token
    `ADMIN_TOKEN`; ``port`` restarts one on the address of a killed one. Every process started
    is killed at teardown.
    """
    started: list[anyio.abc.Process] = []

    async def start(journal: Path, port: int = 0) -> tuple[anyio.abc.Process, str]:
        argv = [sys.executable, "-m", "belayer_router", "serve", "--port", str(port), "--json"]
        argv += ["--journal", str(journal), "--prefix-interval", "4", "--admin-token", ADMIN_TOKEN]
        process = await anyio.open_process(argv)
        started.append(process)
        assert process.stdout is not None
        line = b""
        with anyio.fail_after(60):  # the first line is the JSON "listening" record
            while not line.endswith(b"\n"):
                line += await process.stdout.receive(1)
        return process, json.loads(line)["url"]

    try:
        yield start
    finally:
        with anyio.CancelScope(shield=True):
            for process in started:
                if process.returncode is None:
                    process.kill()
                    await process.wait()
