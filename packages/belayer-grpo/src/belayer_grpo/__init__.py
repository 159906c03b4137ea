"""belayer-grpo: GRPO training with rollouts through the Belayer router, and the system behind it.

`belayer-grpo train` assembles the router, the engine slots (memory servers, main worker and shadow
worker), the sandbox pool and the trainer, and shuts all of it down again on exit or Ctrl-C.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    # Core.
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
}

__all__ = [
    "BelayerGrpoError",
    "CheckpointError",
    "ConfigError",
    "DataError",
    "RolloutError",
    "SystemStartError",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'belayer_grpo' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
