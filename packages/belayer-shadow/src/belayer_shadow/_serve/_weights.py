"""`SlotWeights`: a folder of safetensors into every slot's weight server, committed all at once.

The weight servers are double-buffered (belayer-gpumem): an update writes the inactive half and
`commit` flips it. So the whole folder is read and checked first (names, shapes and dtypes against
the servers' table; a truncated or malformed file fails here), then an update is opened on every
server and written, and only when every server holds the new weights are they committed, one
after the other. Any failure before the commits aborts every open update: the servers keep serving
the previous weights, untouched. A commit is a round trip to its server and may fail after others
succeeded (the server died between load and commit): then `PartialWeightCommitError` names the
slots that committed, and the router requires the new version, holding the others out.

What engines see: a worker re-reads its weight views only when it has nothing running (its
stepping thread), so a request is computed with one version from its first token to its last.
A slot that is out (unhealthy, or its memory restarting from scratch: `accepts`) is not waited
for: the update skips it and keeps the folder for it (`keep_if_out`), which its restart loads,
so it comes back on the current version; one that came back during the update is written last.

The router's control plane makes that strict: it loads only when no request is running (after
`/pause`, or by waiting for the running ones), so the next request starts on the new version.

SkyRL's checkpoint-delta weight sync (belayer-router's `WeightTransferLoader`): `init_weight_transfer`
starts a chain of deltas at a base checkpoint, `fetch_weights` decodes and checks the published
deltas up to a version and stages its weights as a folder (`DeltaChain`; nothing served changes),
`load_fetched` loads that folder as `load_weights` loads any.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import attrs
import torch

from belayer_gpumem import BelayerGpumemError, WeightClient, WeightUpdate
from belayer_router import PartialWeightCommitError, WeightLoadError
from belayer_shadow._engine._loader import load_safetensors
from belayer_shadow._errors import WeightsError
from belayer_shadow._serve._delta import DeltaChain

__all__ = ["SlotWeights", "check_weights"]


def check_weights(tensors: Mapping[str, torch.Tensor], table: Mapping[str, object], source: str) -> None:
    """WeightsError unless `tensors` has every name of `table` with its shape and dtype (an extra
    `lm_head.weight` is allowed: tied embeddings)."""
    missing = sorted(set(table) - set(tensors))
    extra = sorted(set(tensors) - set(table) - {"lm_head.weight"})
    if missing or extra:
        raise WeightsError(
            f"{source}: the tensors do not match the served model: missing {missing[:3]} "
            f"({len(missing)} in all), unexpected {extra[:3]} ({len(extra)} in all)"
        )
    for name, spec in table.items():
        tensor = tensors[name]
        shape, dtype = tuple(getattr(spec, "shape", ())), str(getattr(spec, "dtype", ""))
        if tuple(tensor.shape) != shape:
            raise WeightsError(f"{source}: {name} has shape {tuple(tensor.shape)}, the served model {shape}")
        if str(tensor.dtype).removeprefix("torch.") != dtype:
            raise WeightsError(
                f"{source}: {name} is {str(tensor.dtype).removeprefix('torch.')}, the served model "
                f"{dtype}; save the weights in {dtype}"
            )


@attrs.define
class SlotWeights:
    """The weight servers of a service's slots, as belayer-router's `WeightLoader`."""

    sockets: Sequence[Path]
    num_loads: int = 0
    # Called with the folder once every server committed it (a slot keeps a copy, so that a
    # restart from scratch reloads this version: `SlotSupervisor.keep_weights`).
    keepers: Sequence[Callable[[Path], None]] = ()
    # The router's name of each slot, in the order of `sockets` (a partial commit names them).
    names: Sequence[str] = ()
    # How long to wait for each weight server to answer an attach: short, so that one hung server
    # fails the update (nothing changed) quickly instead of stalling it (gpumem's default is 30 s).
    attach_timeout_s: float = 5.0
    # Per slot, in the order of `sockets`: whether it takes an update now
    # (`SlotSupervisor.accepts_weights`), and, for one that does not, keep the folder for it if it
    # is still out (`SlotSupervisor.keep_weights_if_out`; False: it came back, write it).
    # Without them every slot is written.
    accepts: Sequence[Callable[[], bool]] = ()
    keep_if_out: Sequence[Callable[[Path], bool]] = ()
    skipped: list[str] = attrs.field(factory=list)  # the slots the last update skipped (out)
    # Where SkyRL delta versions fetched are written (the service's run folder); a temporary
    # folder when not given.
    scratch_dir: Path | None = None
    delta: DeltaChain | None = None  # the delta chain, from `init_weight_transfer` on

    def init_weight_transfer(self, init_info: dict[str, Any]) -> dict[str, Any]:
        """vLLM's ``/init_weight_transfer_engine`` for SkyRL's delta backend: a chain of deltas
        starts at ``init_info["base_model_path"]`` (a folder of safetensors on this machine, the
        served model's tensors), version 0. Other fields (``local_checkpoint_dir``, load formats,
        worker counts) concern vLLM's own receiver and are ignored."""
        base = init_info.get("base_model_path")
        if not isinstance(base, str) or not base:
            raise WeightLoadError(
                f"init_info needs 'base_model_path' (a checkpoint folder on this machine), got {base!r}: "
                "this service takes SkyRL's checkpoint-delta weight sync (weight_sync_backend='delta'), "
                "not NCCL or CUDA IPC"
            )
        folder = Path(base)
        try:
            if not folder.is_dir():
                raise WeightsError(f"base_model_path {base!r} is not a folder on this machine")
            self._check(load_safetensors(folder), base)
            if self.delta is None:
                scratch = self.scratch_dir or Path(tempfile.mkdtemp(prefix="belayer-delta-"))
                self.delta = DeltaChain(scratch)
            self.delta.init(folder)
        except (WeightsError, BelayerGpumemError, OSError, RuntimeError, ValueError) as error:
            raise WeightLoadError(
                f"weight transfer not initialized ({type(error).__name__}: {error})"
            ) from error
        return {"base_model_path": base, "version": 0}

    def fetch_weights(self, target_version: int, sync_dir: str | None, uri: str | None) -> dict[str, Any]:
        """SkyRL's ``/fetch_weights``: decode and check the deltas up to ``target_version`` and
        stage its weights; the weight servers are not touched (requests go on)."""
        chain = self._chain()
        try:
            return chain.fetch(target_version, sync_dir, uri, self._check)
        except (WeightsError, BelayerGpumemError, OSError, RuntimeError, ValueError) as error:
            raise WeightLoadError(
                f"delta weights up to version {target_version} not fetched ({type(error).__name__}: "
                f"{error}); the served weights are unchanged, the last version fetched is {chain.version}"
            ) from error

    def load_fetched(self, target_version: int) -> int:
        """vLLM's ``/update_weights {"update_info": {"target_version"}}``: load the version fetched
        last into every slot and commit, as `load_weights` does with a folder."""
        chain = self._chain()
        with chain.lock:
            try:
                folder = chain.ready(target_version)
            except WeightsError as error:
                raise WeightLoadError(f"{error}; the served weights are unchanged") from error
            return self.load_weights(str(folder))

    def _chain(self) -> DeltaChain:
        if self.delta is None:
            raise WeightLoadError("no delta chain: call POST /init_weight_transfer_engine first")
        return self.delta

    def _check(self, tensors: Mapping[str, torch.Tensor], source: str) -> None:
        """`check_weights` against the table of the first slot that takes weights now."""
        for index, socket in enumerate(self.sockets):
            if index < len(self.accepts) and not self.accepts[index]():
                continue
            client = WeightClient.attach(socket, timeout_s=self.attach_timeout_s)
            try:
                check_weights(tensors, client.layout.by_name, source)
            finally:
                client.detach()
            return
        raise WeightsError(f"{source}: every slot is out (restarting or unhealthy), none can check it")

    def load_weights(self, weight_dir: str) -> int:
        """Load `weight_dir` (a folder of `*.safetensors`) into every server and commit; returns
        the number of tensors written. Raises belayer-router's `WeightLoadError` (the router
        answers 400) when nothing was changed."""
        folder = Path(weight_dir)
        if not folder.is_dir():
            raise WeightLoadError(
                f"weight folder {weight_dir!r} does not exist or is not a folder (on this machine); "
                "give a folder of *.safetensors written with save_pretrained"
            )
        committed: list[int] = []
        skipped: list[int] = []
        out = [i for i in range(len(self.sockets)) if i < len(self.accepts) and not self.accepts[i]()]
        if out and len(out) == len(self.sockets):
            raise WeightLoadError(
                f"weights from {weight_dir!r} not loaded: every slot is out (restarting or unhealthy), "
                "so none can check them; the previous ones stay; retry once a slot serves"
            )
        try:
            tensors = load_safetensors(folder)
            with ExitStack() as stack:
                opened = [i for i in range(len(self.sockets)) if i not in out]
                updates = [
                    self._open(self.sockets[i], stack, tensors, weight_dir, self.attach_timeout_s)
                    for i in opened
                ]
                for update in updates:
                    for name, view in update.tensors().items():
                        view.copy_(tensors[name])
                for index, update in zip(opened, updates, strict=True):  # a commit may fail
                    update.commit()
                    committed.append(index)
            # The slots that were out: each keeps the folder for its restart, or, back meanwhile,
            # is written now (checked above against a slot that took it).
            for index in out:
                if self.keep_if_out[index](folder):
                    skipped.append(index)
                    continue
                with ExitStack() as stack:
                    late = self._open(self.sockets[index], stack, tensors, weight_dir, self.attach_timeout_s)
                    for name, view in late.tensors().items():
                        view.copy_(tensors[name])
                    late.commit()
                committed.append(index)
        except (WeightsError, BelayerGpumemError, OSError, RuntimeError) as error:
            if committed:
                self._keep(folder, committed)
                names = tuple(self._name(index) for index in committed)
                raise PartialWeightCommitError(
                    f"weights from {weight_dir!r} committed on {list(names)} only, then failed "
                    f"({type(error).__name__}: {error}); the other slots still hold the previous weights",
                    names,
                ) from error
            raise WeightLoadError(
                f"weights from {weight_dir!r} not loaded ({type(error).__name__}: {error}); "
                "the previous ones stay"
            ) from error
        self.num_loads += 1
        self.skipped = [self._name(index) for index in skipped]
        self._keep(folder, committed)
        return len(tensors)

    def _name(self, index: int) -> str:
        return self.names[index] if index < len(self.names) else f"slot{index}"

    def _keep(self, folder: Path, committed: Sequence[int]) -> None:
        for index in committed:
            if index < len(self.keepers):
                self.keepers[index](folder)

    @staticmethod
    def _open(
        socket: Path,
        stack: ExitStack,
        tensors: Mapping[str, torch.Tensor],
        source: str,
        timeout_s: float = 30.0,
    ) -> WeightUpdate:
        client = WeightClient.attach(socket, timeout_s=timeout_s)
        stack.callback(client.detach)
        check_weights(tensors, client.layout.by_name, source)
        update = client.update()
        stack.enter_context(update)  # leaving with an error aborts it; after commit, a no-op
        return update
