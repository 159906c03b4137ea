"""belayer-grpo: GRPO training with rollouts through the Belayer router, and the system behind it.

`belayer-grpo train` assembles the router, the engine slots (memory servers, main worker and shadow
worker), the sandbox pool and the trainer, and shuts all of it down again on exit or Ctrl-C.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    # Agentic workload, then core.
    from belayer_grpo.agentic import (
        AgenticConfig,
        AgenticTrajectory,
        SweTask,
        builtin_tasks,
        load_swegym,
        run_agentic_rollouts,
        to_samples,
    )
    from belayer_grpo.errors import (
        BelayerGrpoError,
        CheckpointError,
        ConfigError,
        DataError,
        RolloutError,
        SystemStartError,
    )

# name -> module; lazy so that `import belayer_grpo` stays cheap (no torch) for the CLI's parser.
_EXPORTS = {
    # Core.
    "BelayerGrpoError": "belayer_grpo.errors",
    "CheckpointError": "belayer_grpo.errors",
    "ConfigError": "belayer_grpo.errors",
    "DataError": "belayer_grpo.errors",
    "RolloutError": "belayer_grpo.errors",
    "SystemStartError": "belayer_grpo.errors",
    # Agentic workload.
    "AgenticConfig": "belayer_grpo.agentic",
    "AgenticTrajectory": "belayer_grpo.agentic",
    "SweTask": "belayer_grpo.agentic",
    "builtin_tasks": "belayer_grpo.agentic",
    "load_swegym": "belayer_grpo.agentic",
    "run_agentic_rollouts": "belayer_grpo.agentic",
    "to_samples": "belayer_grpo.agentic",
}

__all__ = [
    "AgenticConfig",
    "AgenticTrajectory",
    "BelayerGrpoError",
    "CheckpointError",
    "ConfigError",
    "DataError",
    "RolloutError",
    "SweTask",
    "SystemStartError",
    "builtin_tasks",
    "load_swegym",
    "run_agentic_rollouts",
    "to_samples",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'belayer_grpo' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
