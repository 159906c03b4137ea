"""Agent harness environments backed by a checkpointed sandbox (for harness users).

`SandboxEnvironment` is a mini-swe-agent ``Environment`` over a `belayer_envckpt.Sandbox` with
full checkpoints at action boundaries (the ``decide`` callable says when) and transparent restore
when the sandbox dies.  See the README section "Agent harnesses".
"""

from __future__ import annotations

from ._harness import SUBMIT_MARKER, ActionStep, HarnessState, SandboxEnvironment, SandboxLostError

__all__ = ["SUBMIT_MARKER", "ActionStep", "HarnessState", "SandboxEnvironment", "SandboxLostError"]
