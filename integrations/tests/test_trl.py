"""TRL's own `GRPOTrainer` (trl 1.16.0, `use_vllm=False`) generating through `belayer-shadow serve`.

- rollouts: TRL's `rollout_func` hook sends each prompt to the server's `/v1/completions` as token
  ids and returns the server's token ids and per-token logprobs (the keys TRL reads:
  `prompt_ids`, `completion_ids`, `logprobs`);
- weights: a `TrainerCallback` saves the policy with `save_pretrained` after every optimizer step
  and loads the folder into every slot with `POST /update_weights {"weight_dir"}`;
- chaos: during the second rollout every slot's main worker is SIGKILLed mid-generation.

Checked: 3 optimizer steps complete; every completion token has exactly one finite logprob; the
server's counters show resumed requests; after each update the server's logprobs are the trained
policy's own (computed here with transformers), so the weights really moved.
"""

from __future__ import annotations

import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from serving import belayer_serve, kill, main_worker_pids, policy_logprobs, write_model_folder

pytestmark = [pytest.mark.timeout(900)]

MAX_TOKENS = 96


def test_grpo_trainer_trains_through_belayer_with_a_worker_killed_mid_rollout(tmp_path: Path) -> None:
    from datasets import Dataset
    from transformers import AutoTokenizer, Qwen3ForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    folder = write_model_folder(tmp_path / "model")
    run_dir = tmp_path / "serve"
    shared = tmp_path / "shared"  # the trainer writes weights here, the server reads them
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = Qwen3ForCausalLM.from_pretrained(folder)
    dataset = Dataset.from_dict({"prompt": [f"add {i} and {i + 1}" for i in range(16)]})

    with belayer_serve(folder, run_dir, "--slots", "2", "--num-kv-blocks", "64") as ready:
        http = httpx.Client(base_url=ready["url"], timeout=300)
        rollouts: list[dict[str, Any]] = []
        versions: list[int] = []
        kills: list[int] = []

        def complete(prompt_ids: list[int], request_id: str) -> dict[str, Any]:
            body = {"prompt": prompt_ids, "max_tokens": MAX_TOKENS, "temperature": 1.0, "logprobs": 0}
            answer = http.post("/v1/completions", json=body | {"request_id": request_id})
            answer.raise_for_status()
            return dict(answer.json()["choices"][0])

        def chaos(request_id: str) -> None:
            # Wait until the request is generating, then SIGKILL every slot's main worker.
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                record = http.get(f"/requests/{request_id}")
                if record.status_code == 200 and len(record.json()["token_ids"]) >= 8:
                    break
                time.sleep(0.01)
            for pid in main_worker_pids(run_dir):
                kill(pid)
                kills.append(pid)

        def rollout_func(prompts: list[str], trainer: Any) -> dict[str, Any]:
            step = len(rollouts)
            prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
            ids = [f"step{step}-{i}" for i in range(len(prompts))]
            killer = threading.Thread(target=chaos, args=(ids[0],)) if step == 1 else None
            if killer is not None:
                killer.start()
            with ThreadPoolExecutor(len(prompts)) as pool:
                choices = list(pool.map(complete, prompt_ids, ids))
            if killer is not None:
                killer.join()
            output = {
                "prompt_ids": prompt_ids,
                "completion_ids": [c["token_ids"] for c in choices],
                "logprobs": [c["logprobs"]["token_logprobs"] for c in choices],
            }
            rollouts.append({**output, "num_resumes": [c["num_resumes"] for c in choices]})
            return output

        class PushWeights(TrainerCallback):  # type: ignore[misc]
            """After each optimizer step: save the policy, load it into every slot by folder."""

            def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                folder = shared / f"step_{state.global_step}"
                kwargs["model"].save_pretrained(folder)
                answer = http.post("/update_weights", json={"weight_dir": str(folder)})
                assert answer.status_code == 200, answer.text
                versions.append(int(answer.json()["version"]))

        def reward_length(completions: list[str], **kwargs: Any) -> list[float]:
            return [float(len(set(c))) for c in completions]

        config = GRPOConfig(
            output_dir=str(tmp_path / "out"),
            use_cpu=True,
            per_device_train_batch_size=4,
            num_generations=4,
            max_completion_length=MAX_TOKENS,
            max_steps=3,
            learning_rate=1e-2,
            beta=0.0,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            seed=0,
        )
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=reward_length,
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
            rollout_func=rollout_func,
            callbacks=[PushWeights()],
        )
        before = {k: v.clone() for k, v in model.state_dict().items()}
        trainer.train()

        assert trainer.state.global_step == 3
        assert versions == [1, 2, 3]  # one version per optimizer step, on every slot
        assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
        assert len(rollouts) >= 3
        for rollout in rollouts:
            for completion, logprobs in zip(rollout["completion_ids"], rollout["logprobs"], strict=True):
                assert len(completion) == MAX_TOKENS
                assert len(logprobs) == len(completion)  # exactly one logprob per token
                assert all(math.isfinite(x) and x <= 0.0 for x in logprobs)
        assert len(kills) == 2
        assert sum(rollouts[1]["num_resumes"]) >= 1  # the killed rollout's requests were resumed
        metrics = http.get("/metrics").text
        resumes = next(
            line for line in metrics.splitlines() if line.startswith("belayer_router_resumes_total")
        )
        assert float(resumes.split()[-1]) >= 1

        # The server now serves the trained policy: its logprobs are the trainer's own.
        prompt = tokenizer("add 1 and 2", add_special_tokens=False)["input_ids"]
        choice = complete(prompt, "after-training")
        served = choice["logprobs"]["token_logprobs"]
        trained = policy_logprobs(model, prompt, choice["token_ids"])
        initial = policy_logprobs(Qwen3ForCausalLM.from_pretrained(folder), prompt, choice["token_ids"])
        trained_gap = max(abs(a - b) for a, b in zip(trained, served, strict=True))
        initial_gap = max(abs(a - b) for a, b in zip(initial, served, strict=True))
        print(f"served vs trained policy: {trained_gap:.2e}; vs the initial weights: {initial_gap:.2e}")
        assert trained_gap < 0.02  # float32 kernels of two engines: not bit-equal
        assert initial_gap > 10 * trained_gap
        http.close()
