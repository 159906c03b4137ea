"""The RL control plane: /pause (keep, wait, abort), /resume, /is_paused, /update_weights,
/update_weights_from_disk, /get_world_size, /reset_prefix_cache; SGLang's (slime) and AReaL's
names for them (/pause_generation, /continue_generation, /flush_cache, /areal_*).

Real routers on loopback (both HTTP servers) and `FakeWorker`s; the weight servers behind the
router are a `FakeWeightLoader` here (belayer-shadow's tests load real folders into real weight
servers through `belayer-shadow serve`).
"""

from __future__ import annotations

import threading
from typing import Any

import anyio
import attrs
import httpx
import pytest

from belayer_router import (
    FinishEvent,
    PartialWeightCommitError,
    RouterClient,
    RouterConfig,
    TokenEvent,
    WeightLoader,
    WeightLoadError,
    WeightTransferLoader,
    running_router,
)
from belayer_router.testing import expected_tokens, running_worker, wait_until

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("http_server")]

TOKEN = "tok"


def _set_event() -> threading.Event:
    event = threading.Event()
    event.set()
    return event


@attrs.define
class FakeWeightLoader:
    """Records each folder it is given and how many streams ran at that moment; refuses `bad`."""

    app: Any = None
    loads: list[tuple[str, int]] = attrs.field(factory=list)
    lock: threading.Lock = attrs.field(factory=threading.Lock)
    # While cleared, a load blocks in the middle (a long update); set by the test to finish it.
    gate: threading.Event = attrs.field(factory=lambda: _set_event())

    def load_weights(self, weight_dir: str) -> int:
        if weight_dir.endswith("bad"):
            raise WeightLoadError(
                f"weights from {weight_dir!r} not loaded (truncated); the previous ones stay"
            )
        with self.lock:
            self.loads.append((weight_dir, self.app.registry.num_running()))
        assert self.gate.wait(60), "the test never let the load finish"
        if weight_dir.endswith("partial"):  # slot "a" committed, then "b"'s weight server died
            raise PartialWeightCommitError(f"weights from {weight_dir!r} committed on ['a'] only", ("a",))
        return 1


async def _collect(client: RouterClient, out: dict[str, Any], seed: int, max_tokens: int, rid: str) -> None:
    tokens: list[int] = []
    async for event in client.generate_stream([3], max_tokens, seed=seed, request_id=rid):
        if isinstance(event, TokenEvent):
            tokens.append(event.token_id)
        elif isinstance(event, FinishEvent):
            out["finish"] = event
    out["tokens"] = tokens


async def test_keep_cuts_and_holds_the_running_request_and_resume_continues_it_exactly() -> None:
    loader = FakeWeightLoader()
    async with (
        running_router(RouterConfig(admin_token=TOKEN, resume_wait_s=1), weight_loader=loader) as (url, app),
        running_worker(1, pause_at=5) as (w_url, worker),
        RouterClient(url, admin_token=TOKEN) as client,
        httpx.AsyncClient(base_url=url) as http,
    ):
        loader.app = app
        await client.register("s", w_url, 1)
        out: dict[str, Any] = {}
        async with anyio.create_task_group() as group:
            group.start_soon(_collect, client, out, 7, 20, "kept")
            await wait_until(lambda: worker.num_paused == 1)
            answer = await http.post("/pause", params={"mode": "keep"})
            assert answer.json() == {"status": "paused", "mode": "keep"}
            assert (await http.get("/is_paused")).json() == {"is_paused": True}
            worker.resume()  # what it would send now must not reach the client: its stream is cut
            await wait_until(lambda: app.registry.num_running() == 0)
            await anyio.sleep(1.5)  # longer than resume_wait_s: a paused router holds, never fails
            assert "finish" not in out
            # A weight update while paused loads at once; then the held request goes on.
            update = await http.post("/update_weights", json={"weight_dir": "/w/step1"})
            assert update.status_code == 200
            assert update.json()["version"] == 1
            assert (await http.post("/resume")).json() == {"status": "resumed"}
        assert out["tokens"] == expected_tokens(7, 20)  # one stream: nothing lost or repeated
        assert out["finish"].num_resumes == 1
        runs = [len(r["generated_token_ids"]) for r in worker.requests if r["request_id"] == "kept"]
        assert runs == [0, 5]  # continued from its 5 tokens
        assert loader.loads == [("/w/step1", 0)]
        assert app.metrics.num_pause_resumes == 1
        assert app.registry.slots["s"].num_stream_failures == 0  # a pause is not the worker's fault
        assert (await http.get("/is_paused")).json() == {"is_paused": False}
        metrics = (await http.get("/metrics")).text
    assert "belayer_router_pause_resumes_total 1" in metrics
    assert "belayer_router_weight_updates_total 1" in metrics


