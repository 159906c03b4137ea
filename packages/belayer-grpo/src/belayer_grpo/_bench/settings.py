"""`BenchConfig`: what `belayer-grpo bench` measures, at which scale, loaded from TOML.

Two configurations ship with the package: ``small.toml`` (the default: one CPU machine with two
cores, minutes) and ``full.toml`` (GPU scale).  A file given with ``--config`` is layered over the
small one, so it only names what it changes; an unknown section or key raises `GrpoConfigError`.
"""

from __future__ import annotations

import copy
import importlib.resources
import tomllib
from pathlib import Path
from typing import Any

import attrs
from attrs import validators as v

from belayer_grpo._config import merge_tables
from belayer_grpo._errors import GrpoConfigError

__all__ = [
    "EXPERIMENTS",
    "BenchConfig",
    "BuildRecoveryBench",
    "EnvFailureBench",
    "OverheadBench",
    "SweBench",
    "WorkerFailureBench",
    "load_bench_config",
]

EXPERIMENTS = ("overhead", "worker-failure", "env-failures", "checkpoint-cost", "build-recovery")

_pos = v.gt(0)
_nonneg = v.ge(0)
_posf = v.gt(0.0)
_nonnegf = v.ge(0.0)


@attrs.frozen
class SweBench:
    """The agentic workload of the benchmark: shipped tasks, a scripted agent, real sandboxes."""

    tasks: tuple[str, ...] = ()  # shipped instance ids; () = all
    samples_per_task: int = attrs.field(default=2, validator=_pos)
    rounds: int = attrs.field(default=8, validator=v.ge(3))  # actions per trajectory, tests included
    token_delay_s: float = attrs.field(default=0.01, validator=_nonnegf)  # the LLM's decode time per token
    response_padding: int = attrs.field(default=40, validator=_nonneg)  # extra "thinking" bytes per response
    action_s: float = attrs.field(default=0.2, validator=_nonnegf)  # seconds each action sleeps
    max_concurrency: int = attrs.field(default=8, validator=_pos)
    every_k: int = attrs.field(default=3, validator=_pos)


@attrs.frozen
class OverheadBench:
    """Failure-free overhead: Belayer on against off, repeated and interleaved."""

    repeats: int = attrs.field(default=3, validator=_pos)
    workloads: tuple[str, ...] = attrs.field(
        default=("math", "swe"), validator=v.deep_iterable(v.in_(("math", "swe")))
    )
    math_steps: int = attrs.field(default=12, validator=_pos)
    math_discard_steps: int = attrs.field(default=2, validator=_nonneg)  # start-up steps not measured
    math_overrides: tuple[str, ...] = ()  # `belayer-grpo train` overrides for both arms
    math_long_overrides: tuple[str, ...] = ()  # a second configuration with longer steps (() = none)

    @math_discard_steps.validator
    def _check_discard(self, _attribute: Any, value: int) -> None:
        if value >= self.math_steps:
            raise ValueError(f"math_discard_steps ({value}) must be < math_steps ({self.math_steps})")

    swe_steps: int = attrs.field(default=1, validator=_pos)


@attrs.frozen
class WorkerFailureBench:
    """One SIGKILLed rollout worker per rollout, shadow handover against conventional recovery."""

    repeats: int = attrs.field(default=2, validator=_pos)
    batch_size: int = attrs.field(default=8, validator=_pos)
    samples_per_prompt: int = attrs.field(default=4, validator=v.ge(2))
    max_tokens: int = attrs.field(default=128, validator=_pos)
    kill_at_fraction: float = attrs.field(default=0.25, validator=[_nonnegf, v.lt(1.0)])
    health_interval_s: float = attrs.field(default=10.0, validator=_posf)  # the conventional baseline
    health_misses: int = attrs.field(default=3, validator=_pos)
    backend: str = attrs.field(default="host", validator=v.in_(("host", "cuda")))  # memory servers


