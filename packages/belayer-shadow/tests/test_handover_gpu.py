"""The cuda path of the handover (memory servers on CUDA VMM, kernel health check): GPU machines only."""

from __future__ import annotations

import signal
from pathlib import Path

import anyio
import pytest
from handover_helpers import PROMPTS, Streams, generate_all, router, supervised

pytestmark = [pytest.mark.gpu, pytest.mark.anyio, pytest.mark.timeout(300)]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def test_cuda_health_check_runs_the_kernel() -> None:
    import torch

    from belayer_shadow import check_device_health

    assert "kernels correct" in check_device_health(torch.device("cuda", 0))


async def test_sigkill_on_cuda_memory_shadow_resumes_exactly(tmp_path: Path) -> None:
    async with router() as (url, app), supervised(url, tmp_path / "slot", backend="cuda") as slot:
        reference = await generate_all(url, PROMPTS, 128)
        streams = Streams(url, PROMPTS, 128)
        async with anyio.create_task_group() as group:
            group.start_soon(streams.run)
            await streams.wait_tokens(4)
            slot.kill_main(signal.SIGKILL)
        assert streams.tokens == reference
        await anyio.to_thread.run_sync(slot.wait_handovers, 1)
        healthy = next(e for e in slot.events() if e["event"] == "handover.healthy")
        assert "kernels correct" in healthy["detail"]
        assert app.registry.slots["s0"].max_epoch == 2
