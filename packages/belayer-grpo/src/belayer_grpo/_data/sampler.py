"""`PromptSampler`: batches of problems (or agentic tasks) in a seeded order per epoch, with a
resumable position."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any, Generic, TypeVar

import attrs

from belayer_grpo._errors import CheckpointError, DataError

__all__ = ["PromptSampler"]

_Item = TypeVar("_Item")


@attrs.define
class PromptSampler(Generic[_Item]):
    """Draws ``batch_size`` problems per call; each epoch is a fresh seeded permutation.

    The position (epoch, index) is all the state there is, so `state_dict` / `load_state_dict`
    resume exactly where a checkpoint left off.
    """

    problems: Sequence[_Item]
    seed: int = 0
    epoch: int = 0
    index: int = 0
    _order: list[int] = attrs.field(init=False, factory=list, alias="_order")

    def __attrs_post_init__(self) -> None:
        if not self.problems:
            raise DataError("the sampler needs at least one problem")
        self._order = self._permutation(self.epoch)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self.problems)))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next_batch(self, batch_size: int) -> list[_Item]:
        """The next ``batch_size`` problems, moving on to the next epoch as needed."""
        batch: list[_Item] = []
        while len(batch) < batch_size:
            if self.index >= len(self._order):
                self.epoch += 1
                self.index = 0
                self._order = self._permutation(self.epoch)
            batch.append(self.problems[self._order[self.index]])
            self.index += 1
        return batch

    def state_dict(self) -> dict[str, Any]:
        """The position, for a checkpoint."""
        return {
            "epoch": self.epoch,
            "index": self.index,
            "seed": self.seed,
            "num_problems": len(self.problems),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a checkpoint's position (the data set must be the same)."""
        if state.get("num_problems") != len(self.problems) or state.get("seed") != self.seed:
            raise CheckpointError(
                f"the checkpoint's data position is for {state.get('num_problems')} problems with seed "
                f"{state.get('seed')}, this run has {len(self.problems)} with seed {self.seed}; use the same data"
            )
        self.epoch = int(state["epoch"])
        self.index = int(state["index"])
        self._order = self._permutation(self.epoch)
