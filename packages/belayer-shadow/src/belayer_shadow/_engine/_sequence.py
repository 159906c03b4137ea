"""Requests as the engine tracks them: sampling parameters, sequences and step outputs (plain Python)."""

from __future__ import annotations

import enum
import math
from typing import Any

import attrs

from belayer_shadow._errors import InvalidSamplingParamsError

__all__ = ["FinishReason", "SamplingParams", "Sequence", "SequenceStatus", "StepOutput"]

FinishReason = str  # "stop" | "length"
_MAX_SEED = 2**64 - 1


def _token_ids(name: str, value: Any) -> tuple[int, ...]:
    try:
        ids = tuple(value)
    except TypeError:
        raise InvalidSamplingParamsError(f"SamplingParams.{name} must be a sequence of token ids") from None
    if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids):
        raise InvalidSamplingParamsError(f"SamplingParams.{name} must hold non-negative int token ids")
    return ids


@attrs.frozen
class SamplingParams:
    """How to sample one request.

    `temperature == 0` is greedy. `top_p` in (0, 1] keeps the smallest set of most likely tokens
    whose probability reaches `top_p`. The random draw for completion index `i` depends only on
    `(seed, i)`, so a request resumed elsewhere samples what the uninterrupted one would have.
    `generated_token_ids` are completion tokens already produced (a resume): the context is
    prompt + generated, the first new token has index `len(generated_token_ids)`, and
    `max_tokens` counts only new tokens. A token in `stop_token_ids` ends the request ("stop")
    and is itself returned.
    """

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    generated_token_ids: tuple[int, ...] = ()

    def __attrs_post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidSamplingParamsError(f"max_tokens must be a positive int, got {self.max_tokens!r}")
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t) or t < 0:
            raise InvalidSamplingParamsError(
                f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}"
            )
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, int | float) or not 0 < p <= 1:
            raise InvalidSamplingParamsError(f"top_p must be in (0, 1], got {p!r}")
        s = self.seed
        if s is not None and (isinstance(s, bool) or not isinstance(s, int) or not 0 <= s <= _MAX_SEED):
            raise InvalidSamplingParamsError(f"seed must be None or an int in [0, 2**64), got {s!r}")
        object.__setattr__(self, "stop_token_ids", _token_ids("stop_token_ids", self.stop_token_ids))
        object.__setattr__(
            self, "generated_token_ids", _token_ids("generated_token_ids", self.generated_token_ids)
        )

    @property
    def greedy(self) -> bool:
        """True when sampling is argmax."""
        return self.temperature == 0


@attrs.frozen
class StepOutput:
    """One new token of one request from `LLMEngine.step()`.

    `index` counts completion tokens from 0 (generated_token_ids included); `logprob` is the
    token's log-probability under the distribution it was sampled from (softmax of logits /
    temperature; plain softmax when greedy); `finish_reason` is "stop", "length" or None.
    """

    request_id: str
    index: int
    token_id: int
    logprob: float
    finish_reason: FinishReason | None = None


class SequenceStatus(enum.Enum):
    """Where a sequence is in the scheduler."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@attrs.define(eq=False)
class Sequence:
    """One request's tokens and progress; the scheduler's unit of work."""

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int  # the prompt alone, without generated_token_ids
    params: SamplingParams
    seed: int
    arrival: int
    status: SequenceStatus = SequenceStatus.WAITING
    num_cached_tokens: int = 0  # positions whose K/V are in this sequence's blocks
    num_new_tokens: int = 0  # tokens this engine sampled for it
    finish_reason: FinishReason | None = None

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def next_index(self) -> int:
        """Completion index of the next token to sample."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def last_token_id(self) -> int:
        """The newest token (the input of the next decode step)."""
        return self.token_ids[-1]

    def append(self, token_id: int) -> None:
        """Record a sampled token."""
        self.token_ids.append(token_id)
        self.num_new_tokens += 1