async def test_wait_returns_once_running_requests_finished_and_holds_new_ones() -> None:
    async with (
        running_router(RouterConfig(admin_token=TOKEN)) as (url, app),
        running_worker(1, pause_at=3) as (w_url, worker),
        RouterClient(url, admin_token=TOKEN) as client,
        httpx.AsyncClient(base_url=url, timeout=60) as http,
    ):
        await client.register("s", w_url, 1)
        first: dict[str, Any] = {}
        later: dict[str, Any] = {}
        paused: list[float] = []
        async with anyio.create_task_group() as group:
            group.start_soon(_collect, client, first, 1, 10, "running")
            await wait_until(lambda: worker.num_paused == 1)

            async def pause() -> None:
                await http.post("/pause", params={"mode": "wait"})
                paused.append(1.0)

            group.start_soon(pause)
            await wait_until(lambda: app.registry.paused == "wait")
            assert not paused  # still waiting for the running request
            worker.resume()
            await wait_until(lambda: bool(paused))
            assert first["tokens"] == expected_tokens(1, 10)  # it finished before the pause returned
            group.start_soon(_collect, client, later, 2, 6, "held")
            await anyio.sleep(0.3)
            assert not [r for r in worker.requests if r["request_id"] == "held"]  # not started
            await http.post("/resume")
        assert later["tokens"] == expected_tokens(2, 6)
        assert later["finish"].num_resumes == 0


async def test_abort_ends_running_requests_with_what_they_have() -> None:
    async with (
        running_router(RouterConfig(admin_token=TOKEN)) as (url, _app),
        running_worker(1, pause_at=4) as (w_url, worker),
        RouterClient(url, admin_token=TOKEN) as client,
        httpx.AsyncClient(base_url=url) as http,
    ):
        await client.register("s", w_url, 1)
        out: dict[str, Any] = {}
        async with anyio.create_task_group() as group:
            group.start_soon(_collect, client, out, 5, 12, "aborted")
            await wait_until(lambda: worker.num_paused == 1)
            await http.post("/pause")  # vLLM's default mode: abort
            worker.resume()
        assert out["finish"].finish_reason == "abort"
        assert out["tokens"] == expected_tokens(5, 12)[:4]
        await http.post("/resume")
        assert (await client.generate([3], 4, seed=5)).token_ids == expected_tokens(5, 4)


