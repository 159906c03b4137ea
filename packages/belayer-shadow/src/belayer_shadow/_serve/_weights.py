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
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path

import attrs
import torch

from belayer_gpumem import BelayerGpumemError, WeightClient, WeightUpdate
from belayer_router import PartialWeightCommitError, WeightLoadError
from belayer_shadow._engine._loader import load_safetensors
from belayer_shadow._errors import WeightsError

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
