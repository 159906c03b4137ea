"""Keyed sampling inside vLLM, so that a resumed seeded request equals an uninterrupted one.

vLLM draws a seeded request's tokens from one generator per request: a request resumed from
prompt + received tokens starts that generator over and samples differently. This logits
processor makes the draw for completion index `i` the built-in engine's, a pure function of
`(seed, i)` (`belayer_shadow`'s `keyed_uniform` inverted through the top-p CDF of
softmax(logits / temperature)), and masks every other token, so vLLM's own sampler can only pick
that one. Requests opt in through `SamplingParams.extra_args[KEY_EXTRA]` (the engine does that
for every seeded request with temperature > 0); the others pass through untouched.

The logprob vLLM reports is log_softmax of the raw logits (its default mode), i.e. the built-in
engine's value only at temperature 1.
"""

from __future__ import annotations

from typing import Any

import torch

from belayer_shadow._engine._sampler import keyed_uniform, sample

__all__ = ["KEY_EXTRA", "processor_name"]

KEY_EXTRA = "belayer_keyed"


def processor_name() -> str:
    """The qualified name vLLM imports the processor by (`logits_processors=[...]`)."""
    return f"{__name__}:KeyedSampler"


def _make_class() -> type[Any]:
    from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

    class KeyedSampler(LogitsProcessor):  # type: ignore[misc]  # Any without vLLM's types
        """Forces the keyed draw for requests that carry `extra_args[KEY_EXTRA]`."""

        def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
            # batch row -> (seed, first index, temperature, top_p, output tokens so far)
            self.rows: dict[int, tuple[int, int, float, float, list[int]]] = {}

        def is_argmax_invariant(self) -> bool:
            return False

        def update_state(self, batch_update: BatchUpdate | None) -> None:
            if batch_update is None:
                return
            for index in batch_update.removed:
                self.rows.pop(index, None)
            for index, params, _prompt, output in batch_update.added:
                key = (params.extra_args or {}).get(KEY_EXTRA) if params is not None else None
                if key is None:
                    self.rows.pop(index, None)
                else:
                    self.rows[index] = (
                        int(key["seed"]),
                        int(key["offset"]),
                        float(key["temperature"]),
                        float(key["top_p"]),
                        output,
                    )
            for source, target, direction in batch_update.moved:
                moving = self.rows.pop(source, None)
                if direction == MoveDirectionality.SWAP:
                    other = self.rows.pop(target, None)
                    if other is not None:
                        self.rows[source] = other
                else:
                    self.rows.pop(target, None)
                if moving is not None:
                    self.rows[target] = moving

        def apply(self, logits: torch.Tensor) -> torch.Tensor:
            if not self.rows:
                return logits
            rows = sorted(r for r in self.rows if r < logits.shape[0])
            if not rows:
                return logits
            states = [self.rows[r] for r in rows]
            uniforms = [keyed_uniform(seed, offset + len(out)) for seed, offset, _, _, out in states]
            tokens, _ = sample(logits[rows], [s[2] for s in states], [s[3] for s in states], uniforms)
            index = torch.tensor(rows, dtype=torch.long, device=logits.device)
            chosen = torch.tensor(tokens, dtype=torch.long, device=logits.device)
            kept = logits[index, chosen]
            logits[index] = float("-inf")
            logits[index, chosen] = kept
            return logits

    return KeyedSampler


def __getattr__(name: str) -> Any:
    # vLLM imports `KeyedSampler` by name; build it on first use so that importing this module
    # does not need vLLM.
    if name == "KeyedSampler":
        cls = _make_class()
        globals()["KeyedSampler"] = cls
        return cls
    raise AttributeError(name)
