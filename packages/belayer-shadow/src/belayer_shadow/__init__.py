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
        HandoverError,
        InvalidSamplingParamsError,
        RequestError,
        SupervisorError,
        WeightsError,
        WorkerError,
    )

    # Workers, shadow worker and handover (worker half): _events, _heartbeat, _service, _shadow, _slot, _worker.
    from belayer_shadow._events import EventLog, read_events
    from belayer_shadow._heartbeat import HandoverFlag, Heartbeat
    from belayer_shadow._loader import (
        fill_weight_server,
        init_weights,
        load_safetensors,
        load_tokenizer,
        save_safetensors,
    )
    from belayer_shadow._sequence import SamplingParams, StepOutput
    from belayer_shadow._service import EngineService
    from belayer_shadow._shadow import ShadowConfig, check_device_health, run_shadow
    from belayer_shadow._slot import SlotSupervisor
    from belayer_shadow._slot_config import SlotConfig
    from belayer_shadow._worker import WorkerConfig, run_worker

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
    "EngineService": "belayer_shadow._service",
    "EventLog": "belayer_shadow._events",
    "HandoverError": "belayer_shadow._errors",
    "HandoverFlag": "belayer_shadow._heartbeat",
    "Heartbeat": "belayer_shadow._heartbeat",
    "ShadowConfig": "belayer_shadow._shadow",
    "SlotConfig": "belayer_shadow._slot_config",
    "SlotSupervisor": "belayer_shadow._slot",
    "SupervisorError": "belayer_shadow._errors",
    "WorkerConfig": "belayer_shadow._worker",
    "WorkerError": "belayer_shadow._errors",
    "check_device_health": "belayer_shadow._shadow",
    "read_events": "belayer_shadow._events",
    "run_shadow": "belayer_shadow._shadow",
    "run_worker": "belayer_shadow._worker",
}

__all__ = [
    "BelayerShadowError",
    "ConfigError",
    "EngineError",
    "EngineService",
    "EventLog",
    "HandoverError",
    "HandoverFlag",
    "Heartbeat",
    "InvalidSamplingParamsError",
    "LLMEngine",
    "ModelConfig",
    "RequestError",
    "SamplingParams",
    "ShadowConfig",
    "SlotConfig",
    "SlotSupervisor",
    "StepOutput",
    "SupervisorError",
    "WeightsError",
    "WorkerConfig",
    "WorkerError",
    "allocate_kv_arena",
    "check_device_health",
    "fill_weight_server",
    "init_weights",
    "kv_layout",
    "load_safetensors",
    "load_tokenizer",
    "read_events",
    "run_shadow",
    "run_worker",
    "save_safetensors",
    "weight_layout",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'belayer_shadow' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