async def test_update_weights_waits_for_running_requests_and_bumps_every_slot_version() -> None:
    loader = FakeWeightLoader()
    async with (
        running_router(RouterConfig(admin_token=TOKEN), weight_loader=loader) as (url, app),
        running_worker(1, pause_at=3) as (a_url, a),
        running_worker(1) as (b_url, _b),
        RouterClient(url, admin_token=TOKEN) as client,
        httpx.AsyncClient(base_url=url, timeout=60) as http,
    ):
        loader.app = app
        await client.register("a", a_url, 1)
        await client.register("b", b_url, 1)
        assert (await http.get("/get_world_size")).json() == {"world_size": 2}
        out: dict[str, Any] = {}
        results: list[httpx.Response] = []
        async with anyio.create_task_group() as group:
            group.start_soon(_collect, client, out, 3, 9, "before-update")
            await wait_until(lambda: a.num_paused == 1 or app.registry.num_running() == 0)

            async def update() -> None:
                results.append(await http.post("/update_weights", json={"weight_dir": "/w/1"}))

            group.start_soon(update)
            await anyio.sleep(0.2)
            a.resume()
        assert results[0].json()["version"] == 1
        assert loader.loads == [("/w/1", 0)]  # loaded with nothing running
        assert out["tokens"] == expected_tokens(3, 9)  # finished whole on the old version
        sglang = await http.post("/update_weights_from_disk", json={"model_path": "/w/2"})
        assert sglang.status_code == 200
        assert sglang.json()["success"] is True
        assert sglang.json()["version"] == 2
        workers = await client.workers()
        assert {(w["slot"], w["weight_version"], w["current"]) for w in workers} == {
            ("a", 2, True),
            ("b", 2, True),
        }
        assert (await http.get("/is_paused")).json() == {"is_paused": False}
        assert (await http.post("/reset_prefix_cache")).status_code == 200


async def test_refused_updates_change_nothing_and_say_why() -> None:
    loader = FakeWeightLoader()
    async with (
        running_router(RouterConfig(admin_token=TOKEN), weight_loader=loader) as (url, app),
        running_worker(1) as (w_url, _worker),
        RouterClient(url, admin_token=TOKEN) as client,
        httpx.AsyncClient(base_url=url) as http,
    ):
        loader.app = app
        await client.register("s", w_url, 1)
        await http.post("/update_weights", json={"weight_dir": "/w/1"})
        bad = await http.post("/update_weights", json={"weight_dir": "/w/bad"})
        assert bad.status_code == 400
        assert "truncated" in bad.json()["error"]["message"]
        sglang = await http.post("/update_weights_from_disk", json={"model_path": "/w/bad"})
        assert sglang.status_code == 400
        assert sglang.json()["success"] is False
        for body in ({}, {"weight_dir": ""}, {"weight_dir": 3}):
            answer = await http.post("/update_weights", json=body)
            assert answer.status_code == 400
            assert "weight_dir" in answer.json()["error"]["message"]
        assert (await http.post("/pause", params={"mode": "later"})).status_code == 400
        assert app.registry.required_version == 1  # the refused ones moved nothing
        assert (await http.get("/is_paused")).json() == {"is_paused": False}
        assert (await client.generate([3], 4, seed=1)).token_ids == expected_tokens(1, 4)


def _held_out(app: Any, slot: str) -> bool:
    worker = app.registry.slots[slot].worker
    assert worker is not None
    return bool(worker.held_out)


async def test_a_partial_commit_requires_the_new_version_and_holds_the_other_slots_out() -> None:
    loader = FakeWeightLoader()
    async with (
        running_router(RouterConfig(admin_token=TOKEN), weight_loader=loader) as (url, app),
        running_worker(1) as (a_url, _a),
        running_worker(1) as (b_url, _b),
        RouterClient(url, admin_token=TOKEN) as client,
        httpx.AsyncClient(base_url=url) as http,
    ):
        loader.app = app
        await client.register("a", a_url, 1)
        await client.register("b", b_url, 1)
        assert (await http.post("/update_weights", json={"weight_dir": "/w/1"})).json()["version"] == 1
        partial = await http.post("/update_weights", json={"weight_dir": "/w/partial"})
        assert partial.status_code == 503
        assert "held out" in partial.json()["error"]["message"]
        assert app.registry.required_version == 2
        versions = {w["slot"]: w["weight_version"] for w in await client.workers()}
        assert versions == {"a": 2, "b": 1}  # b still serves version 1: out of rotation
        assert _held_out(app, "b")
        assert not _held_out(app, "a")
        for seed in range(4):
            assert (await client.generate([3], 4, seed=seed)).token_ids == expected_tokens(seed, 4)
        assert (await http.get("/is_paused")).json() == {"is_paused": False}
        again = await http.post("/update_weights", json={"weight_dir": "/w/3"})
        assert again.json()["version"] == 3
        assert {w["slot"]: w["weight_version"] for w in await client.workers()} == {"a": 3, "b": 3}
        assert not _held_out(app, "b")


