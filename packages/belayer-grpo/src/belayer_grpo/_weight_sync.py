"""Pushing the trainer's weights to every slot's weight server: one atomic update and version bump each.

The barrier is the order of operations: the trainer pushes after its optimizer step and starts
the next rollout only once every server has committed the new version; an idle worker re-reads
its weight views before it admits new requests (belayer-shadow), so every sample of the next step
comes from the new weights. The trainer checks this each step by comparing the router's
logprobs with its own (`logprob_gap` in the metrics).

Every push is also kept (``keepers``, one per socket: belayer-shadow's
`SlotSupervisor.keep_weights`): the weights are saved once to ``keep_file`` and each slot keeps a
copy with the version its server committed, so a slot restarted from scratch (its memory lost)
comes back with the trainer's current weights at the current version, not the start's.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs
import torch

from belayer_grpo._errors import BelayerGrpoError

__all__ = ["WeightSync"]


@attrs.define
class WeightSync:
    """Writes weights into the weight servers at ``sockets``; remembers the versions they report."""

    sockets: Sequence[Path]
    # Called as keeper(file, version) after a push, for the slot of the socket at the same index.
    keepers: Sequence[Callable[[Path, int], None]] = ()
    keep_file: Path | None = None  # where the pushed weights are saved for the keepers
    versions: list[int] = attrs.field(factory=list)
    num_pushes: int = 0
    seconds: float = 0.0

    def push(self, model: torch.nn.Module) -> list[int]:
        """Write ``model``'s parameters to every server (blocking; call from a thread)."""
        import time

        from belayer_gpumem import BelayerGpumemError
        from belayer_shadow import BelayerShadowError, fill_weight_server

        start = time.monotonic()
        tensors = {name: tensor.detach() for name, tensor in model.state_dict().items()}
        versions = []
        for socket in self.sockets:
            try:
                versions.append(fill_weight_server(socket, tensors))
            except (BelayerGpumemError, BelayerShadowError, OSError) as error:
                raise BelayerGrpoError(f"pushing weights to {socket} failed: {error}") from error
        self.versions = versions
        if self.keepers:
            self._keep(tensors, versions)
        self.num_pushes += 1
        self.seconds += time.monotonic() - start
        return versions

    def _keep(self, tensors: dict[str, torch.Tensor], versions: Sequence[int]) -> None:
        """Save the pushed weights once (written aside, then renamed) and let every slot keep them."""
        from safetensors.torch import save_file

        if self.keep_file is None:
            raise BelayerGrpoError("WeightSync has keepers but no keep_file to save the pushed weights to")
        aside = self.keep_file.with_name(f".{self.keep_file.name}.{os.getpid()}.tmp")
        try:
            # Tied embeddings share storage: save_file refuses shared tensors, so each is its own.
            save_file({name: tensor.contiguous().clone() for name, tensor in tensors.items()}, str(aside))
            os.replace(aside, self.keep_file)
            for keeper, version in zip(self.keepers, versions, strict=False):
                keeper(self.keep_file, version)
        except OSError as error:
            aside.unlink(missing_ok=True)  # a half-written file must not stay in the run folder
            raise BelayerGrpoError(
                f"keeping the pushed weights at {self.keep_file} failed: {error}"
            ) from error
