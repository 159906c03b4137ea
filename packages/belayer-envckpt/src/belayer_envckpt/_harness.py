"""A belayer-envckpt sandbox as the execution environment of an agent harness (mini-swe-agent).

`SandboxEnvironment` implements mini-swe-agent's ``Environment`` protocol (``execute``,
``get_template_vars``, ``serialize``; duck-typed, so envckpt does not depend on mini-swe-agent)
over a `Sandbox`.  At every action boundary a pluggable ``decide`` callable says whether to take a
checkpoint (`checkpoint`, the cheapest kind that captures the sandbox, or `full_checkpoint` with
``kinds=False``; synchronous, before the output goes back to the agent).  When
the sandbox dies (killed between actions or under one), the next action restores the latest
ready checkpoint (`full_restore`, a fresh container) and re-runs the actions the agent has seen
since that checkpoint, so the sandbox again matches the agent's context; then the action runs.
The agent notices nothing but the time it took.
"""

from __future__ import annotations

import contextlib
import platform
import time
from collections.abc import Callable
from typing import Any

import attrs

from ._checkpoint import full_checkpoint, full_restore
from ._docker import Engine
from ._errors import (
    BelayerEnvckptError,
    CheckpointFailedError,
    ContainerEngineError,
    ContainerNotFoundError,
    InvalidConfigError,
)
from ._exec import ExecResult
from ._kinds import checkpoint, next_checkpoint_kind
from ._sandbox import Sandbox
from ._store import Checkpoint, CheckpointStore

__all__ = ["ActionStep", "HarnessState", "SandboxEnvironment", "SandboxLostError"]

SUBMIT_MARKER = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"


class SandboxLostError(BelayerEnvckptError):
    """The sandbox kept dying: restoring it and re-running the action failed too often."""


@attrs.frozen
class ActionStep:
    """One committed action, as the ``decide`` callable sees it.

    ``response_s`` is the time between the previous action's end and this action's start (the
    harness's model call, mostly); ``now_s`` counts from the environment's creation.
    ``checkpoint_kind`` is the kind a checkpoint now would take (`next_checkpoint_kind`; "" when
    the environment takes only full checkpoints).
    """

    step_index: int
    command: str
    exit_code: int
    response_s: float
    action_s: float
    now_s: float
    actions_since_checkpoint: int
    checkpoint_kind: str = ""

    def observation(self) -> dict[str, Any]:
        """The fields of belayer-policy's ``StepObservation`` (``StepObservation(**step.observation())``)."""
        fields: dict[str, Any] = {
            "step_index": self.step_index,
            "response_s": self.response_s,
            "action_s": self.action_s,
            "now": self.now_s,
        }
        if self.checkpoint_kind:
            fields["checkpoint_kind"] = self.checkpoint_kind
        return fields


@attrs.define
class HarnessState:
    """What the environment did, for logs and tests."""

    num_actions: int = 0
    num_checkpoints: int = 0
    num_checkpoint_failures: int = 0
    num_restores: int = 0
    num_replayed: int = 0
    replay_mismatches: list[str] = attrs.field(factory=list)
    checkpoint_s: list[float] = attrs.field(factory=list)
    checkpoint_kinds: list[str] = attrs.field(factory=list)
    restore_s: list[float] = attrs.field(factory=list)


_KILLED = (137, 126, -1)  # SIGKILL, exec refused, no exit code


def _always(_step: ActionStep) -> bool:
    return True


def _merged(command: str) -> list[str]:
    return ["/bin/sh", "-c", "exec 2>&1\n" + command]  # one output stream, in order