async def test_pause_and_resume_during_an_update_wait_for_it() -> None:
    loader = FakeWeightLoader()
    async with (
        running_router(RouterConfig(admin_token=TOKEN), weight_loader=loader) as (url, app),
        running_worker(1) as (w_url, _worker),
        RouterClient(url, admin_token=TOKEN) as client,
        httpx.AsyncClient(base_url=url, timeout=60) as http,
    ):
        loader.app = app
        await client.register("s", w_url, 1)
        # A pause (keep) sent during an update is still in force after the update resumed its own.
        loader.gate.clear()
        async with anyio.create_task_group() as group:
            group.start_soon(lambda: http.post("/update_weights", json={"weight_dir": "/w/1"}))
            await wait_until(lambda: len(loader.loads) == 1)
            group.start_soon(lambda: http.post("/pause", params={"mode": "keep"}))
            await anyio.sleep(0.3)
            loader.gate.set()
        assert (await http.get("/is_paused")).json() == {"is_paused": True}
        # A resume sent during an update (loading while paused) waits for the load to end.
        loader.gate.clear()
        paused_during_load: list[bool] = []
        async with anyio.create_task_group() as group:
            group.start_soon(lambda: http.post("/update_weights", json={"weight_dir": "/w/2"}))
            await wait_until(lambda: len(loader.loads) == 2)
            group.start_soon(http.post, "/resume")
            await anyio.sleep(0.3)
            paused_during_load.append(app.registry.paused is not None)
            loader.gate.set()
        assert paused_during_load == [True]
        assert (await http.get("/is_paused")).json() == {"is_paused": False}
        assert (await client.generate([3], 4, seed=1)).token_ids == expected_tokens(1, 4)


async def test_sglang_pause_generation_retract_holds_and_continue_generation_goes_on_exactly() -> None:
    """slime's calls on an SGLang server: /pause_generation {"mode": "retract"} (requests back to
    the queue, recomputed later: `keep` here), /update_weights_from_disk, /flush_cache,
    /continue_generation; answered in SGLang's shapes."""
    loader = FakeWeightLoader()
    async with (
        running_router(RouterConfig(admin_token=TOKEN, resume_wait_s=1), weight_loader=loader) as (url, app),
        running_worker(1, pause_at=5) as (w_url, worker),
        RouterClient(url, admin_token=TOKEN) as client,
        httpx.AsyncClient(base_url=url) as http,
    ):
        loader.app = app
        await client.register("s", w_url, 1)
        out: dict[str, Any] = {}
        async with anyio.create_task_group() as group:
            group.start_soon(_collect, client, out, 7, 20, "retracted")
            await wait_until(lambda: worker.num_paused == 1)
            answer = await http.post("/pause_generation", json={"mode": "retract"})
            assert answer.json() == {"message": "Generation paused successfully.", "status": "ok"}
            assert app.registry.paused == "keep"
            worker.resume()
            await wait_until(lambda: app.registry.num_running() == 0)
            assert "finish" not in out  # held, not failed
            update = await http.post("/update_weights_from_disk", json={"model_path": "/w/1"})
            assert update.json()["success"] is True
            flushed = await http.post("/flush_cache")
            assert (flushed.status_code, flushed.text) == (200, "Cache flushed.\n")
            assert (await http.get("/flush_cache")).status_code == 200  # SGLang serves both methods
            answer = await http.post("/continue_generation", json={})
            assert answer.json() == {"message": "Generation continued successfully.", "status": "ok"}
        assert out["tokens"] == expected_tokens(7, 20)  # nothing lost or repeated
        assert out["finish"].num_resumes == 1
        assert loader.loads == [("/w/1", 0)]
        # SGLang's default mode is abort; an empty POST (no body) is taken too.
        aborted: dict[str, Any] = {}
        worker.gate = anyio.Event()  # the next stream pauses at index 5 again
        paused_before = worker.num_paused
        async with anyio.create_task_group() as group:
            group.start_soon(_collect, client, aborted, 5, 12, "aborted")
            await wait_until(lambda: worker.num_paused == paused_before + 1)
            assert (await http.post("/pause_generation")).json()["status"] == "ok"
            assert app.registry.paused == "abort"
            worker.resume()
        assert aborted["finish"].finish_reason == "abort"
        assert aborted["tokens"] == expected_tokens(5, 12)[:5]
        await http.post("/continue_generation")
        assert (await http.get("/is_paused")).json() == {"is_paused": False}
        for body in ({"mode": "later"}, {"mode": ["abort"]}, [1]):
            refused = await http.post("/pause_generation", json=body)
            assert refused.status_code == 400
            assert "retract" in refused.json()["error"]["message"]
        assert (await http.get("/is_paused")).json() == {"is_paused": False}


