"""The RL control plane of the router app: pause and resume generation, load weights by folder.

The routes RL frameworks already call on vLLM and SGLang servers, with their names and shapes:
vLLM's ``POST /pause?mode=`` / ``POST /resume`` / ``GET /is_paused`` / ``GET /get_world_size`` /
``POST /reset_prefix_cache`` / ``POST /tokenize`` / ``POST /detokenize``, prime-rl's
``POST /update_weights {"weight_dir"}`` and SGLang's ``POST /update_weights_from_disk
{"model_path"}`` (slime, AReaL). Aliases under the names other servers use: SGLang's (slime)
``POST /pause_generation {"mode"}`` (``abort``; ``retract`` and ``in_place`` are ``keep`` here),
``POST /continue_generation``, ``GET|POST /flush_cache``; AReaL's vLLM extension
``POST /areal_pause_generation`` (abort), ``POST /areal_continue_generation``, ``POST
/areal_update_weights {"model_path"}``, each answering in its server's shape. The router holds no weights: it reaches the slots' weight
servers through a `WeightLoader` that whoever assembles the service passes in (belayer-shadow's
``serve``), so the router imports no sibling.

SkyRL's checkpoint-delta weight sync (``weight_sync_backend="delta"``) calls vLLM's weight-transfer
routes, served here when the loader is a `WeightTransferLoader`: ``POST
/init_weight_transfer_engine {"init_info": {"base_model_path", ...}}`` (the chain of deltas starts
at that checkpoint), ``POST /fetch_weights {"target_version", "sync_dir", "uri"}`` (reads, decodes
and checks the published deltas up to that version and stages the result; generation goes on
meanwhile, the served weights are not touched), ``POST /start_weight_update``, ``POST
/update_weights {"update_info": {"target_version"}}`` (commits the staged version on every slot,
as a folder update: with no request running, one new version), ``POST /finish_weight_update``.

Pause modes (vLLM's): ``wait`` (no new request starts; the call returns once the running ones
have finished), ``keep`` (the running requests are cut at once and held with every token so far
journaled; after ``/resume`` they continue from prompt + those tokens, the KV recomputed on the
weights then served: the client sees one stream, nothing lost or repeated), ``abort`` (the
running requests end at once, ``finish_reason: "abort"``, with the tokens they have).

A weight update runs only with no request running: while paused it loads at once; otherwise it
pauses in ``wait`` mode itself, loads, and resumes. ``/pause`` and ``/resume`` sent during an
update wait for it to end (they are serialized with it): a resume never lets requests run in the
middle of a load, and the update's own resume never undoes a pause sent meanwhile. So no response mixes two versions: a request
runs on one version from its first token to its last, and a ``keep`` request cut before an update
continues after it on the new version (its earlier tokens stay as they were). Each update bumps
the weight version every slot reports and the router requires (`Registry.require_version`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable
from urllib.parse import parse_qs

import anyio

from belayer_router._core._config import RouterConfig
from belayer_router._core._metrics import Metrics
from belayer_router._core._registry import Registry
from belayer_router._errors import (
    InvalidRequestError,
    NotFoundError,
    PartialWeightCommitError,
    WeightLoadError,
)
from belayer_router._server._asgi import Receive, Send, read_json, send_json, send_text

__all__ = ["PAUSE_MODES", "SGLANG_PAUSE_MODES", "ControlRoutes", "WeightLoader", "WeightTransferLoader"]

PAUSE_MODES = ("abort", "wait", "keep")

# SGLang's `/pause_generation` modes and the pause each one is here: `retract` (requests back to
# the queue, their KV freed, recomputed later) and `in_place` (frozen with their KV) both continue
# after `/continue_generation` with nothing lost or repeated, which is `keep`.
SGLANG_PAUSE_MODES = {"abort": "abort", "retract": "keep", "in_place": "keep"}


@runtime_checkable
class WeightLoader(Protocol):
    """What the router needs from the slots' weight servers (belayer-shadow's `SlotWeights`).

    ``load_weights`` loads a folder of safetensors into every slot's weight server and commits
    them all at once, or changes nothing and raises `WeightLoadError` (a 400) saying why. When
    a commit fails after others succeeded it raises `PartialWeightCommitError` naming the slots
    that committed (the router then holds the others out). The router calls it in a worker
    thread, never while a request runs.
    """

    def load_weights(self, weight_dir: str) -> Any:
        """Load ``weight_dir`` everywhere and commit, or raise `WeightLoadError` changing nothing."""
        ...


@runtime_checkable
class WeightTransferLoader(WeightLoader, Protocol):
    """A `WeightLoader` that also takes SkyRL's checkpoint-delta weight sync (belayer-shadow's
    `SlotWeights`). Each method raises `WeightLoadError` (a 400) changing nothing when refused;
    the router calls them in a worker thread.

    - ``init_weight_transfer(init_info)``: vLLM's ``init_info`` dict (SkyRL's delta backend:
      ``base_model_path``, the checkpoint its deltas start from, at version 0).
    - ``fetch_weights(target_version, sync_dir, uri)``: read, decode and check the deltas after
      the last one fetched up to ``target_version`` and stage the weights they make; the served
      weights are not touched (generation goes on). Returns what to answer (JSON).
    - ``load_fetched(target_version)``: commit the staged ``target_version`` on every slot, as
      ``load_weights`` does with a folder (the router calls it with no request running).
    """

    def init_weight_transfer(self, init_info: dict[str, Any]) -> Any:
        """Start a delta chain at ``init_info["base_model_path"]`` (version 0)."""
        ...

    def fetch_weights(self, target_version: int, sync_dir: str | None, uri: str | None) -> Any:
        """Stage ``target_version``: decoded and checked whole, nothing served changes."""
        ...

    def load_fetched(self, target_version: int) -> Any:
        """Commit the staged ``target_version`` on every slot, or raise changing nothing."""
        ...


def _query(scope: dict[str, Any]) -> dict[str, str]:
    parsed = parse_qs(scope.get("query_string", b"").decode(errors="replace"))
    return {key: values[-1] for key, values in parsed.items()}


def _string_field(body: Any, name: str) -> str:
    value = body.get(name) if isinstance(body, dict) else None
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(f"field {name!r} must be a folder path (a non-empty string), got {value!r}")
    return value


def _target_version(info: Any, where: str) -> int:
    """vLLM's (SkyRL's) ``target_version`` (or ``version``): a non-negative integer."""
    value = info.get("target_version", info.get("version")) if isinstance(info, dict) else None
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidRequestError(f"{where} needs 'target_version', a non-negative integer, got {value!r}")
    return value


def _optional_path(body: dict[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(f"field {name!r} must be a path (a non-empty string), got {value!r}")
    return value


class ControlRoutes:
    """The control-plane routes, mixed into `RouterApp`."""

    config: RouterConfig
    registry: Registry
    metrics: Metrics
    weight_loader: WeightLoader | None
    _weights_lock: anyio.Lock

    def _admin_change(self, op: dict[str, Any]) -> None:
        raise NotImplementedError

    async def _body(self, receive: Receive) -> Any:
        raise NotImplementedError

    async def _control(
        self, method: str, route: str, scope: dict[str, Any], receive: Receive, send: Send
    ) -> None:
        match method, route:
            case "POST", "pause":
                mode = _query(scope).get("mode", "abort")
                if mode not in PAUSE_MODES:
                    raise InvalidRequestError(f"pause mode must be one of {list(PAUSE_MODES)}, got {mode!r}")
                await self._pause(mode)
                await send_json(send, 200, {"status": "paused", "mode": mode})
            case "POST", "resume":
                await self._resume()
                await send_json(send, 200, {"status": "resumed"})
            case "POST", "pause_generation":  # SGLang (slime)
                body = await self._optional_body(receive)
                sglang_mode = body.get("mode", "abort") if isinstance(body, dict) else None
                if not isinstance(sglang_mode, str) or sglang_mode not in SGLANG_PAUSE_MODES:
                    raise InvalidRequestError(
                        f"pause_generation mode must be one of {list(SGLANG_PAUSE_MODES)}, got {sglang_mode!r}"
                    )
                await self._pause(SGLANG_PAUSE_MODES[sglang_mode])
                await send_json(send, 200, {"message": "Generation paused successfully.", "status": "ok"})
            case "POST", "continue_generation":  # SGLang (slime)
                await self._optional_body(receive)
                await self._resume()
                await send_json(send, 200, {"message": "Generation continued successfully.", "status": "ok"})
            case "GET" | "POST", "flush_cache":  # SGLang: engines here drop their prefixes at each update
                await send_text(send, 200, "Cache flushed.\n", "text/plain; charset=utf-8")
            case "POST", "areal_pause_generation":  # AReaL's vLLM server: abort everything running
                await self._optional_body(receive)
                await self._pause("abort")
                await send_json(
                    send, 200, {"success": True, "message": "Generation paused and all requests aborted"}
                )
            case "POST", "areal_continue_generation":
                await self._optional_body(receive)
                await self._resume()
                await send_json(send, 200, {"success": True, "message": "Generation continued"})
            case "GET", "is_paused":
                await send_json(send, 200, {"is_paused": self.registry.paused is not None})
            case "GET" | "POST", "get_world_size":
                slots = [s for s in self.registry.slots.values() if s.healthy and s.worker is not None]
                await send_json(send, 200, {"world_size": len(slots)})
            case "POST", "reset_prefix_cache":
                # Engines behind the router drop cached prefixes at every weight change themselves
                # (the built-in engine keeps none between requests): nothing stale can be served.
                await send_json(send, 200, {"status": "ok"})
            case "POST", "update_weights":
                body = await self._body(receive)
                if isinstance(body, dict) and "update_info" in body and "weight_dir" not in body:
                    # vLLM's weight-transfer shape (SkyRL's delta backend): commit what was fetched.
                    target = _target_version(body["update_info"], "update_info")
                    transfer = self._transfer_loader()
                    version = await self._update(lambda: transfer.load_fetched(target))
                    await send_json(
                        send,
                        200,
                        {
                            "message": "Weights updated",
                            "status": "ok",
                            "target_version": target,
                            "version": version,
                        },
                    )
                    return
                weight_dir = _string_field(body, "weight_dir")
                version = await self.update_weights(weight_dir)
                await send_json(send, 200, {"status": "ok", "weight_dir": weight_dir, "version": version})
            case "POST", "init_weight_transfer_engine":
                body = await self._body(receive)
                init_info = body.get("init_info") if isinstance(body, dict) else None
                if not isinstance(init_info, dict):
                    raise InvalidRequestError(f"body needs 'init_info', an object, got {init_info!r}")
                transfer = self._transfer_loader()
                result = await anyio.to_thread.run_sync(transfer.init_weight_transfer, init_info)
                await send_json(send, 200, {"message": "Weight transfer initialized", "result": result})
            case "POST", "fetch_weights":
                body = await self._body(receive)
                if not isinstance(body, dict):
                    raise InvalidRequestError("body must be an object with 'target_version'")
                target = _target_version(body, "fetch_weights")
                sync_dir, uri = _optional_path(body, "sync_dir"), _optional_path(body, "uri")
                transfer = self._transfer_loader()
                # Not under the update lock: the fetch overlaps generation (SkyRL fetches before
                # it pauses); the loader serializes fetches and loads itself.
                result = await anyio.to_thread.run_sync(transfer.fetch_weights, target, sync_dir, uri)
                await send_json(send, 200, {"status": "ok", "target_version": target, "result": result})
            case "POST", "start_weight_update":
                await self._optional_body(receive)
                self._transfer_loader()
                await send_json(send, 200, {"message": "Weight update started"})
            case "POST", "finish_weight_update":
                await self._optional_body(receive)  # vLLM's optional {"weight_version"}: not kept
                self._transfer_loader()
                await send_json(
                    send,
                    200,
                    {"message": "Weight update finished", "version": self.registry.required_version or 0},
                )
            case "POST", "update_weights_from_disk" | "areal_update_weights":  # SGLang's; AReaL's alias
                model_path = _string_field(await self._body(receive), "model_path")
                try:
                    version = await self.update_weights(model_path)
                except WeightLoadError as error:  # SGLang's (and AReaL's) shape for a refused update
                    await send_json(send, 400, {"success": False, "message": str(error)})
                    return
                message = f"weights from {model_path} loaded into every slot (version {version})"
                await send_json(send, 200, {"success": True, "message": message, "version": version})
            case _:
                raise NotFoundError(f"no route {method} /{route}; see the belayer-router README")

    async def _optional_body(self, receive: Receive) -> Any:
        """The JSON body, ``{}`` when there is none (the alias routes take an empty POST)."""
        return await read_json(receive, self.config.max_body_bytes, empty={})

    async def _pause(self, mode: str) -> None:
        # Serialized with weight updates: a pause sent during one takes effect after it
        # (the update's own resume must not undo it).
        async with self._weights_lock:
            self.registry.pause(mode)
        if mode == "wait":
            await self.registry.wait_idle()

    async def _resume(self) -> None:
        async with self._weights_lock:  # never resume in the middle of a weight load
            self.registry.resume()

    def _loader(self) -> WeightLoader:
        loader = self.weight_loader
        if loader is None:
            raise NotFoundError(
                "this router has no weight servers behind it; weight updates need a service "
                "started with `belayer-shadow serve` (RouterApp(weight_loader=...))"
            )
        return loader

    def _transfer_loader(self) -> WeightTransferLoader:
        loader = self._loader()
        if not isinstance(loader, WeightTransferLoader):
            raise NotFoundError(
                'this router\'s weight loader takes folders only (POST /update_weights {"weight_dir"}); '
                "SkyRL's delta weight sync needs a service started with `belayer-shadow serve`"
            )
        return loader

    async def update_weights(self, weight_dir: str) -> int:
        """Load ``weight_dir`` into every slot (no request running meanwhile); the new version."""
        loader = self._loader()
        return await self._update(lambda: loader.load_weights(weight_dir))

    async def _update(self, load: Callable[[], Any]) -> int:
        """Run ``load`` (in a thread) with no request running, then bump the version."""
        async with self._weights_lock:
            pause_here = self.registry.paused is None
            if pause_here:
                self.registry.pause("wait")
            try:
                await self.registry.wait_idle()
                try:
                    await anyio.to_thread.run_sync(load)
                except PartialWeightCommitError as error:
                    # Some slots flipped to the new weights, others not: a new version that only
                    # the committed slots report, so the version gate holds the others out.
                    version = self._new_version(error.committed)
                    raise PartialWeightCommitError(
                        f"{error}; version {version} is required now: the slots that did not "
                        "commit are held out until an update reaches them (push the weights again)",
                        error.committed,
                    ) from error
                return self._new_version(list(self.registry.slots))
            finally:
                if pause_here:
                    self.registry.resume()

    def _new_version(self, committed: Sequence[str]) -> int:
        """Bump the weight version: the ``committed`` slots report it and the router requires it."""
        reported = [s.weight_version or 0 for s in self.registry.slots.values()]
        version = max([self.registry.required_version or 0, *reported]) + 1
        for slot in committed:
            if slot in self.registry.slots:
                self._admin_change({"op": "slot_version", "slot": slot, "version": version})
        self._admin_change({"op": "require_version", "version": version})
        self.metrics.num_weight_updates += 1
        return version
