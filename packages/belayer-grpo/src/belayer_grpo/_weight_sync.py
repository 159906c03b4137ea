"""Pushing the trainer's weights to every slot's weight server: one atomic update and version bump each.

The barrier is the order of operations: the trainer pushes after its optimizer step and starts
the next rollout only once every server has committed the new version; an idle worker re-reads
its weight views before it admits new requests (belayer-shadow), so every sample of the next step
comes from the new weights. The trainer checks this each step by comparing the router's
logprobs with its own (`logprob_gap` in the metrics).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import attrs
import torch

from belayer_grpo._errors import BelayerGrpoError

__all__ = ["WeightSync"]


@attrs.define
class WeightSync:
    """Writes weights into the weight servers at ``sockets``; remembers the versions they report."""

    sockets: Sequence[Path]
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
        self.num_pushes += 1
        self.seconds += time.monotonic() - start
        return versions