async def test_areal_pause_aborts_update_loads_and_continue_resumes() -> None:
    """AReaL's vLLM server routes: /areal_pause_generation aborts what runs (AReaL resubmits the
    partial output itself), /areal_update_weights {"model_path"}, /areal_continue_generation."""
    loader = FakeWeightLoader()
    async with (
        running_router(RouterConfig(admin_token=TOKEN), weight_loader=loader) as (url, app),
        running_worker(1, pause_at=4) as (w_url, worker),
        RouterClient(url, admin_token=TOKEN) as client,
        httpx.AsyncClient(base_url=url) as http,
    ):
        loader.app = app
        await client.register("s", w_url, 1)
        out: dict[str, Any] = {}
        async with anyio.create_task_group() as group:
            group.start_soon(_collect, client, out, 5, 12, "areal")
            await wait_until(lambda: worker.num_paused == 1)
            answer = await http.post("/areal_pause_generation", json={})
            assert answer.json() == {"success": True, "message": "Generation paused and all requests aborted"}
            worker.resume()
        assert out["finish"].finish_reason == "abort"
        assert out["tokens"] == expected_tokens(5, 12)[:4]
        update = await http.post("/areal_update_weights", json={"model_path": "/w/1", "load_format": "auto"})
        assert update.status_code == 200
        assert (update.json()["success"], update.json()["version"]) == (True, 1)
        refused = await http.post("/areal_update_weights", json={"model_path": "/w/bad"})
        assert refused.status_code == 400
        assert refused.json()["success"] is False
        assert "truncated" in refused.json()["message"]
        answer = await http.post("/areal_continue_generation")
        assert answer.json()["success"] is True
        assert (await http.get("/is_paused")).json() == {"is_paused": False}
        assert loader.loads == [("/w/1", 0)]
        assert app.registry.required_version == 1
        assert (await client.generate([3], 4, seed=5)).token_ids == expected_tokens(5, 4)


async def test_without_weight_servers_the_update_routes_answer_404() -> None:
    async with running_router(RouterConfig()) as (url, _app), httpx.AsyncClient(base_url=url) as http:
        answer = await http.post("/update_weights", json={"weight_dir": "/w"})
        assert answer.status_code == 404
        assert "belayer-shadow serve" in answer.json()["error"]["message"]


def test_the_fake_loader_is_a_weight_loader() -> None:
    assert isinstance(FakeWeightLoader(), WeightLoader)


