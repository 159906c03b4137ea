"""belayer-grpo: GRPO training with rollouts through the Belayer router, and the system behind it.

`belayer-grpo train` assembles the router, the engine slots (memory servers, main worker and shadow
worker), the sandbox pool and the trainer, and shuts all of it down again on exit or Ctrl-C; a
small guardian process cleans up after a trainer that was killed outright.

Public API: the configuration (`load_config`, `Config`), the training run (`run_training`), the
agentic workload (`run_agentic_rollouts` and its records), the errors and the CLI's `ExitCode`.
Everything else lives in private ``_modules``.
"""

from __future__ import annotations

from importlib.metadata import version
from typing import TYPE_CHECKING

from belayer_grpo._errors import (
    BelayerGrpoError,
    CheckpointError,
    DataError,
    ExitCode,
    GrpoConfigError,
    RolloutError,
    SandboxImageError,
    SystemStartError,
    TaskFormatError,
    TrajectoryFailedError,
    UnrecoverableTrajectoryError,
)
from belayer_grpo._lazy import lazy_getattr

if TYPE_CHECKING:
    from belayer_grpo._agentic import (
        AgenticConfig,
        AgenticTrajectory,
        SweTask,
        builtin_tasks,
        load_swegym,
        run_agentic_rollouts,
        to_samples,
    )
    from belayer_grpo._config import Config, load_config
    from belayer_grpo._run import run_training

__version__ = version("belayer-grpo")

# Heavy names (torch, Docker) are imported on first use, so the CLI's parser starts fast.
__getattr__ = lazy_getattr(
    __name__,
    {
        "Config": "belayer_grpo._config",
        "load_config": "belayer_grpo._config",
        "run_training": "belayer_grpo._run",
        "AgenticConfig": "belayer_grpo._agentic",
        "AgenticTrajectory": "belayer_grpo._agentic",
        "SweTask": "belayer_grpo._agentic",
        "builtin_tasks": "belayer_grpo._agentic",
        "load_swegym": "belayer_grpo._agentic",
        "run_agentic_rollouts": "belayer_grpo._agentic",
        "to_samples": "belayer_grpo._agentic",
    },
)

__all__ = [
    "AgenticConfig",
    "AgenticTrajectory",
    "BelayerGrpoError",
    "CheckpointError",
    "Config",
    "DataError",
    "ExitCode",
    "GrpoConfigError",
    "RolloutError",
    "SandboxImageError",
    "SweTask",
    "SystemStartError",
    "TaskFormatError",
    "TrajectoryFailedError",
    "UnrecoverableTrajectoryError",
    "__version__",
    "builtin_tasks",
    "load_config",
    "load_swegym",
    "run_agentic_rollouts",
    "run_training",
    "to_samples",
]
