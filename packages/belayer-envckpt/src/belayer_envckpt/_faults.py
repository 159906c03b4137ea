"""Fault injection in the style of Pumba: container failures per step, or inside a checkpoint."""

from __future__ import annotations

import enum
import random
from typing import TYPE_CHECKING

import attrs

from ._errors import InjectedCrash, InvalidConfigError

if TYPE_CHECKING:
    from ._sandbox_like import SandboxLike


class CrashPoint(enum.Enum):
    """Named points inside `full_checkpoint` where a fault can be injected."""

    AFTER_LAYER = "after_layer"
    AFTER_DUMP = "after_dump"
    BEFORE_PUBLISH = "before_publish"


class FaultAction(enum.Enum):
    """What happens at a fault: the checkpointing process dies, or the container does."""

    CRASH = "crash"
    KILL = "kill"
    STOP = "stop"
    PAUSE = "pause"


def apply_fault(sandbox: SandboxLike, action: FaultAction) -> None:
    """Carry out one fault on ``sandbox``."""
    if action is FaultAction.CRASH:
        raise InjectedCrash("injected crash of the checkpointing process")
    if action is FaultAction.KILL:
        sandbox.kill()
    elif action is FaultAction.STOP:
        sandbox.stop()
    elif action is FaultAction.PAUSE:
        sandbox.pause()


@attrs.frozen
class CheckpointFault:
    """A fault at one crash point of `full_checkpoint` (for tests and chaos runs)."""

    point: CrashPoint
    action: FaultAction = FaultAction.CRASH


@attrs.define
class FaultInjector:
    """Fails a sandbox with probability ``probability`` per step (kill, stop or pause)."""

    probability: float = attrs.field()
    action: FaultAction = FaultAction.KILL
    seed: int | None = None
    num_injected: int = 0
    _rng: random.Random = attrs.field(init=False)

    @probability.validator
    def _check(self, _attr: object, value: float) -> None:
        if not 0.0 <= value <= 1.0:
            raise InvalidConfigError(f"probability must be in [0, 1], got {value}")

    def __attrs_post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def step(self, sandbox: SandboxLike) -> bool:
        """Call after each environment step; returns True when it failed the sandbox."""
        if self._rng.random() >= self.probability:
            return False
        apply_fault(sandbox, self.action)
        self.num_injected += 1
        return True