@attrs.define
class FakeTransferLoader(FakeWeightLoader):
    """A `WeightTransferLoader`: fetching version N stages it (refuses N ending in 9, a corrupt
    delta); loading N commits it if it was staged. Records how many streams ran at each call."""

    inits: list[dict[str, Any]] = attrs.field(factory=list)
    fetches: list[tuple[int, str | None, str | None, int]] = attrs.field(factory=list)
    staged: int | None = None

    def init_weight_transfer(self, init_info: dict[str, Any]) -> dict[str, Any]:
        if "base_model_path" not in init_info:
            raise WeightLoadError("init_info needs 'base_model_path'")
        self.inits.append(init_info)
        return {"base_model_path": init_info["base_model_path"], "version": 0}

    def fetch_weights(self, target_version: int, sync_dir: str | None, uri: str | None) -> dict[str, Any]:
        if target_version % 10 == 9:
            raise WeightLoadError(
                f"delta {target_version} not fetched (corrupt: checksum); the previous ones stay"
            )
        self.fetches.append((target_version, sync_dir, uri, self.app.registry.num_running()))
        self.staged = target_version
        return {"target_version": target_version}

    def load_fetched(self, target_version: int) -> int:
        if self.staged != target_version:
            raise WeightLoadError(f"version {target_version} was not fetched (staged: {self.staged})")
        return self.load_weights(f"delta-{target_version}")


async def test_skyrl_delta_sync_fetches_while_generating_and_commits_while_a_kept_request_waits() -> None:
    loader = FakeTransferLoader()
    async with (
        running_router(RouterConfig(admin_token=TOKEN, resume_wait_s=1), weight_loader=loader) as (url, app),
        running_worker(1, pause_at=5) as (w_url, worker),
        RouterClient(url, admin_token=TOKEN) as client,
        httpx.AsyncClient(base_url=url) as http,
    ):
        loader.app = app
        await client.register("s", w_url, 1)
        init = await http.post("/init_weight_transfer_engine", json={"init_info": {"base_model_path": "/m"}})
        assert init.status_code == 200
        assert init.json()["message"] == "Weight transfer initialized"
        out: dict[str, Any] = {}
        async with anyio.create_task_group() as group:
            group.start_soon(_collect, client, out, 7, 20, "kept")
            await wait_until(lambda: worker.num_paused == 1)
            # SkyRL's order (DeltaTrainerWeightTransferEngine._apply_receiver_update): fetch while
            # generating, then pause (keep), start, update, finish, resume.
            fetched = await http.post("/fetch_weights", json={"target_version": 1, "sync_dir": "/sync"})
            assert fetched.json() == {"status": "ok", "target_version": 1, "result": {"target_version": 1}}
            assert loader.fetches == [(1, "/sync", None, 1)]  # the request was running meanwhile
            assert (
                await http.post("/pause", params={"mode": "keep", "clear_cache": "false"})
            ).status_code == 200
            worker.resume()
            await wait_until(lambda: app.registry.num_running() == 0)
            assert (await http.post("/start_weight_update")).json() == {"message": "Weight update started"}
            update = await http.post(
                "/update_weights", json={"update_info": {"target_version": 1, "sync_dir": "/sync"}}
            )
            assert update.status_code == 200
            assert update.json() == {
                "message": "Weights updated",
                "status": "ok",
                "target_version": 1,
                "version": 1,
            }
            finish = await http.post("/finish_weight_update")
            assert finish.json() == {"message": "Weight update finished", "version": 1}
            assert "finish" not in out  # still held
            assert (await http.post("/resume")).json() == {"status": "resumed"}
        assert out["tokens"] == expected_tokens(7, 20)  # one stream: nothing lost or repeated
        assert out["finish"].num_resumes == 1
        assert loader.loads == [("delta-1", 0)]  # committed with nothing running
        assert app.registry.required_version == 1
        assert {w["weight_version"] for w in await client.workers()} == {1}
        # A second round without a pause: the update waits for what runs, then commits.
        assert (await http.post("/fetch_weights", json={"target_version": "2"})).status_code == 200
        update = await http.post("/update_weights", json={"update_info": {"version": 2}})
        assert update.json()["version"] == 2
        assert (await http.post("/finish_weight_update", json={"weight_version": "2"})).status_code == 200
        assert (await http.get("/is_paused")).json() == {"is_paused": False}


