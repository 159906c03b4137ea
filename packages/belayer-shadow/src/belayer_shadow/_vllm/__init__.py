"""vLLM as belayer-shadow's rollout engine (private; needs the `vllm` extra).

`VllmEngine` runs a real vLLM engine in process behind the interface the main and shadow workers
drive, on the weight server's memory (`_loader`: a model loader registered with vLLM whose
parameters are views of the server's region), with keyed sampling (`_sampling`) so that a
resumed seeded request continues exactly. Nothing here imports vLLM until an engine is built.
"""

from __future__ import annotations

from belayer_shadow._vllm._engine import SUPPORTED_ARCHITECTURES, VllmEngine, model_folder

__all__ = ["SUPPORTED_ARCHITECTURES", "VllmEngine", "model_folder"]