@attrs.frozen
class EnvFailureBench:
    """Sandbox kills per environment step under each checkpoint policy, over seeds."""

    probabilities: tuple[float, ...] = attrs.field(
        default=(0.01, 0.05), validator=v.deep_iterable(v.and_(v.gt(0.0), v.le(1.0)))
    )
    policies: tuple[str, ...] = ("never", "always", "every", "adaptive")
    seeds: tuple[int, ...] = (0, 1)
    # At `separate_p` (0 = off) more seeds run `never` and `adaptive` until the 95 % confidence
    # intervals of their rollout-time increase separate, or a cap: `max_repeats` seeds in all at
    # that p, or `max_repeat_s` seconds of repeats.
    separate_p: float = attrs.field(default=0.01, validator=[_nonnegf, v.le(1.0)])
    max_repeats: int = attrs.field(default=20, validator=v.ge(2))
    max_repeat_s: float = attrs.field(default=900.0, validator=_nonnegf)


@attrs.frozen
class BuildRecoveryBench:
    """The default workload's build tasks under sandbox kills: adaptive, never, verbatim replay."""

    tasks: int = attrs.field(default=4, validator=_pos)  # build tasks (values) per batch
    samples_per_task: int = attrs.field(default=4, validator=_pos)
    kill_p: float = attrs.field(default=0.2, validator=[v.gt(0.0), v.le(1.0)])  # per action
    seeds: tuple[int, ...] = (0, 1, 2)
    token_delay_s: float = attrs.field(default=0.05, validator=_nonnegf)  # the scripted LLM's decode time
    max_concurrency: int = attrs.field(default=16, validator=_pos)


@attrs.frozen
class BenchConfig:
    """The whole benchmark configuration (see ``small.toml`` for every key with a comment)."""

    scale: str = "small"
    quick: bool = False  # set by `quick_config` (--quick); the report says what it changed
    results_dir: str = "benchmarks/results/bench"
    math_config: str = ""  # a `belayer-grpo train` config file for the math runs ("" = embedded)
    swe: SweBench = attrs.field(factory=SweBench)
    overhead: OverheadBench = attrs.field(factory=OverheadBench)
    worker_failure: WorkerFailureBench = attrs.field(factory=WorkerFailureBench)
    env_failures: EnvFailureBench = attrs.field(factory=EnvFailureBench)
    build_recovery: BuildRecoveryBench = attrs.field(factory=BuildRecoveryBench)

    def to_dict(self) -> dict[str, Any]:
        """Plain data, saved with the results."""
        return attrs.asdict(self)


def _embedded(name: str) -> dict[str, Any]:
    text = importlib.resources.files("belayer_grpo._bench").joinpath(name).read_text()
    return tomllib.loads(text)


def _section(cls: type[Any], data: dict[str, Any], name: str) -> Any:
    values = {k: tuple(x) if isinstance(x, list) else x for k, x in data.items()}
    try:
        return cls(**values)
    except (TypeError, ValueError) as error:
        raise GrpoConfigError(name, str(error.args[0]) if error.args else str(error)) from error


def load_bench_config(path: str | Path | None = None, *, scale: str | None = None) -> BenchConfig:
    """``small.toml`` (or ``full.toml`` with ``scale="full"``), updated by the file at ``path``."""
    data = copy.deepcopy(_embedded("small.toml"))
    if scale == "full":
        merge_tables(data, _embedded("full.toml"))
    elif scale not in (None, "small"):
        raise GrpoConfigError("--scale", f"must be small or full, got {scale!r}")
    if path is not None:
        file = Path(path)
        if not file.is_file() or file.suffix != ".toml":
            raise GrpoConfigError(
                "--config", f"{str(file)!r} is not a .toml file; pass a benchmark configuration"
            )
        try:
            merge_tables(data, tomllib.loads(file.read_text()))
        except tomllib.TOMLDecodeError as error:
            raise GrpoConfigError("--config", f"{file} is not valid TOML: {error}") from error
    sections = {"swe": SweBench, "overhead": OverheadBench, "worker_failure": WorkerFailureBench,
                "env_failures": EnvFailureBench, "build_recovery": BuildRecoveryBench}  # fmt: skip
    values: dict[str, Any] = {}
    for key, value in data.items():
        values[key] = _section(sections[key], value, key) if key in sections else value
    config: BenchConfig = _section(BenchConfig, values, "bench")
    for policy in config.env_failures.policies:
        if policy not in ("never", "always", "every", "adaptive"):
            raise GrpoConfigError(
                "env_failures.policies", f"unknown policy {policy!r} (never, always, every, adaptive)"
            )
    return config
