"""The scale simulation's inputs: every number named, with its unit and where it comes from.

Published failure rates come from the Llama 3 paper; recovery times come from Belayer's committed
benchmark results, through the simulation's own committed file `measured_inputs.json` (written by
`benchmarks/update_measured_inputs.py` from the siblings' results files; nothing here reads another
package's files); the rest are labelled assumptions. Every input is overridable (`SimInputs` field, `belayer-cluster scale --<name>`).
Only the standard library and attrs: `belayer-cluster scale` must not pay for importing ray.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import attrs

from belayer_cluster._errors import ClusterConfigError

__all__ = ["INPUT_SOURCES", "MEASURED_INPUTS", "InputSource", "SimInputs", "load_measured_inputs"]

# Llama 3 paper (Llama Team, AI @ Meta, "The Llama 3 Herd of Models", arXiv 2407.21783), section
# 3.3.4 and Table 5: 419 unexpected interruptions in a 54-day snapshot of Llama 3 405B pre-training
# on 16,384 H100 GPUs (8 GPUs per server). Table 5 counts by component; the ones that are software,
# not a lost machine: Software Bug 54, NCCL Watchdog Timeouts 7, Dependency 2 (63 of 419). The rest
# (Faulty GPU 148, GPU HBM3 Memory 72, Network Switch/Cable 35, Host Maintenance 32, GPU SRAM Memory
# 19, GPU System Processor 17, NIC 7, Silent Data Corruption 6, GPU Thermal Interface + Sensor 6,
# SSD 3, Power Supply 3, Server Chassis 2, IO Expansion Board 2, CPU 2, System Memory 2: 356) take a
# host out of the job. (Table 5 prints 30.1% next to Faulty GPU's 148, which is 35.3% of 419; the
# counts add up to 419, so the simulation uses the counts.)
LLAMA3_INTERRUPTIONS = 419
LLAMA3_DAYS = 54
LLAMA3_GPUS = 16_384
LLAMA3_SOFTWARE_INTERRUPTIONS = 54 + 7 + 2

_LLAMA3 = "Llama 3 paper (arXiv 2407.21783), sec. 3.3.4 + Table 5"
_DALY = "Daly 2006, 'A higher order estimate of the optimum checkpoint interval for restart dumps' (FGCS 22(3)), Fig. 3 example"
_SHADOW_VLLM = "packages/belayer-shadow/benchmarks/results/bench_handover_vllm.json"
_ENVCKPT = "packages/belayer-envckpt/benchmarks/results/bench_checkpoint.json"
_NODE_LOSS = "packages/belayer-cluster/benchmarks/results/bench_node_loss.json"
ASSUMPTION = "assumption (no published number for an RL job): override it"


@attrs.frozen
class InputSource:
    """Where one input's default comes from: a paper and table, a results file and key, or an assumption."""

    unit: str
    source: str
    note: str = ""


INPUT_SOURCES: dict[str, InputSource] = {
    "gpus_per_node": InputSource("GPUs", f"{_LLAMA3}: 8 GPUs per Grand Teton server"),
    "failures_per_gpu_day": InputSource(
        "1/(GPU*day)",
        f"{_LLAMA3}: 419 unexpected interruptions / (54 days * 16,384 GPUs)",
        "scaled linearly with the GPU count (a failure hits any GPU with the same rate)",
    ),
    "worker_crash_share": InputSource(
        "fraction",
        f"{_LLAMA3}: Software Bug 54 + NCCL Watchdog Timeouts 7 + Dependency 2 = 63 of 419",
        "the other 356 of 419 (GPU, HBM, network, host...) lose the node",
    ),
    "rollout_fraction": InputSource(
        "fraction", ASSUMPTION, "share of the GPUs on rollout nodes; the rest train"
    ),
    "sandbox_losses_per_node_day": InputSource(
        "1/(rollout node*day)",
        ASSUMPTION,
        "agentic sandboxes (containers) lost; 0 for a job without sandboxes",
    ),
    "rollout_s": InputSource("s", ASSUMPTION, "rollout phase of one synchronous GRPO step"),
    "train_s": InputSource("s", ASSUMPTION, "train phase of one step"),
    "weight_sync_s": InputSource("s", ASSUMPTION, "weight sync trainer -> rollout workers, once per step"),
    "checkpoint_write_s": InputSource(
        "s", f"{_DALY}: dump time delta = 5 min", "blocking trainer checkpoint"
    ),
    "checkpoint_restart_s": InputSource(
        "s", f"{_DALY}: restart time R = 10 min", "job (or trainer) restart from the last checkpoint"
    ),
    "checkpoint_interval_s": InputSource(
        "s",
        "Young 1974 (CACM 17(9)): sqrt(2 * checkpoint_write_s * MTBF of the failures that roll back)",
        "0 = Young's interval per strategy and scale; rounded to whole steps",
    ),
    "detection_s": InputSource(
        "s",
        f"{_SHADOW_VLLM}: conventional.detection_s",
        "health checks (10 s x 3) before a conventional restart, job or trainer",
    ),
    "worker_restart_s": InputSource(
        "s",
        f"{_SHADOW_VLLM}: conventional.all_resumed_s",
        "role restart: detection + new vLLM worker + first token of the regeneration",
    ),
    "shadow_handover_s": InputSource(
        "s",
        f"{_SHADOW_VLLM}: median of shadow[].all_resumed_s",
        "Belayer: worker killed -> every request resumed",
    ),
    "node_loss_resume_s": InputSource(
        "s",
        f"{_NODE_LOSS}: summary.node_loss_recovery_s",
        "Belayer: node lost -> every affected request streaming again and its sandboxes restored elsewhere",
    ),
    "sandbox_restore_s": InputSource(
        "s",
        f"{_ENVCKPT}: max over rows of restore_total_ms / 1000",
        "Belayer: sandbox restored from its checkpoint",
    ),
    "sandbox_restart_s": InputSource(
        "s",
        f"{_ENVCKPT}: max over rows of restore_total_ms / 1000",
        "baseline: a fresh sandbox, taken as fast as a restore (in the baseline's favour)",
    ),
}