@attrs.define(eq=False)
class SandboxEnvironment:
    """mini-swe-agent ``Environment`` over a belayer-envckpt `Sandbox` with checkpoints.

    ``decide(step) -> bool``: checkpoint after this action? (default: after every action).
    ``on_checkpoint(took_s)`` / ``on_restore(restore_s)``: told after each checkpoint / restore
    (a belayer-policy policy's ``on_checkpoint_ready`` / ``on_restore``).  ``kinds``: take the
    cheapest checkpoint kind (`checkpoint`) and tell ``decide`` which it would be; False: always
    `full_checkpoint`.
    """

    sandbox: Sandbox
    store: CheckpointStore
    trajectory: str
    decide: Callable[[ActionStep], bool] = _always
    on_checkpoint: Callable[[float], None] | None = None
    on_restore: Callable[[float], None] | None = None
    cwd: str = ""
    timeout_s: float = 60.0
    max_restores: int = attrs.field(default=3, validator=attrs.validators.ge(0))
    settle_s: float = 5.0  # how long a SIGKILLed command waits for the engine to see a dead sandbox
    engine: Engine | None = None
    kinds: bool = True
    state: HarnessState = attrs.field(factory=HarnessState)
    _replay: list[tuple[str, str, str]] = attrs.field(factory=list, alias="_replay")  # since checkpoint
    _checkpoint: Checkpoint | None = attrs.field(default=None, alias="_checkpoint")
    _started: float = attrs.field(factory=time.monotonic, alias="_started")
    _last_end: float = attrs.field(factory=time.monotonic, alias="_last_end")

    @property
    def config(self) -> dict[str, Any]:
        """What mini-swe-agent reads as the environment's config."""
        return {"cwd": self.cwd or self.sandbox.config.working_dir, "timeout": self.timeout_s}

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        """Template variables: the config, the platform, and ``kwargs``."""
        return {**self.config, **platform.uname()._asdict(), **kwargs}

    def serialize(self) -> dict[str, Any]:
        """The environment's part of a saved trajectory."""
        return {
            "info": {
                "config": {
                    "environment": {**self.config, "image": self.sandbox.config.image},
                    "environment_type": f"{type(self).__module__}.{type(self).__name__}",
                },
                "belayer_envckpt": attrs.asdict(self.state),
            }
        }

    def execute(self, action: dict[str, Any], cwd: str = "", *, timeout: int | None = None) -> dict[str, Any]:
        """Run ``action["command"]``; restore and retry if the sandbox died; maybe checkpoint."""
        command = action.get("command", "")
        if not isinstance(command, str):
            raise InvalidConfigError(f"action 'command' must be a string, got {command!r}")
        workdir = str(cwd or self.config["cwd"])
        timeout_s = float(timeout or self.timeout_s)
        started = time.monotonic()
        result = self._run_surviving(command, workdir, timeout_s)
        ended = time.monotonic()
        text = result.stdout + result.stderr
        returncode = -1 if result.timed_out else result.exit_code
        output: dict[str, Any] = {
            "output": text,
            "returncode": returncode,
            "exception_info": f"the command timed out after {timeout_s:g} s" if result.timed_out else "",
        }
        self.state.num_actions += 1
        self._replay.append((command, workdir, text))
        step = ActionStep(
            step_index=self.state.num_actions,
            command=command,
            exit_code=returncode,
            response_s=max(0.0, started - self._last_end),
            action_s=ended - started,
            now_s=ended - self._started,
            actions_since_checkpoint=len(self._replay),
            checkpoint_kind=self._next_kind(),
        )
        if self.decide(step):
            try:
                self.checkpoint()
            except CheckpointFailedError:  # the previous checkpoint and the replay log still hold
                self.state.num_checkpoint_failures += 1
        self._last_end = time.monotonic()
        _check_submitted(output)
        return output

    def _next_kind(self) -> str:
        if not self.kinds:
            return ""
        try:
            return str(next_checkpoint_kind(self.sandbox, self.store, self.trajectory))
        except BelayerEnvckptError:  # a dying sandbox: the checkpoint itself will say what is wrong
            return "full"

    def checkpoint(self) -> Checkpoint:
        """Take a checkpoint now (of the cheapest kind, unless ``kinds`` is False); the actions
        before it need no replay any more."""
        started = time.monotonic()
        take = checkpoint if self.kinds else full_checkpoint
        self._checkpoint = take(
            self.sandbox, self.trajectory, context_ref=f"actions/{self.state.num_actions}", store=self.store
        )
        took_s = time.monotonic() - started
        self.state.checkpoint_kinds.append(self._checkpoint.kind)
        self._replay.clear()
        self.state.num_checkpoints += 1
        self.state.checkpoint_s.append(took_s)
        if self.on_checkpoint is not None:
            self.on_checkpoint(took_s)
        return self._checkpoint

    def restore(self) -> None:
        """Bring a fresh sandbox to the agent's context: the latest checkpoint, then the replay."""
        started = time.monotonic()
        engine = self.engine or self.sandbox.engine
        old = self.sandbox
        if self._checkpoint is not None:
            # The dead sandbox is the current one, which after an earlier restore is not the
            # checkpoint's container_id: remove it ourselves, or a restored sandbox that died leaks.
            with contextlib.suppress(BelayerEnvckptError):  # already gone with the failure
                old.remove()
            self.sandbox = full_restore(self._checkpoint, engine=engine, remove_failed=False)
        else:  # nothing checkpointed yet: a fresh sandbox replays every action so far
            self.sandbox = Sandbox.create(engine, old.config, trajectory=self.trajectory)
            with contextlib.suppress(BelayerEnvckptError):  # already gone with the failure
                old.remove()
        for command, workdir, seen in self._replay:
            again = self.sandbox.exec(_merged(command), self.timeout_s, workdir=workdir)
            self.state.num_replayed += 1
            if again.stdout + again.stderr != seen:
                self.state.replay_mismatches.append(command)
        took_s = time.monotonic() - started
        self.state.num_restores += 1
        self.state.restore_s.append(took_s)
        if self.on_restore is not None:
            self.on_restore(took_s)

    def _died(self) -> bool:
        """Whether the sandbox is dead, waiting ``settle_s`` for the engine to notice a kill."""
        deadline = time.monotonic() + self.settle_s
        while self.sandbox.is_running():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True

    def _run_surviving(self, command: str, workdir: str, timeout_s: float) -> ExecResult:
        for _attempt in range(self.max_restores + 1):
            try:
                result = self.sandbox.exec(_merged(command), timeout_s, workdir=workdir)
            except (ContainerEngineError, ContainerNotFoundError):
                if not self._died():
                    raise  # the engine refused something else: not a dead sandbox
            else:
                # A command killed with its sandbox ends with SIGKILL's 137 before the engine
                # marks the container dead; any other exit is the command's own.
                suspect = result.exit_code in _KILLED and not result.timed_out
                if not (self._died() if suspect else not self.sandbox.is_running()):
                    return result
            self.restore()  # died before or under the action: restore, then run it again
        raise SandboxLostError(
            f"sandbox of trajectory {self.trajectory!r} died {self.max_restores + 1} times running "
            f"{command[:80]!r}; check the engine (docker ps -a) and the command's resource use"
        )

    def cleanup(self) -> None:
        """Remove the sandbox (checkpoints stay in the store)."""
        with contextlib.suppress(BelayerEnvckptError):
            self.sandbox.remove()


def _check_submitted(output: dict[str, Any]) -> None:
    """mini-swe-agent's submission convention: the marker as the output's first line, exit 0."""
    lines = output["output"].lstrip().splitlines(keepends=True)
    if not lines or lines[0].strip() != SUBMIT_MARKER or output["returncode"] != 0:
        return
    from minisweagent.exceptions import Submitted  # the harness is running: it is installed

    submission = "".join(lines[1:])
    raise Submitted(
        {
            "role": "exit",
            "content": submission,
            "extra": {"exit_status": "Submitted", "submission": submission},
        }
    )
