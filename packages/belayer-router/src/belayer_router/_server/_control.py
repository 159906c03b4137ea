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

from collections.abc import Sequence
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

__all__ = ["PAUSE_MODES", "SGLANG_PAUSE_MODES", "ControlRoutes", "WeightLoader"]

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


def _query(scope: dict[str, Any]) -> dict[str, str]:
    parsed = parse_qs(scope.get("query_string", b"").decode(errors="replace"))
    return {key: values[-1] for key, values in parsed.items()}


def _string_field(body: Any, name: str) -> str:
    value = body.get(name) if isinstance(body, dict) else None
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(f"field {name!r} must be a folder path (a non-empty string), got {value!r}")
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
                weight_dir = _string_field(await self._body(receive), "weight_dir")
                version = await self.update_weights(weight_dir)
                await send_json(send, 200, {"status": "ok", "weight_dir": weight_dir, "version": version})
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

    async def update_weights(self, weight_dir: str) -> int:
        """Load ``weight_dir`` into every slot (no request running meanwhile); the new version."""
        loader = self.weight_loader
        if loader is None:
            raise NotFoundError(
                "this router has no weight servers behind it; weight updates need a service "
                "started with `belayer-shadow serve` (RouterApp(weight_loader=...))"
            )
        async with self._weights_lock:
            pause_here = self.registry.paused is None
            if pause_here:
                self.registry.pause("wait")
            try:
                await self.registry.wait_idle()
                try:
                    await anyio.to_thread.run_sync(loader.load_weights, weight_dir)
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
