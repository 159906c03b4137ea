"""Checkpoint kinds and a cost estimate for each of the cheap ones.

belayer-envckpt takes the cheapest checkpoint that captures the sandbox (its `CheckpointKind`):
``full`` (layer + CRIU), ``fresh-runtime`` (only the layer: nothing but a stateless init runs) or
``reference`` (nothing changed: the previous checkpoint's artifacts, nearly free).  The agent loop
can ask envckpt which kind the next checkpoint would be (`next_checkpoint_kind`) and pass it in
`StepObservation.checkpoint_kind`; the policy then weighs that kind's cost, not the full one's.
"""

from __future__ import annotations

import attrs

from belayer_policy._errors import PolicyArgumentError
from belayer_policy._estimators import CheckpointCostModel

__all__ = [
    "CHECKPOINT_KINDS",
    "FRESH_RUNTIME",
    "FULL",
    "KIND_PRIORS_S",
    "REFERENCE",
    "KindCosts",
    "check_kind",
]

FULL = "full"
FRESH_RUNTIME = "fresh-runtime"
REFERENCE = "reference"
CHECKPOINT_KINDS = (FULL, FRESH_RUNTIME, REFERENCE)
# The cheap kinds' prior costs (seconds): envckpt's benchmark on a loaded 2-core machine.
KIND_PRIORS_S = {FRESH_RUNTIME: 0.05, REFERENCE: 0.005}


def check_kind(value: str | None) -> str | None:
    """``value`` if it is a checkpoint kind (or None), else `PolicyArgumentError`."""
    if value is not None and value not in CHECKPOINT_KINDS:
        raise PolicyArgumentError(
            f"checkpoint_kind must be one of {CHECKPOINT_KINDS} (envckpt's CheckpointKind values) or None, "
            f"got {value!r}"
        )
    return value


def _validated_kind(_instance: object, _attribute: object, value: str | None) -> None:
    check_kind(value)


@attrs.define
class KindCosts:
    """Online cost estimates of the cheap kinds; a ``full`` checkpoint uses the policy's own model.

    Priors from envckpt's benchmark on a loaded 2-core machine (fresh-runtime tens of ms, a reference
    a few ms); each learns from the checkpoints of its kind, as the full model does.
    """

    fresh_runtime: CheckpointCostModel = attrs.field(
        factory=lambda: CheckpointCostModel(initial_s=KIND_PRIORS_S[FRESH_RUNTIME])
    )
    reference: CheckpointCostModel = attrs.field(
        factory=lambda: CheckpointCostModel(initial_s=KIND_PRIORS_S[REFERENCE])
    )

    def model(self, kind: str | None) -> CheckpointCostModel | None:
        """The model of a cheap ``kind``; None for ``full`` or an unknown kind (None)."""
        if check_kind(kind) == FRESH_RUNTIME:
            return self.fresh_runtime
        if kind == REFERENCE:
            return self.reference
        return None
