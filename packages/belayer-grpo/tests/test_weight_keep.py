"""Weights the trainer pushes straight to the weight servers are kept: a slot restarted from scratch
(its weight server SIGKILLed) serves the last pushed weights at their version, not the start's.

Real router, real slot (memory servers, main worker, shadow), grpo's own `WeightSync.push` path."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import anyio
import pytest
import torch

from belayer_gpumem import WeightClient
from belayer_grpo._config import load_config
from belayer_grpo._model import build_policy, build_tokenizer, engine_model_config
from belayer_grpo._run import _save_weights
from belayer_grpo._system import RolloutSystem
from belayer_grpo._weight_sync import WeightSync
from belayer_router import RouterClient

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(600)]

PROMPT = [3, 5, 7, 11, 13, 17]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def _greedy(router: RouterClient) -> list[int]:
    completion = await router.generate(PROMPT, 24, temperature=0.0, seed=0)
    return completion.token_ids


def _perturb(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.5)


def _live_version(socket: Path) -> int:
    client = WeightClient.attach(socket)
    try:
        return client.latest_version()
    finally:
        client.detach()


async def test_a_slot_restarted_from_scratch_serves_the_last_pushed_weights_at_their_version(
    tmp_path: Path,
) -> None:
    torch.set_num_threads(1)
    config = load_config(None, ["data.workload=math", "system.num_slots=1", "logging.progress=false"])
    tokenizer = build_tokenizer(config.model, "math")
    model_config = engine_model_config(config.model, tokenizer, 512)
    model = build_policy(model_config, seed=config.model.seed)
    weights_file = tmp_path / "policy_init.safetensors"
    _save_weights(model, model_config, weights_file)
    async with RolloutSystem.start(config, tmp_path, model_config, weights_file) as system:
        (slot,) = system.slots
        sync = WeightSync(
            system.weight_sockets, keepers=[slot.keep_weights], keep_file=tmp_path / "pushed.safetensors"
        )
        async with system.client() as router:
            start = await _greedy(router)
            for seed in (1, 2):  # two pushes: versions 2 and 3 (the start's fill was 1)
                _perturb(model, seed)
                versions = await anyio.to_thread.run_sync(sync.push, model)
            assert versions == [3]
            pushed = await _greedy(router)
            assert pushed != start  # the pushes changed what the slot serves
            assert slot.kept_version == 3
            assert slot.weights_server is not None
            os.kill(slot.weights_server.pid, signal.SIGKILL)  # memory lost: restart from scratch
            await anyio.to_thread.run_sync(slot.wait_handovers, 1, 300.0)
            assert "memory.restart" in [event["event"] for event in slot.events()]
            assert await _greedy(router) == pushed  # the trainer's weights, not policy_init's
            assert await anyio.to_thread.run_sync(_live_version, slot.weights_socket) == 3
            # The next push goes on from there: version 4, and the slot serves it.
            _perturb(model, 3)
            assert await anyio.to_thread.run_sync(sync.push, model) == [4]
            assert await _greedy(router) not in (start, pushed)


def test_keepers_without_a_file_are_a_clear_error(tmp_path: Path) -> None:
    from belayer_grpo._errors import BelayerGrpoError

    sync = WeightSync([], keepers=[lambda _path, _version: None])
    with pytest.raises(BelayerGrpoError, match="no keep_file"):
        sync._keep({"w": torch.zeros(2)}, [1])
