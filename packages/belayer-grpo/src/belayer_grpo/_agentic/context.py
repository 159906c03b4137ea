"""What the model sees: the prompt, its responses and the observations, as tokens with a loss mask.

The router keeps the same token context per turn (``L_t``); this local copy adds what the trainer
needs and the router does not keep: which tokens the model generated (loss mask) and their
logprobs.  Contexts only grow, so going back to ``L_t`` is a truncation.
"""

from __future__ import annotations

import hashlib

import attrs

from belayer_envckpt import ExecResult
from belayer_grpo._agentic.actions import FORMAT_HINT
from belayer_grpo._agentic.swegym import SweTask
from belayer_grpo._agentic.tooluse import ToolUseTask
from belayer_router import Tokenizer

__all__ = [
    "AgentTask",
    "TokenContext",
    "context_digest",
    "render_feedback",
    "render_observation",
    "render_prompt",
]


AgentTask = SweTask | ToolUseTask


def render_prompt(task: AgentTask) -> str:
    """The first user turn: the problem statement and the rules of the interaction (a tool-use
    task's statement is its whole prompt: it names the actions itself)."""
    if isinstance(task, ToolUseTask):
        return task.problem_statement
    return (
        "You are fixing a bug in the repository in the current directory.\n"
        f"Problem:\n{task.problem_statement.strip()}\n\n"
        f"{FORMAT_HINT} You see its output, then send the next command. "
        "When the tests pass, send `submit`.\n"
    )


def render_observation(result: ExecResult, max_chars: int) -> str:
    """The observation of one action: exit status and combined output, tail-truncated."""
    output = result.stdout + result.stderr
    if len(output) > max_chars:
        output = f"[... {len(output) - max_chars} characters cut ...]\n" + output[-max_chars:]
    status = "timeout" if result.timed_out else str(result.exit_code)
    return f"\n<observation exit={status}>\n{output}</observation>\n"


def render_feedback(feedback: str) -> str:
    """The observation for a response without a usable action."""
    return f"\n<observation error>\n{feedback}\n</observation>\n"


def context_digest(token_ids: list[int]) -> str:
    """A hash of a token context (compared against the router's ``L_t`` after a recovery)."""
    return hashlib.sha256(b",".join(str(t).encode() for t in token_ids)).hexdigest()


@attrs.define
class TokenContext:
    """Token ids with, per token, whether the model generated it and its logprob (0 otherwise)."""

    token_ids: list[int] = attrs.field(factory=list)
    generated: list[bool] = attrs.field(factory=list)
    logprobs: list[float] = attrs.field(factory=list)
    num_prompt_tokens: int = 0

    @classmethod
    def from_prompt(cls, tokenizer: Tokenizer, text: str) -> TokenContext:
        """A context holding only the prompt."""
        ids = tokenizer.encode(text)
        return cls(list(ids), [False] * len(ids), [0.0] * len(ids), len(ids))

    def __len__(self) -> int:
        return len(self.token_ids)

    def add_generated(self, token_ids: list[int], logprobs: list[float]) -> None:
        """Append a response as the router streamed it."""
        self.token_ids += token_ids
        self.generated += [True] * len(token_ids)
        self.logprobs += logprobs

    def add_text(self, tokenizer: Tokenizer, text: str) -> None:
        """Append an observation (not generated, not trained on)."""
        ids = tokenizer.encode(text)
        self.token_ids += ids
        self.generated += [False] * len(ids)
        self.logprobs += [0.0] * len(ids)

    def truncate(self, length: int) -> None:
        """Go back to the first ``length`` tokens (an earlier ``L_t``)."""
        if not self.num_prompt_tokens <= length <= len(self):
            raise ValueError(f"cannot truncate a context of {len(self)} tokens to {length}")
        del self.token_ids[length:], self.generated[length:], self.logprobs[length:]

    def digest(self) -> str:
        """`context_digest` of the token ids."""
        return context_digest(self.token_ids)