async def test_refused_delta_calls_change_nothing_and_say_why() -> None:
    loader = FakeTransferLoader()
    async with (
        running_router(RouterConfig(admin_token=TOKEN), weight_loader=loader) as (url, app),
        running_worker(1) as (w_url, _worker),
        RouterClient(url, admin_token=TOKEN) as client,
        httpx.AsyncClient(base_url=url) as http,
    ):
        loader.app = app
        await client.register("s", w_url, 1)
        for body in ({}, {"init_info": "x"}):
            answer = await http.post("/init_weight_transfer_engine", json=body)
            assert answer.status_code == 400
            assert "init_info" in answer.json()["error"]["message"]
        refused_init = await http.post(
            "/init_weight_transfer_engine", json={"init_info": {"backend": "nccl"}}
        )
        assert refused_init.status_code == 400
        assert "base_model_path" in refused_init.json()["error"]["message"]
        bad_fetches: list[dict[str, Any]] = [{}, {"target_version": -1}, {"target_version": "x"}]
        for fetch in [*bad_fetches, {"target_version": True}]:
            answer = await http.post("/fetch_weights", json=fetch)
            assert answer.status_code == 400
            assert "target_version" in answer.json()["error"]["message"]
        bad_dir = await http.post("/fetch_weights", json={"target_version": 1, "sync_dir": 3})
        assert bad_dir.status_code == 400
        assert (await http.post("/fetch_weights", json={"target_version": 1})).status_code == 200
        corrupt = await http.post("/fetch_weights", json={"target_version": 9})
        assert corrupt.status_code == 400
        assert "checksum" in corrupt.json()["error"]["message"]
        assert loader.staged == 1  # still what was fetched before
        not_fetched = await http.post("/update_weights", json={"update_info": {"target_version": 2}})
        assert not_fetched.status_code == 400
        assert "not fetched" in not_fetched.json()["error"]["message"]
        no_version = await http.post("/update_weights", json={"update_info": {"sync_dir": "/s"}})
        assert no_version.status_code == 400
        assert "target_version" in no_version.json()["error"]["message"]
        assert app.registry.required_version is None  # nothing moved
        assert loader.loads == []
        assert (await http.get("/is_paused")).json() == {"is_paused": False}
        assert (await client.generate([3], 4, seed=1)).token_ids == expected_tokens(1, 4)


async def test_delta_routes_answer_404_without_a_transfer_loader() -> None:
    async with (
        running_router(RouterConfig(), weight_loader=FakeWeightLoader()) as (url, _app),
        httpx.AsyncClient(base_url=url) as http,
    ):
        for route, body in (
            ("/init_weight_transfer_engine", {"init_info": {"base_model_path": "/m"}}),
            ("/fetch_weights", {"target_version": 1}),
            ("/start_weight_update", None),
            ("/update_weights", {"update_info": {"target_version": 1}}),
            ("/finish_weight_update", None),
        ):
            answer = await http.post(route, json=body)
            assert answer.status_code == 404, route
            assert "belayer-shadow serve" in answer.json()["error"]["message"]
    async with running_router(RouterConfig()) as (url, _app), httpx.AsyncClient(base_url=url) as http:
        answer = await http.post("/fetch_weights", json={"target_version": 1})
        assert answer.status_code == 404


def test_the_fake_transfer_loader_is_a_weight_transfer_loader() -> None:
    assert isinstance(FakeTransferLoader(), WeightTransferLoader)
    assert not isinstance(FakeWeightLoader(), WeightTransferLoader)
