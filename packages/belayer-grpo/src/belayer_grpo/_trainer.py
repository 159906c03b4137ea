"""`GRPOTrainer`: the policy, its reference and optimizer, and one GRPO update per rollout batch.

The update is synchronous torch code; the training loop (`run.py`) runs it in a worker thread so
the event loop (router, progress, chaos) keeps going.
"""

from __future__ import annotations

import copy
import math
import random
from collections.abc import Sequence
from typing import Any

import attrs
import torch

from belayer_grpo._algorithm import group_advantages, grpo_loss
from belayer_grpo._config import AlgorithmConfig
from belayer_grpo._errors import BelayerGrpoError, CheckpointError
from belayer_grpo._model import completion_logprobs, pack
from belayer_grpo._rollout_math import Sample

__all__ = ["GRPOTrainer", "UpdateResult"]


@attrs.frozen
class UpdateResult:
    """What one update did, for the metrics."""

    loss: float
    kl: float
    clip_fraction: float
    ratio_mean: float
    grad_norm: float
    advantage_abs_mean: float
    logprob_gap: float  # mean |router logprob - trainer logprob| before the update
    num_tokens: int
    num_zero_signal_groups: int


def _mask_matrix(samples: Sequence[Sample], width: int) -> torch.Tensor:
    mask = torch.zeros((len(samples), width))
    for row, sample in enumerate(samples):
        mask[row, : len(sample.loss_mask)] = torch.tensor(sample.loss_mask, dtype=torch.float32)
    return mask


def _rollout_matrix(samples: Sequence[Sample], width: int) -> torch.Tensor:
    values = torch.zeros((len(samples), width))
    for row, sample in enumerate(samples):
        values[row, : len(sample.logprobs)] = torch.tensor(sample.logprobs, dtype=torch.float32)
    return values


@attrs.define
class GRPOTrainer:
    """Holds the policy and performs GRPO updates on batches of `Sample` groups."""

    model: torch.nn.Module
    config: AlgorithmConfig
    group_size: int
    seed: int = 0
    reference: torch.nn.Module | None = None
    optimizer: torch.optim.Optimizer = attrs.field(init=False)
    _rng: random.Random = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=self.config.learning_rate,
            betas=(self.config.adam_beta1, self.config.adam_beta2),
            weight_decay=self.config.weight_decay,
        )
        if self.config.beta > 0 and self.reference is None:
            self.reference = copy.deepcopy(self.model).eval()
            for parameter in self.reference.parameters():
                parameter.requires_grad_(False)
        self._rng = random.Random(self.seed)

    def _logprobs(
        self, model: torch.nn.Module, samples: Sequence[Sample]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        batch = pack([s.prompt_ids for s in samples], [s.completion_ids for s in samples])
        logprobs, _ = completion_logprobs(model, batch, [len(s.completion_ids) for s in samples])
        return logprobs, _mask_matrix(samples, logprobs.shape[1])

    def update(self, samples: Sequence[Sample]) -> UpdateResult:
        """One GRPO step on ``samples`` (groups of ``group_size`` consecutive samples).

        The batch may hold fewer groups than a full step (groups dropped after an unrecoverable
        trajectory); every group in it must be complete, so its statistics are its own.
        """
        if not samples or len(samples) % self.group_size:
            raise BelayerGrpoError(
                f"a GRPO batch is whole groups of {self.group_size} samples, got {len(samples)}; "
                "a group with a lost trajectory must be left out whole"
            )
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
        advantages = group_advantages(rewards, self.group_size, normalize_std=self.config.normalize_std)
        groups = rewards.view(-1, self.group_size)
        zero_signal = int((groups.max(dim=1).values == groups.min(dim=1).values).sum())
        self.model.eval()
        with torch.no_grad():
            trainer_old, mask = self._logprobs(self.model, samples)
            router_old = _rollout_matrix(samples, trainer_old.shape[1])
            gap = float(((trainer_old - router_old).abs() * mask).sum() / mask.sum().clamp(min=1.0))
            old = trainer_old if self.config.recompute_logprobs else router_old
            ref = None if self.reference is None else self._logprobs(self.reference, samples)[0]
        self.model.train()
        order = list(range(len(samples)))
        self._rng.shuffle(order)
        # Fewer samples than planned (dropped groups): still at most num_minibatches steps.
        size = math.ceil(len(samples) / self.config.num_minibatches)
        totals: dict[str, float] = {"loss": 0.0, "kl": 0.0, "clip": 0.0, "ratio": 0.0, "grad": 0.0}
        num_tokens = 0
        for start in range(0, len(order), size):
            rows = order[start : start + size]
            chosen = [samples[i] for i in rows]
            logprobs, sub_mask = self._logprobs(self.model, chosen)
            width = logprobs.shape[1]
            loss, stats = grpo_loss(
                logprobs,
                old[rows, :width],
                advantages[rows],
                sub_mask,
                epsilon=self.config.epsilon,
                epsilon_high=self.config.epsilon_high,
                beta=self.config.beta,
                ref_logprobs=None if ref is None else ref[rows, :width],
                aggregation=self.config.loss_aggregation,
            )
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()  # type: ignore[no-untyped-call]
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm)
            # A minibatch without signal (every advantage 0, no KL term) has a zero gradient, yet
            # Adam's momentum would still move the weights: a run whose groups all scored alike
            # would drift for many steps.  No signal, no step.
            if ref is not None or bool(advantages[rows].abs().sum() > 0):
                self.optimizer.step()
            totals["loss"] += stats.loss
            totals["kl"] += stats.kl
            totals["clip"] += stats.clip_fraction
            totals["ratio"] += stats.ratio_mean
            totals["grad"] += float(grad_norm) if math.isfinite(float(grad_norm)) else 0.0
            num_tokens += stats.num_tokens
        self.model.eval()
        k = math.ceil(len(order) / size)
        return UpdateResult(
            loss=totals["loss"] / k,
            kl=totals["kl"] / k,
            clip_fraction=totals["clip"] / k,
            ratio_mean=totals["ratio"] / k,
            grad_norm=totals["grad"] / k,
            advantage_abs_mean=float(advantages.abs().mean()),
            logprob_gap=gap,
            num_tokens=num_tokens,
            num_zero_signal_groups=zero_signal,
        )

    def state_dict(self) -> dict[str, Any]:
        """Model, KL reference and optimizer state, for a checkpoint.

        The reference is saved too: a resumed run rebuilds its model from the seed (no warm-up),
        so only the saved reference makes its KL term the uninterrupted run's.
        """
        return {
            "model": self.model.state_dict(),
            "reference": None if self.reference is None else self.reference.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "rng": self._rng.getstate(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore model, KL reference and optimizer from a checkpoint."""
        reference: dict[str, Any] | None = state.get("reference")
        if self.reference is not None and reference is None:
            raise CheckpointError(
                "the checkpoint holds no KL reference model (written before references were saved, or "
                "with algorithm.beta = 0); resume it with algorithm.beta=0 or start a new run"
            )
        self.model.load_state_dict(state["model"])
        if self.reference is not None and reference is not None:
            self.reference.load_state_dict(reference)
        self.optimizer.load_state_dict(state["optimizer"])
        if "rng" in state:
            self._rng.setstate(state["rng"])
