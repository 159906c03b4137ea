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
A slot that is out (unhealthy, or its memory restarting from scratch: `accepts`; or its server
refused the connection and its supervisor calls it out within 2 s) is not waited
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
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import torch

from belayer_gpumem import BelayerGpumemError, ServerGoneError, WeightClient, WeightUpdate
from belayer_router import PartialWeightCommitError, WeightLoadError
from belayer_shadow._engine._loader import load_safetensors
from belayer_shadow._errors import WeightsError
from belayer_shadow._serve._delta import DeltaChain

if TYPE_CHECKING:
    from belayer_shadow._workers._slot import SlotSupervisor

__all__ = ["PreparedWeights", "SlotWeights", "check_weights"]


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

    @classmethod
    def for_slots(cls, supervisors: Sequence[SlotSupervisor]) -> SlotWeights:
        """The weight servers of these slots, each wired to its supervisor: its socket, its name,
        `keep_weights` after a commit, `accepts_weights` and `keep_weights_if_out` for a slot that
        is out (`belayer-shadow serve`'s slots; belayer-cluster's slot hosts, one slot each)."""
        return cls(
            [supervisor.weights_socket for supervisor in supervisors],
            keepers=[supervisor.keep_weights for supervisor in supervisors],
            names=[supervisor.config.slot for supervisor in supervisors],
            accepts=[supervisor.accepts_weights for supervisor in supervisors],
            keep_if_out=[supervisor.keep_weights_if_out for supervisor in supervisors],
        )

    def load_weights(self, weight_dir: str) -> int:
        """Load `weight_dir` (a folder of `*.safetensors`) into every server and commit; returns
        the number of tensors written. Raises belayer-router's `WeightLoadError` (the router
        answers 400) when nothing was changed."""
        out = [i for i in range(len(self.sockets)) if i < len(self.accepts) and not self.accepts[i]()]
        if out and len(out) == len(self.sockets):
            raise WeightLoadError(
                f"weights from {weight_dir!r} not loaded: every slot is out (restarting or unhealthy), "
                "so none can check them; the previous ones stay; retry once a slot serves"
            )
        return self.prepare(weight_dir).commit()

    def prepare(self, weight_dir: str) -> PreparedWeights:
        """The first half of `load_weights`: read and check `weight_dir` whole, open an update on
        every server that takes one now and write it there (the inactive half); nothing is
        served from it until `PreparedWeights.commit`. `abort` (or any failure) leaves every server
        as it was. Raises `WeightLoadError` when nothing was changed. A slot that is out is not
        written here (`PreparedWeights.out`); the commit keeps the folder for it, or writes it if
        it came back meanwhile. Several `SlotWeights` prepared first and committed after make one
        update over weight servers that no single process reaches (belayer-cluster's nodes)."""
        folder = Path(weight_dir)
        if not folder.is_dir():
            raise WeightLoadError(
                f"weight folder {weight_dir!r} does not exist or is not a folder (on this machine); "
                "give a folder of *.safetensors written with save_pretrained"
            )
        out = [i for i in range(len(self.sockets)) if i < len(self.accepts) and not self.accepts[i]()]
        stack = ExitStack()
        try:
            tensors = load_safetensors(folder)
            opened: list[int] = []
            updates: list[WeightUpdate] = []
            for i in range(len(self.sockets)):
                if i in out:
                    continue
                try:
                    updates.append(
                        self._open(self.sockets[i], stack, tensors, weight_dir, self.attach_timeout_s)
                    )
                except ServerGoneError:
                    if not self._went_out(i):
                        raise
                    out.append(i)  # killed just now: its restart loads the folder kept at commit
                    continue
                opened.append(i)
            for update in updates:
                for name, view in update.tensors().items():
                    view.copy_(tensors[name])
        except (WeightsError, BelayerGpumemError, OSError, RuntimeError) as error:
            _close_aborting(stack, error)  # the servers keep the previous weights
            raise WeightLoadError(
                f"weights from {weight_dir!r} not loaded ({type(error).__name__}: {error}); "
                "the previous ones stay"
            ) from error
        return PreparedWeights(self, weight_dir, tensors, opened, updates, out, stack)

    def _went_out(self, index: int, grace_s: float = 2.0) -> bool:
        """Whether slot `index`, whose weight server just refused a connection, is out now: a
        server killed a moment ago refuses before its supervisor sees the process gone, so this
        polls `accepts` for `grace_s`. False when the slot still claims to take weights (a real
        failure, the update fails) or has no such check."""
        if index >= len(self.accepts):
            return False
        deadline = time.monotonic() + grace_s
        while self.accepts[index]():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)
        return True

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


@attrs.define(eq=False)
class PreparedWeights:
    """An update `SlotWeights.prepare` wrote into the inactive half of its servers, not committed."""

    owner: SlotWeights
    weight_dir: str
    tensors: Mapping[str, torch.Tensor]
    opened: list[int]  # the servers written, by index into the owner's sockets
    updates: list[WeightUpdate]
    out_indices: list[int]  # the slots that were out (not written)
    _stack: ExitStack

    @property
    def out(self) -> list[str]:
        """The names of the slots that were out when prepared (not written)."""
        return [self.owner._name(index) for index in self.out_indices]

    def abort(self) -> None:
        """Abort every open update: every server keeps serving the previous weights."""
        _close_aborting(self._stack, WeightLoadError(f"the update from {self.weight_dir!r} was aborted"))

    def commit(self) -> int:
        """Commit on every server written, one after the other, then keep the folder for (or
        write) the slots that were out; returns the number of tensors. `WeightLoadError` when no
        server committed, `PartialWeightCommitError` naming those that did when a later one failed."""
        owner, folder, weight_dir = self.owner, Path(self.weight_dir), self.weight_dir
        committed: list[int] = []
        skipped: list[int] = []
        try:
            with self._stack:  # leaving it aborts what was not committed and detaches
                for index, update in zip(self.opened, self.updates, strict=True):  # a commit may fail
                    update.commit()
                    committed.append(index)
            # The slots that were out: each keeps the folder for its restart, or, back meanwhile,
            # is written now (checked against the servers' table as it is opened).
            for index in self.out_indices:
                if owner.keep_if_out[index](folder):
                    skipped.append(index)
                    continue
                with ExitStack() as stack:
                    late = owner._open(
                        owner.sockets[index], stack, self.tensors, weight_dir, owner.attach_timeout_s
                    )
                    for name, view in late.tensors().items():
                        view.copy_(self.tensors[name])
                    late.commit()
                committed.append(index)
        except (WeightsError, BelayerGpumemError, OSError, RuntimeError) as error:
            if committed:
                owner._keep(folder, committed)
                names = tuple(owner._name(index) for index in committed)
                raise PartialWeightCommitError(
                    f"weights from {weight_dir!r} committed on {list(names)} only, then failed "
                    f"({type(error).__name__}: {error}); the other slots still hold the previous weights",
                    names,
                ) from error
            raise WeightLoadError(
                f"weights from {weight_dir!r} not loaded ({type(error).__name__}: {error}); "
                "the previous ones stay"
            ) from error
        owner.num_loads += 1
        owner.skipped = [owner._name(index) for index in skipped]
        owner._keep(folder, committed)
        return len(self.tensors)


def _close_aborting(stack: ExitStack, error: BaseException) -> None:
    """Close `stack` as if `error` were raised in it: an open `WeightUpdate` aborts (leaving one
    without an error would commit it)."""
    stack.__exit__(type(error), error, error.__traceback__)
