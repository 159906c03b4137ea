"""`belayer_cluster.simulate`: the scale simulation (issue 13, "beyond one machine"), for capacity planning.

A discrete-event simulation of a synchronous RL (GRPO) job on 1,024-16,384 GPUs with failures drawn
from published rates (Llama 3 paper), comparing the effective training time ratio of three recovery
strategies: restart the job from its last checkpoint, restart the failed role, and Belayer. Every
input is named and sourced (`INPUT_SOURCES`). Its modules import only the standard library and
attrs; `belayer-cluster scale` is the command line.
"""

from __future__ import annotations

from belayer_cluster._simulate import (
    Failure,
    FailureKind,
    RunResult,
    Strategy,
    checkpoint_every_steps,
    draw_failures,
    run_job,
)
from belayer_cluster._simulate_inputs import (
    INPUT_SOURCES,
    MEASURED_INPUTS,
    InputSource,
    SimInputs,
    load_measured_inputs,
)
from belayer_cluster._simulate_scale import (
    DEFAULT_GPUS,
    ScaleResult,
    inputs_table,
    markdown_table,
    simulate_scale,
)

__all__ = [
    "DEFAULT_GPUS",
    "INPUT_SOURCES",
    "MEASURED_INPUTS",
    "Failure",
    "FailureKind",
    "InputSource",
    "RunResult",
    "ScaleResult",
    "SimInputs",
    "Strategy",
    "checkpoint_every_steps",
    "draw_failures",
    "inputs_table",
    "load_measured_inputs",
    "markdown_table",
    "run_job",
    "simulate_scale",
]