def _positive(instance: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
        raise ClusterConfigError(f"{attribute.name} must be a finite number > 0 (got {value!r})")


def _non_negative(instance: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
        raise ClusterConfigError(f"{attribute.name} must be a finite number >= 0 (got {value!r})")


def _fraction(instance: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if not (isinstance(value, int | float) and 0 <= value <= 1):
        raise ClusterConfigError(f"{attribute.name} must be a fraction in [0, 1] (got {value!r})")


def _whole(instance: object, attribute: attrs.Attribute[Any], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ClusterConfigError(f"{attribute.name} must be a whole number >= 1 (got {value!r})")


# The measured recovery times, committed beside this module; `benchmarks/update_measured_inputs.py`
# regenerates it from the siblings' committed results files.
MEASURED_INPUTS = Path(__file__).with_name("measured_inputs.json")
MEASURED = ("detection_s", "worker_restart_s", "shadow_handover_s", "node_loss_resume_s", "sandbox_restore_s",
            "sandbox_restart_s")  # fmt: skip


def load_measured_inputs(path: Path | None = None) -> dict[str, tuple[float, str]]:
    """The measured inputs of a measured-inputs file (default: the committed `MEASURED_INPUTS`).

    Returns {input name: (value, source)}. The file is a JSON object whose `inputs` maps each input
    of `MEASURED` to {"value": seconds, "source": where it was measured}; anything else is a
    `ClusterConfigError` naming the file and what to fix.
    """
    path = MEASURED_INPUTS if path is None else path
    try:
        document = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ClusterConfigError(f"cannot read the measured-inputs file {path}: {exc}") from exc
    inputs = document.get("inputs") if isinstance(document, dict) else None
    if not isinstance(inputs, dict):
        raise ClusterConfigError(f'{path}: expected {{"inputs": {{name: {{"value", "source"}}}}}}')
    missing = sorted(set(MEASURED) - set(inputs))
    unknown = sorted(set(inputs) - set(MEASURED))
    if missing or unknown:
        raise ClusterConfigError(
            f"{path}: the measured inputs are {list(MEASURED)} (missing {missing}, unknown {unknown})"
        )
    found: dict[str, tuple[float, str]] = {}
    for name in MEASURED:
        entry = inputs[name]
        value = entry.get("value") if isinstance(entry, dict) else None
        source = entry.get("source") if isinstance(entry, dict) else None
        if isinstance(value, bool) or not isinstance(value, int | float) or not isinstance(source, str):
            raise ClusterConfigError(f'{path}: inputs.{name} must be {{"value": number, "source": text}}')
        found[name] = (float(value), source)
    return found


_COMMITTED = {name: value for name, (value, _) in load_measured_inputs().items()}


@attrs.frozen(kw_only=True)
class SimInputs:
    """Every input of the scale simulation; `INPUT_SOURCES[name]` says where each default comes from
    (the measured ones: the committed `measured_inputs.json`)."""

    gpus_per_node: int = attrs.field(default=8, validator=_whole)
    failures_per_gpu_day: float = attrs.field(
        default=LLAMA3_INTERRUPTIONS / (LLAMA3_DAYS * LLAMA3_GPUS), validator=_non_negative
    )
    worker_crash_share: float = attrs.field(
        default=LLAMA3_SOFTWARE_INTERRUPTIONS / LLAMA3_INTERRUPTIONS, validator=_fraction
    )
    rollout_fraction: float = attrs.field(default=0.5, validator=_fraction)
    sandbox_losses_per_node_day: float = attrs.field(default=0.1, validator=_non_negative)
    rollout_s: float = attrs.field(default=300.0, validator=_positive)
    train_s: float = attrs.field(default=120.0, validator=_non_negative)
    weight_sync_s: float = attrs.field(default=30.0, validator=_non_negative)
    checkpoint_write_s: float = attrs.field(default=300.0, validator=_non_negative)
    checkpoint_restart_s: float = attrs.field(default=600.0, validator=_non_negative)
    checkpoint_interval_s: float = attrs.field(default=0.0, validator=_non_negative)
    detection_s: float = attrs.field(default=_COMMITTED["detection_s"], validator=_non_negative)
    worker_restart_s: float = attrs.field(default=_COMMITTED["worker_restart_s"], validator=_non_negative)
    shadow_handover_s: float = attrs.field(default=_COMMITTED["shadow_handover_s"], validator=_non_negative)
    node_loss_resume_s: float = attrs.field(default=_COMMITTED["node_loss_resume_s"], validator=_non_negative)
    sandbox_restore_s: float = attrs.field(default=_COMMITTED["sandbox_restore_s"], validator=_non_negative)
    sandbox_restart_s: float = attrs.field(default=_COMMITTED["sandbox_restart_s"], validator=_non_negative)

    @property
    def step_s(self) -> float:
        """One failure-free synchronous step: rollout, train, weight sync."""
        return self.rollout_s + self.train_s + self.weight_sync_s

    def replace(self, **changes: Any) -> SimInputs:
        """A copy with some inputs changed (validated like the original)."""
        unknown = sorted(set(changes) - set(INPUT_SOURCES))
        if unknown:
            raise ClusterConfigError(f"unknown simulation input(s) {unknown}; known: {sorted(INPUT_SOURCES)}")
        return attrs.evolve(self, **changes)
