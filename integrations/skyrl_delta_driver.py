"""SkyRL's own delta weight sync (skyrl 0.4.0, ``weight_sync_backend="delta"``) against a
`belayer-shadow serve` service, on the CPU.

Run by tests/test_skyrl.py in SkyRL's Python >= 3.12 venv: ``python skyrl_delta_driver.py URL
MODEL BASE_DIR WORK_DIR``. It builds the trainer-side engine as SkyRL's trainer does
(`weight_senders.build_trainer_engine` for ``delta``, without the config plumbing that needs Ray:
SkyRL's `register_trainer_engines`, its `DeltaTrainerInitInfo`, its `SkyrlWeightSyncClient`,
vLLM's `WeightTransferTrainerFactory.trainer_init` dispatching to SkyRL's
`DeltaTrainerWeightTransferEngine`, over SkyRL's `FsdpWeightSource` of a transformers model), takes
one optimizer step on that model, and, with a long request of SkyRL's `RemoteInferenceClient` in
flight, calls ``engine.send_weights()`` in a worker thread as SkyRL's worker does
(`Worker._sync_weights_to_inference_engines`). That publishes the XOR delta against the base
checkpoint (SkyRL's `DeltaCheckpointPublisher`) and drives ``/fetch_weights``,
``/pause?mode=keep``, ``/start_weight_update``, ``/update_weights {"update_info"}``,
``/finish_weight_update`` and ``/resume``. It prints one JSON document of what it saw and writes the
trained weights to ``WORK_DIR/trained.safetensors`` for the test to compare with the service's.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
from pathlib import Path
from typing import Any

import aiohttp
import torch
from safetensors.torch import save_file
from skyrl.backends.skyrl_train.inference_servers.remote_inference_client import RemoteInferenceClient
from skyrl.backends.skyrl_train.weight_sync.control_plane import SkyrlWeightSyncClient
from skyrl.backends.skyrl_train.weight_sync.delta.trainer import DeltaTrainerInitInfo
from skyrl.backends.skyrl_train.weight_sync.register import register_trainer_engines
from skyrl.backends.skyrl_train.weight_sync.sources import FsdpWeightSource
from skyrl.backends.skyrl_train.weight_sync.weight_senders import (
    maybe_set_reset_prefix_cache,
    teardown_engine,
)
from transformers import AutoModelForCausalLM
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

LONG_TOKENS = 1500  # the request in flight across the sync: long enough to be cut by the pause


def _metric(text: str, name: str) -> float:
    found = re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def _trainer_engine(url: str, base_dir: str, work: Path, model: torch.nn.Module) -> Any:
    """What `build_trainer_engine` returns for ``delta`` on rank 0, one inference server."""
    register_trainer_engines()
    init_info = DeltaTrainerInitInfo(
        base_model_path=base_dir,
        sync_dir=str(work / "sync"),
        local_checkpoint_dir=str(work / "local"),
        publish_staging_dir=str(work / "staging"),
        rank=0,
    )
    client = SkyrlWeightSyncClient([url], 1, init_payload_fn=None)
    source = FsdpWeightSource(model, torch.float32)
    return WeightTransferTrainerFactory.trainer_init(init_info, client=client, source=source)


def _train_step(model: torch.nn.Module, prompt: list[int]) -> None:
    """One AdamW step on a language-modelling loss: every parameter moves."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.tensor([prompt * 4])
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


async def main(url: str, model_name: str, base_dir: str, work_dir: str) -> dict[str, Any]:
    work = Path(work_dir)
    out: dict[str, Any] = {}
    client = RemoteInferenceClient(
        proxy_url=url, server_urls=[url], data_parallel_size=1, model_name=model_name
    )
    trainer = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    engine = _trainer_engine(url, base_dir, work, trainer)  # POSTs /init_weight_transfer_engine
    out["engine"] = type(engine).__qualname__
    async with aiohttp.ClientSession() as http:
        prompt = (await client.tokenize(["Add 2 and 3."]))[0]
        seeded = {
            "prompt_token_ids": [prompt],
            "sampling_params": {
                "max_tokens": 12,
                "temperature": 1.0,
                "seed": 7,
                "logprobs": 0,
                "ignore_eos": True,
            },
            "session_ids": ["seeded-0"],
        }
        before = await client.generate(seeded)  # type: ignore[arg-type]
        out["before"] = {
            "response_ids": before["response_ids"][0],
            "response_logprobs": before["response_logprobs"][0],
        }

        _train_step(trainer, prompt)
        trained = {k: v.detach().clone().contiguous() for k, v in trainer.state_dict().items()}
        save_file(trained, str(work / "trained.safetensors"))

        async with http.get(f"{url}/metrics") as answer:
            base_tokens = _metric(await answer.text(), "belayer_router_tokens_total")
        long_batch = {
            "prompt_token_ids": [prompt],
            "sampling_params": {
                "max_tokens": LONG_TOKENS,
                "temperature": 1.0,
                "logprobs": 0,
                "ignore_eos": True,
            },
            "session_ids": ["long-0"],
        }
        running = asyncio.create_task(client.generate(long_batch))  # type: ignore[arg-type]
        for _ in range(6000):  # until it has generated some tokens (at most 60 s)
            async with http.get(f"{url}/metrics") as answer:
                if _metric(await answer.text(), "belayer_router_tokens_total") >= base_tokens + 16:
                    break
            await asyncio.sleep(0.01)
        # As SkyRL's worker: the per-round prefix-cache flag (fully async: in-flight requests keep
        # their prefixes), then send_weights() off the event loop.
        maybe_set_reset_prefix_cache(engine, False)
        await asyncio.to_thread(engine.send_weights)
        out["done_after_sync"] = running.done()
        kept = await running
        out["kept"] = {
            "response_ids": kept["response_ids"][0],
            "response_logprobs": kept["response_logprobs"][0] if kept["response_logprobs"] else None,
            "stop_reason": kept["stop_reasons"][0],
        }
        async with http.get(f"{url}/metrics") as answer:
            out["metrics"] = await answer.text()
        after = await client.generate(seeded)  # type: ignore[arg-type]
        out["after"] = {
            "response_ids": after["response_ids"][0],
            "response_logprobs": after["response_logprobs"][0],
        }
    out["published"] = sorted(
        str(p.relative_to(work / "sync")) for p in (work / "sync").rglob("*") if p.is_file()
    )
    teardown_engine(engine)
    await client.teardown()
    return out


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(*sys.argv[1:5]))))
