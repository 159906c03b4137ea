"""The one error hierarchy of belayer-shadow, rooted at `BelayerShadowError`."""

from __future__ import annotations

__all__ = [
    "BelayerShadowError",
    "HandoverError",
    "InvalidSamplingParamsError",
    "LLMEngineError",
    "MemoryServerLostError",
    "ModelConfigError",
    "RequestError",
    "SupervisorError",
    "UnsupportedModelError",
    "WeightsError",
    "WorkerError",
]


class BelayerShadowError(Exception):
    """Base class of every error raised by belayer-shadow."""


class ModelConfigError(BelayerShadowError, ValueError):
    """A model configuration is invalid or cannot be read."""


class UnsupportedModelError(ModelConfigError):
    """A model folder holds an architecture belayer-shadow cannot serve (the message names those it can)."""


class WeightsError(BelayerShadowError, ValueError):
    """Weights do not fit the model configuration (missing, extra, wrong shape or dtype)."""


class LLMEngineError(BelayerShadowError):
    """The engine cannot do what was asked (e.g. a request can never fit in the KV pool)."""


class RequestError(LLMEngineError, ValueError):
    """A request is malformed: duplicate id, empty prompt, token id out of the vocabulary."""


class InvalidSamplingParamsError(RequestError):
    """`SamplingParams` got a value outside its domain."""


# Workers, shadow worker and handover (worker half).


class WorkerError(BelayerShadowError):
    """A worker could not start, register or serve (bad arguments, router refused it)."""


class HandoverError(BelayerShadowError):
    """A handover step failed: the GPU health check, or a memory server is gone; the slot is not served."""


class MemoryServerLostError(HandoverError):
    """A handover found a memory server (weights or KV) gone or not answering: the shadow does not
    serve from that memory, and the slot supervisor restarts the slot from scratch (new memory
    servers, the current weights reloaded, a new main and shadow); not a GPU failure."""


class SupervisorError(BelayerShadowError):
    """The slot supervisor could not start or keep its processes (a child failed to come up in time)."""
