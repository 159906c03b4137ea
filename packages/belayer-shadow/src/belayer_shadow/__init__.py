"""belayer-shadow: the rollout engine on external memory, the shadow worker and handover.

The engine is a Qwen3-architecture decoder whose parameters are views of belayer-gpumem's weight
server and whose paged KV cache lives in its KV server, so a shadow worker can take over the same
memory within a second when the main worker dies.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    # Engine (engine half).
    from belayer_shadow._config import ModelConfig, kv_layout, weight_layout
    from belayer_shadow._engine import LLMEngine, allocate_kv_arena
    from belayer_shadow._errors import (
        BelayerShadowError,
        ConfigError,
        EngineError,
        InvalidSamplingParamsError,
        RequestError,
        WeightsError,
    )
    from belayer_shadow._loader import (
        fill_weight_server,
        init_weights,
        load_safetensors,
        load_tokenizer,
        save_safetensors,
    )
    from belayer_shadow._sequence import SamplingParams, StepOutput

# name -> module; lazy so that `import belayer_shadow` stays cheap (no torch) for the CLI's parser.
_EXPORTS = {
    # Engine (engine half).
    "BelayerShadowError": "belayer_shadow._errors",
    "ConfigError": "belayer_shadow._errors",
    "EngineError": "belayer_shadow._errors",
    "InvalidSamplingParamsError": "belayer_shadow._errors",
    "LLMEngine": "belayer_shadow._engine",
    "ModelConfig": "belayer_shadow._config",
    "RequestError": "belayer_shadow._errors",
    "SamplingParams": "belayer_shadow._sequence",
    "StepOutput": "belayer_shadow._sequence",
    "WeightsError": "belayer_shadow._errors",
    "allocate_kv_arena": "belayer_shadow._engine",
    "fill_weight_server": "belayer_shadow._loader",
    "init_weights": "belayer_shadow._loader",
    "kv_layout": "belayer_shadow._config",
    "load_safetensors": "belayer_shadow._loader",
    "load_tokenizer": "belayer_shadow._loader",
    "save_safetensors": "belayer_shadow._loader",
    "weight_layout": "belayer_shadow._config",
    # Workers, shadow worker and handover (worker half).
}

__all__ = [
    "BelayerShadowError",
    "ConfigError",
    "EngineError",
    "InvalidSamplingParamsError",
    "LLMEngine",
    "ModelConfig",
    "RequestError",
    "SamplingParams",
    "StepOutput",
    "WeightsError",
    "allocate_kv_arena",
    "fill_weight_server",
    "init_weights",
    "kv_layout",
    "load_safetensors",
    "load_tokenizer",
    "save_safetensors",
    "weight_layout",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'belayer_shadow' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
