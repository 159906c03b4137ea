"""belayer-shadow: the rollout engine on external memory, the shadow worker and handover.

The engine is a Qwen3-architecture decoder whose parameters are views of belayer-gpumem's weight
server and whose paged KV cache lives in its KV server, so a shadow worker can take over the same
memory within a second when the main worker dies. Three private folders: `_engine/`
(the engine), `_workers/` (main worker, shadow, handover, slot supervisor) and `_serve/` (a whole
rollout service on one machine: the router and N slots); this module is the public API of all.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from belayer_shadow._cli import ExitCode
    from belayer_shadow._engine._config import ModelConfig, kv_layout, weight_layout
    from belayer_shadow._engine._llm_engine import LLMEngine, allocate_kv_arena
    from belayer_shadow._engine._loader import (
        fill_weight_server,
        init_weights,
        load_safetensors,
        load_tokenizer,
        save_safetensors,
    )
    from belayer_shadow._engine._sequence import SamplingParams, StepOutput
    from belayer_shadow._errors import (
        BelayerShadowError,
        HandoverError,
        InvalidSamplingParamsError,
        LLMEngineError,
        MemoryServerLostError,
        ModelConfigError,
        RequestError,
        SupervisorError,
        UnsupportedModelError,
        WeightsError,
        WorkerError,
    )
    from belayer_shadow._serve._config import ServeConfig
    from belayer_shadow._serve._flags import add_serve_flags, serve_config_from_flags
    from belayer_shadow._serve._model_folder import ModelFolder
    from belayer_shadow._serve._service import RolloutService
    from belayer_shadow._serve._weights import PreparedWeights, SlotWeights
    from belayer_shadow._vllm._media import set_aside_unloadable_media
    from belayer_shadow._workers._events import EventLog, read_events
    from belayer_shadow._workers._heartbeat import HandoverFlag, Heartbeat
    from belayer_shadow._workers._processes import reap_stale_processes
    from belayer_shadow._workers._service import EngineService
    from belayer_shadow._workers._shadow import ShadowConfig, check_device_health, run_shadow
    from belayer_shadow._workers._slot import SlotSupervisor
    from belayer_shadow._workers._slot_config import SlotConfig
    from belayer_shadow._workers._worker import WorkerConfig, run_worker

__version__ = importlib.metadata.version("belayer-shadow")

# name -> module; lazy so that `import belayer_shadow` stays cheap (no torch) for the CLI's parser.
_EXPORTS = {
    # Engine half (`_engine/`).
    "BelayerShadowError": "belayer_shadow._errors",
    "InvalidSamplingParamsError": "belayer_shadow._errors",
    "LLMEngine": "belayer_shadow._engine._llm_engine",
    "LLMEngineError": "belayer_shadow._errors",
    "ModelConfig": "belayer_shadow._engine._config",
    "ModelConfigError": "belayer_shadow._errors",
    "RequestError": "belayer_shadow._errors",
    "SamplingParams": "belayer_shadow._engine._sequence",
    "StepOutput": "belayer_shadow._engine._sequence",
    "UnsupportedModelError": "belayer_shadow._errors",
    "WeightsError": "belayer_shadow._errors",
    "allocate_kv_arena": "belayer_shadow._engine._llm_engine",
    "fill_weight_server": "belayer_shadow._engine._loader",
    "init_weights": "belayer_shadow._engine._loader",
    "kv_layout": "belayer_shadow._engine._config",
    "load_safetensors": "belayer_shadow._engine._loader",
    "load_tokenizer": "belayer_shadow._engine._loader",
    "save_safetensors": "belayer_shadow._engine._loader",
    "weight_layout": "belayer_shadow._engine._config",
    # Worker half (`_workers/`): workers, shadow worker, handover, supervisor.
    "EngineService": "belayer_shadow._workers._service",
    "EventLog": "belayer_shadow._workers._events",
    "ExitCode": "belayer_shadow._cli",
    "HandoverError": "belayer_shadow._errors",
    "MemoryServerLostError": "belayer_shadow._errors",
    "HandoverFlag": "belayer_shadow._workers._heartbeat",
    "Heartbeat": "belayer_shadow._workers._heartbeat",
    "ShadowConfig": "belayer_shadow._workers._shadow",
    "SlotConfig": "belayer_shadow._workers._slot_config",
    "SlotSupervisor": "belayer_shadow._workers._slot",
    "SupervisorError": "belayer_shadow._errors",
    "WorkerConfig": "belayer_shadow._workers._worker",
    "WorkerError": "belayer_shadow._errors",
    "check_device_health": "belayer_shadow._workers._shadow",
    "read_events": "belayer_shadow._workers._events",
    "reap_stale_processes": "belayer_shadow._workers._processes",
    "run_shadow": "belayer_shadow._workers._shadow",
    "run_worker": "belayer_shadow._workers._worker",
    # One machine's rollout service (`_serve/`): `belayer-shadow serve`.
    "ModelFolder": "belayer_shadow._serve._model_folder",
    "RolloutService": "belayer_shadow._serve._service",
    "ServeConfig": "belayer_shadow._serve._config",
    "add_serve_flags": "belayer_shadow._serve._flags",
    "serve_config_from_flags": "belayer_shadow._serve._flags",
    "PreparedWeights": "belayer_shadow._serve._weights",
    "SlotWeights": "belayer_shadow._serve._weights",
    # vLLM's CPU build beside CUDA builds of torchvision & co. (`_vllm/_media.py`).
    "set_aside_unloadable_media": "belayer_shadow._vllm._media",
}

__all__ = [
    "BelayerShadowError",
    "EngineService",
    "EventLog",
    "ExitCode",
    "HandoverError",
    "HandoverFlag",
    "Heartbeat",
    "InvalidSamplingParamsError",
    "LLMEngine",
    "LLMEngineError",
    "MemoryServerLostError",
    "ModelConfig",
    "ModelConfigError",
    "ModelFolder",
    "PreparedWeights",
    "RequestError",
    "RolloutService",
    "SamplingParams",
    "ServeConfig",
    "ShadowConfig",
    "SlotConfig",
    "SlotSupervisor",
    "SlotWeights",
    "StepOutput",
    "SupervisorError",
    "UnsupportedModelError",
    "WeightsError",
    "WorkerConfig",
    "WorkerError",
    "__version__",
    "add_serve_flags",
    "allocate_kv_arena",
    "check_device_health",
    "fill_weight_server",
    "init_weights",
    "kv_layout",
    "load_safetensors",
    "load_tokenizer",
    "read_events",
    "reap_stale_processes",
    "run_shadow",
    "run_worker",
    "save_safetensors",
    "serve_config_from_flags",
    "set_aside_unloadable_media",
    "weight_layout",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'belayer_shadow' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
