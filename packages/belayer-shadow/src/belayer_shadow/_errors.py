"""The one error hierarchy of belayer-shadow, rooted at `BelayerShadowError`."""

from __future__ import annotations

__all__ = [
    "BelayerShadowError",
    "ConfigError",
    "EngineError",
    "InvalidSamplingParamsError",
    "RequestError",
    "WeightsError",
]


class BelayerShadowError(Exception):
    """Base class of every error raised by belayer-shadow."""


class ConfigError(BelayerShadowError, ValueError):
    """A model configuration is invalid or cannot be read."""


class WeightsError(BelayerShadowError, ValueError):
    """Weights do not fit the model configuration (missing, extra, wrong shape or dtype)."""


class EngineError(BelayerShadowError):
    """The engine cannot do what was asked (e.g. a request can never fit in the KV pool)."""


class RequestError(EngineError, ValueError):
    """A request is malformed: duplicate id, empty prompt, token id out of the vocabulary."""


class InvalidSamplingParamsError(RequestError):
    """`SamplingParams` got a value outside its domain."""
