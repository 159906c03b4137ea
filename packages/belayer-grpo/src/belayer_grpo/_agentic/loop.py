"""The agent loop of one trajectory: response -> action -> observation, with recovery.

Each round: the response comes from the router (``trajectory_id``/``turn`` set, so the router
records ``L_turn``), the bash action runs in the trajectory's sandbox, the observation is appended
and ``L_turn`` is stored again with it.  After every environment step the checkpoint policy
decides; a decided full checkpoint overlaps the next response and is tied to ``L_turn``.  On a
sandbox failure the latest ready checkpoint is restored, its ``L_turn`` reloaded from the router
and generation resumes from there (from the base image and the prompt when there is none, which
is always the case under ``never``).  At the end the task's tests give the reward (a tool-use
task scores the answer against what its actions really returned).  With ``sandbox_recovery =
"image"`` (the control without recovery) a failed sandbox is replaced by a fresh one from the image
and only the failed turn is taken again: the agent's context keeps what the lost state held.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from typing import Any

import anyio
import attrs

from belayer_envckpt import BelayerEnvckptError, ExecResult, SandboxLike
from belayer_grpo._agentic import actions, environment
from belayer_grpo._agentic.context import (
    AgentTask,
    TokenContext,
    context_digest,
    render_feedback,
    render_observation,
    render_prompt,
)
from belayer_grpo._agentic.journal import (
    LoggedAction,
    TrajectoryJournal,
    action_event,
    checkpoint_event,
    rewind_event,
)
from belayer_grpo._agentic.pool import SandboxLease
from belayer_grpo._agentic.records import AgenticTrajectory, CheckpointRecord, RecoveryRecord
from belayer_grpo._agentic.settings import AgenticConfig
from belayer_grpo._agentic.tooluse import ToolObservation, ToolUseTask
from belayer_grpo._errors import SandboxCommandError, UnrecoverableTrajectoryError, describe_error
from belayer_policy import CheckpointPolicy, StepObservation
from belayer_router import Completion, RouterClient, RouterClientError, Tokenizer

__all__ = ["AgentLoop", "derive_seed"]

_FAILED = (BelayerEnvckptError, SandboxCommandError)
_COST_WEIGHING = ("adaptive", "paper")  # the rules that weigh a checkpoint's cost (its kind's)


def derive_seed(base: int, trajectory: str, turn: int) -> int:
    """A response's sampling seed: the same on regeneration, so deterministic engines repeat it."""
    digest = hashlib.sha256(f"{base}/{trajectory}/{turn}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


@attrs.define
class AgentLoop:
    """Rolls out one trajectory of ``task`` in the sandbox of ``lease``."""

    task: AgentTask
    trajectory_id: str
    config: AgenticConfig
    router: RouterClient
    tokenizer: Tokenizer
    lease: SandboxLease
    policy: CheckpointPolicy
    injector: environment.StepFault | None = None
    group_index: int = 0
    sample_index: int = 0
    context: TokenContext = attrs.field(factory=TokenContext)
    prefix: int = 0
    turn: int = 0
    checkpoints: list[CheckpointRecord] = attrs.field(factory=list)
    recoveries: list[RecoveryRecord] = attrs.field(factory=list)
    num_responses: int = 0
    num_checkpoint_failures: int = 0
    num_resumed_responses: int = 0
    num_checkpoint_fallbacks: int = 0  # ready checkpoints given up at a restore (corrupt, unverified)
    kind_query_s: float = 0.0  # time spent asking which kind a checkpoint would take (overlapped)
    decide_waited_s: float = 0.0  # what of a decision without checkpoint the next action waited for
    # The journal (`belayer_grpo._agentic.journal`): ``note`` takes each event as it happens (the
    # step's rollout log); ``resume`` is a killed trainer's journal of this trajectory to continue.
    note: Callable[[dict[str, Any]], None] | None = None
    resume: TrajectoryJournal | None = None
    num_actions_replayed: int = 0  # logged actions run again to rebuild the sandbox (resume)
    restored_from_checkpoint: bool = False  # the resumed sandbox came from a logged checkpoint
    num_turns_regenerated: int = 0  # turns a resume had to generate anew (the router lost or refused them)
    # every replayed action returned what the journal holds (one that did not was recovered: `_rebuild`)
    replay_consistent: bool = True
    num_rebuild_failures: int = 0  # sandbox failures while rebuilding (recovered: restored, replayed again)
    num_turns_diverged: int = 0  # logged turns that came back other than logged (a ``rewind`` each)
    _from_journal: list[LoggedAction] = attrs.field(factory=list)  # actions taken from ``resume``
    _base: CheckpointRecord | None = None
    _pending: _Step | None = None  # the last step, decided on during the next response
    _response_tokens: dict[int, int] = attrs.field(factory=dict)
    # Per committed step: [response_s, action_s, checkpoint_s or None]; `_unspent_response_s` holds
    # response time of rounds without an action (feedback), charged to the next step.
    _steps: list[list[float | None]] = attrs.field(factory=list)
    _step_kinds: dict[int, str] = attrs.field(factory=dict)  # by prefix: the trace's checkpoint_kind
    _unspent_response_s: float = 0.0
    _failed_steps: list[int] = attrs.field(factory=list)
    # Tool-use tasks: what each turn's action returned, and the final answer.
    _observations: dict[int, ToolObservation] = attrs.field(factory=dict)
    _answer: str | None = None
    _round_start: int = 0  # context length before the current response
    _verified_length: int = 0  # the context length of the checkpoint restored last
    _started: float = attrs.field(factory=time.monotonic)

    def _now(self) -> float:
        return time.monotonic() - self._started

    async def run(self) -> AgenticTrajectory:
        """Roll out to the end (surviving sandbox failures) and score with the task's tests."""
        await self._begin()
        while True:
            finish = await self._episode()
            if isinstance(finish, environment.SandboxFailure):
                await self._recover(finish)
                continue
            # A resumed trajectory that ends on its logged turns: its sandbox (a replay that
            # returned other than logged is recovered like a sandbox failure: see `_rebuild`).
            if (diverged := await self._rebuild()) is not None:
                await self._recover(diverged)
                continue
            if isinstance(self.task, ToolUseTask):
                state = await self._read_state()
                if isinstance(state, environment.SandboxFailure):
                    await self._recover(state)
                    continue
                observations = [self._observations[t] for t in sorted(self._observations)]
                reward = self.task.score(self._answer, observations, state)
                steps = "; ".join(f"{o.command} -> {o.output.strip()[:40]!r}" for o in observations)
                held = "" if state is None else f"; state {state.strip()[:40]!r}"
                result = _TestResult(0 if reward else 1, f"{steps}; answer {self._answer!r}{held}", "")
                break
            tested = await anyio.to_thread.run_sync(self._run_tests)
            if isinstance(tested, environment.SandboxFailure):
                await self._recover(tested)
                continue
            result = tested
            reward = 1.0 if result.exit_code == 0 else 0.0
            break
        await self.router.drop_trajectory(self.trajectory_id)
        last, self._pending = self._pending, None  # an action that no response followed: undecided
        self.policy.on_trajectory_end(
            self.prefix,
            None
            if last is None
            else StepObservation(last.record.prefix, last.response_s, last.action_s, self._now()),
        )
        return self._finish(finish, reward, result.exit_code, result.stdout + result.stderr)

    async def _begin(self) -> None:
        self.context = TokenContext.from_prompt(self.tokenizer, render_prompt(self.task))
        await self.router.put_context(self.trajectory_id, 0, self.context.token_ids)
        for attempt in range(3):
            try:
                repo_hash = await anyio.to_thread.run_sync(
                    environment.repository_hash, self.lease.sandbox, self.task.workdir
                )
                break
            except _FAILED:
                if attempt == 2:
                    raise
                await self.lease.restart()  # a sandbox that cannot even be read is replaced
        ref = environment.context_ref(self.trajectory_id, 0)
        self._base = CheckpointRecord(0, 0, ref, self.context.digest(), repo_hash)

    # -- rounds ----------------------------------------------------------------------------

    async def _episode(self) -> str | environment.SandboxFailure:
        while self.turn < self.config.max_rounds:
            room = self.config.max_context_tokens - len(self.context)
            if room < 1:
                return "context_full"
            turn = self.turn + 1
            self._round_start = len(self.context)
            completion, response_s = await self._respond(turn, room)
            self.context.add_generated(completion.token_ids, completion.logprobs)
            self.turn = turn
            self._response_tokens[turn] = len(completion.token_ids)
            stops = set(self.config.stop_token_ids)
            text = self.tokenizer.decode([t for t in completion.token_ids if t not in stops])
            action = actions.parse_action(text)
            logged = self._follow_journal(turn, action)
            if isinstance(action, actions.Submit):
                return "submit"
            if isinstance(action, actions.Answer):
                self._answer = action.text
                return "answer" if isinstance(self.task, ToolUseTask) else "submit"
            if isinstance(action, actions.InvalidAction):
                if self.config.invalid_action == "end":
                    return "no_action"
                self._unspent_response_s += response_s
                responded = len(self.context)
                self.context.add_text(self.tokenizer, render_feedback(action.feedback))
                await self._send_added(turn, responded)
                continue
            outcome: ExecResult | environment.SandboxFailure
            if logged is not None:  # resumed: what it returned is in the journal; the sandbox later
                outcome, self.prefix = logged.result(), logged.prefix
            else:
                if (diverged := await self._rebuild()) is not None:
                    return diverged  # rewound to a checkpoint (or the prompt) by `_recover`
                outcome = await anyio.to_thread.run_sync(
                    environment.run_action,
                    self.lease.sandbox,
                    action.command,
                    self.config.action_timeout_s,
                    self.injector,
                )
                if isinstance(outcome, environment.SandboxFailure):
                    return outcome
                self.prefix = self.lease.sandbox.prefix
            self._observations[turn] = ToolObservation(
                action.command, outcome.exit_code, outcome.stdout + outcome.stderr
            )
            del self._steps[self.prefix - 1 :]
            self._steps.append([self._unspent_response_s + response_s, outcome.duration_s, None])
            self._step_kinds.pop(self.prefix, None)  # a step committed again: its kind is asked again
            self._unspent_response_s = 0.0
            if isinstance(self.task, ToolUseTask):
                observation = self.task.render_observation(outcome.exit_code, outcome.stdout + outcome.stderr)
            else:
                observation = render_observation(outcome, self.config.max_observation_chars)
            responded = len(self.context)
            self.context.add_text(self.tokenizer, observation)
            await self._send_added(turn, responded)
            if logged is not None:
                self._check_logged_context(logged)
                continue  # its checkpoint, if it had one, is in the journal too
            # Logged with the context it leaves (a resume compares the context it rebuilt with it).
            self._note(
                action_event(
                    self.trajectory_id, turn, self.prefix, action.command, outcome, self.context.digest()
                )
            )
            # Decided (and checkpointed) while the next response is generated: see `_respond`.
            ref = environment.context_ref(self.trajectory_id, turn)
            self._pending = _Step(
                CheckpointRecord(self.prefix, turn, ref, self.context.digest(), ""),
                response_s,
                outcome.duration_s,
            )
        return "max_rounds"

    async def _next_kind(self) -> str | None:
        """The kind a checkpoint now would take, for a policy that weighs its cost (adaptive, paper):
        a read of the sandbox's processes and layer metadata on its host, overlapped with the next
        response (its time is counted in ``kind_query_s``).  None (a full checkpoint is weighed) for the
        fixed policies, which do not weigh costs, and when it cannot be told."""
        if self.policy.name not in _COST_WEIGHING:
            return None
        started = time.monotonic()
        sandbox = self.lease.sandbox
        kind = await anyio.to_thread.run_sync(lambda: self.lease.pool.next_kind(sandbox, self.trajectory_id))
        self.kind_query_s += time.monotonic() - started
        return kind

    async def _send_added(self, turn: int, responded: int) -> None:
        """Send the router what turn ``turn`` added after its response (``context[responded:]``):
        the router recorded prompt + completion as ``L_turn`` when the turn's generation finished,
        so the context crosses the wire once per turn and the router owns it. Should the router's
        ``L_turn`` not be ours (unknown to it: 404, or another length after the append), ours is
        sent whole: a recovery must always find the very context a checkpoint was taken with."""
        added = self.context.token_ids[responded:]
        try:
            length = await self.router.append_context(self.trajectory_id, turn, added)
        except RouterClientError as error:
            if error.status != 404:
                raise
            length = -1
        if length != len(self.context):
            await self.router.put_context(self.trajectory_id, turn, self.context.token_ids)

    async def _respond(self, turn: int, room: int) -> tuple[Completion, float]:
        """The next response; meanwhile the policy decides on the step before it (after asking which
        kind a checkpoint would take, `_next_kind`) and a decided checkpoint runs (first, when
        blocking); both are done when this returns.  What they added to the critical path (how long
        the next action waited after the response) is measured, not modelled."""
        step, self._pending = self._pending, None
        if step is not None and self.config.checkpoint_blocking:
            started = time.monotonic()
            await self._decide(step, None)
            self._record_wait(step.record, time.monotonic() - started)
            step = None
        async with anyio.create_task_group() as group:
            started = time.monotonic()
            if step is not None:
                group.start_soon(self._decide, step, started)
            completion = await self._generate(turn, room)
            responded = time.monotonic()
        if step is not None:
            self._record_wait(step.record, time.monotonic() - responded)  # the next action waited this long
        self.num_responses += 1
        self.num_resumed_responses += completion.num_resumes > 0
        return completion, responded - started

    async def _generate(self, turn: int, room: int) -> Completion:
        """Turn ``turn``'s response; under its own request id with ``config.request_ids``, which a
        router holding that turn already (same id, same context) answers from what it holds."""
        request_id = f"{self.trajectory_id}-t{turn}" if self.config.request_ids else None
        options = {
            "temperature": self.config.temperature, "top_p": self.config.top_p,
            "seed": derive_seed(self.config.seed, self.trajectory_id, turn),
            "stop_token_ids": self.config.stop_token_ids, "trajectory_id": self.trajectory_id, "turn": turn,
        }  # fmt: skip
        max_tokens = min(self.config.max_response_tokens, room)
        if request_id is not None and self.resume is not None and turn <= self.resume.last_turn:
            # A turn the killed run generated (its action is logged) that the router lost: the
            # request below generates it anew (one query per logged turn, on a resume only).
            self.num_turns_regenerated += not await self._router_holds(request_id)
        try:
            return await self.router.generate(
                self.context.token_ids, max_tokens, request_id=request_id, **options
            )
        except RouterClientError as error:
            if request_id is None or error.status != 409:
                raise
            self.num_turns_regenerated += self.resume is not None  # held with another context
            # The turn again with another context (after a recovery): a new request.
            return await self.router.generate(self.context.token_ids, max_tokens, **options)

    async def _router_holds(self, request_id: str) -> bool:
        try:
            await self.router.request_record(request_id)
        except RouterClientError as error:
            if error.status != 404:
                raise
            return False
        return True

    async def _decide(self, step: _Step, response_started: float | None) -> None:
        """The policy's decision on ``step``, ``x`` seconds into the response that overlaps it
        (``response_started``; None: blocking, before it), and the checkpoint it decides."""
        kind = await self._next_kind()
        if kind is not None:
            self._step_kinds[step.record.prefix] = kind
        elapsed = 0.0 if response_started is None else time.monotonic() - response_started
        decision = self.policy.decide(
            StepObservation(
                step.record.prefix, step.response_s, step.action_s, self._now(),
                response_elapsed_s=elapsed, checkpoint_kind=kind,
            )
        )  # fmt: skip
        if decision.checkpoint:
            await self._checkpoint(step.record)

    def _record_wait(self, pending: CheckpointRecord, waited_s: float) -> None:
        if self.checkpoints and self.checkpoints[-1].turn == pending.turn:
            self.checkpoints[-1] = attrs.evolve(self.checkpoints[-1], waited_s=waited_s)
        else:
            self.decide_waited_s += waited_s  # no checkpoint: the kind's query outlasted the response

    async def _checkpoint(self, pending: CheckpointRecord) -> None:
        sandbox = self.lease.sandbox
        previous = self.checkpoints[-1] if self.checkpoints else None
        try:
            record = await anyio.to_thread.run_sync(
                lambda: self.lease.pool.take_checkpoint(
                    sandbox,
                    trajectory=self.trajectory_id,
                    prefix=pending.prefix,
                    turn=pending.turn,
                    workdir=self.task.workdir,
                    context_hash=pending.context_hash,
                    previous=previous,
                )
            )
        except _FAILED:
            # The previous ready checkpoint stays in effect.  A dead sandbox is reported by the
            # next action (on_failure); a live one starts the policy's cooldown.
            self.num_checkpoint_failures += 1
            try:
                running = await anyio.to_thread.run_sync(sandbox.status) == "running"
            except _FAILED:
                running = False  # gone: the next action reports it
            if running:
                self.policy.on_checkpoint_timeout(self._now())
            return
        self.checkpoints.append(record)
        self._note(checkpoint_event(self.trajectory_id, record))
        if 0 < record.prefix <= len(self._steps):
            self._steps[record.prefix - 1][2] = record.duration_s
            self._step_kinds[record.prefix] = record.kind or "full"
        # The measured cost feeds the estimate of the kind envckpt took.
        self.policy.on_checkpoint_ready(record.duration_s, kind=record.kind or None)

    async def _read_state(self) -> str | environment.SandboxFailure | None:
        """What the task's ``state_probe`` reads in the sandbox at the end (None for a task without
        one): the reward compares it with what the agent saw.  A sandbox that cannot be read is
        a sandbox failure, recovered like any other."""
        assert isinstance(self.task, ToolUseTask)
        probe = self.task.state_probe
        if probe is None:
            return None
        sandbox = self.lease.sandbox
        for attempt in range(3):
            try:
                result = await anyio.to_thread.run_sync(
                    lambda: sandbox.probe(["/bin/sh", "-c", probe], workdir=self.task.workdir)
                )
            except _FAILED as error:
                return environment.SandboxFailure(f"the state could not be read: {error}")
            if not (result.ok and not result.stdout):
                break
            # exit 0 and nothing: docker-py can lose an exec's output on a loaded machine (the
            # probe is read-only, so it is asked again)
            await anyio.sleep(0.5 * (attempt + 1))
        if not result.ok and not await anyio.to_thread.run_sync(sandbox.is_running):
            return environment.SandboxFailure("container not running when its state was read")
        return result.stdout

    def _run_tests(self) -> environment.SandboxFailure | _TestResult:
        assert not isinstance(self.task, ToolUseTask)  # scored from its answer, without tests
        try:
            result = self.lease.sandbox.exec(self.task.test_command, timeout_s=self.config.test_timeout_s)
        except _FAILED as error:
            return environment.SandboxFailure(f"tests could not run: {error}")
        if self.lease.sandbox.status() != "running":
            return environment.SandboxFailure("container not running after the tests")
        return _TestResult(result.exit_code, result.stdout, result.stderr)

    # -- recovery --------------------------------------------------------------------------

    async def _recover(self, failure: environment.SandboxFailure) -> None:
        if len(self.recoveries) >= self.config.max_recoveries:
            raise UnrecoverableTrajectoryError(
                self.trajectory_id,
                f"more than {self.config.max_recoveries} sandbox failures (last: {failure.reason}); "
                "raise rollout.max_recoveries or lower the kill rate",
            )
        started = time.monotonic()
        self.policy.on_failure(self._now(), exposure_s=failure.action_s)
        self._pending = None
        failed_prefix, failed_turn = self.prefix, self.turn
        self._failed_steps.append(failed_prefix)  # the step being attempted (0-based)
        self._unspent_response_s = 0.0
        if self.config.sandbox_recovery == "image":
            await self._restart_without_state(failure, started)
            self._note(rewind_event(self.trajectory_id, self.turn))
            return
        if self.config.sandbox_recovery == "replay":
            await self._replay_actions(failure, started)
            self._note(rewind_event(self.trajectory_id, self.turn))
            return
        target, sandbox, timings, actual_hash = await self._restore_environment()
        lost = sorted(t for t in self._response_tokens if t > target.turn)
        tokens_lost = sum(self._response_tokens.pop(t) for t in lost)
        for t in lost:
            self._observations.pop(t, None)
        self.context.truncate(self._context_length(target))
        self._record_restore(
            failure.reason, started, target, sandbox, timings, actual_hash,
            failed=(failed_prefix, failed_turn), lost=(tokens_lost, len(lost)),
        )  # fmt: skip
        self.prefix, self.turn = target.prefix, target.turn
        del self._steps[target.prefix :]
        self._note(rewind_event(self.trajectory_id, self.turn))

    # -- resume (the journal of a killed trainer) --------------------------------------------

    def _note(self, event: dict[str, Any]) -> None:
        if self.note is not None:
            self.note(event)

    def _follow_journal(self, turn: int, action: actions.ParsedAction) -> LoggedAction | None:
        """The journal's action of ``turn`` while a resumed trajectory is not rebuilt yet, when the
        response asks for the command logged (None otherwise).  A response that asks for anything
        else (a turn the router generated anew) leaves the killed run's history at ``turn``: the
        journal is rewound to the turn before, in memory and in the log (`_diverge`)."""
        if self.resume is None or (logged := self.resume.actions.get(turn)) is None:
            return None
        if not isinstance(action, actions.BashAction) or action.command != logged.command:
            self._diverge(turn)
            return None
        self._from_journal.append(logged)
        return logged

    def _check_logged_context(self, logged: LoggedAction) -> None:
        """After a logged action's observation: the same command may follow another response (a
        regenerated turn with other tokens), so the context is compared with the one logged; when
        it differs, the killed run's later turns and checkpoints (tied to its context) no longer
        hold: the journal is rewound before this turn and the action logged again with ours."""
        if not logged.context_hash or logged.context_hash == self.context.digest():
            return
        self._diverge(logged.turn)
        result = logged.result()
        self._note(
            action_event(
                self.trajectory_id, logged.turn, logged.prefix, logged.command, result, self.context.digest()
            )
        )

    def _diverge(self, turn: int) -> None:
        """The resumed turn ``turn`` came back other than logged: a ``rewind`` to the turn before
        (so a second resume reads a journal of this trajectory as it runs now)."""
        assert self.resume is not None
        self.resume.rewind(turn - 1)
        self.num_turns_diverged += 1
        self._note(rewind_event(self.trajectory_id, turn - 1))

    async def _rebuild(self) -> environment.SandboxFailure | None:
        """Bring a resumed trajectory's sandbox to its last logged turn, once: the latest logged
        checkpoint that restores and verifies (`_restore_environment`: the repository hash and the
        router's ``L_turn``), then only the logged actions after it, run again in order (all of
        them in the fresh sandbox when no checkpoint is left).  A sandbox failure meanwhile (in a
        replayed action, or chaos after one) is recovered like any other: a restore again (the
        same rules: the newest checkpoint that restores, else a fresh sandbox) and the logged
        actions after it replayed, within ``max_recoveries``; each is a `RecoveryRecord` (no turn
        is lost: the context holds the logged results).  Nothing to do without a resume.

        A replayed action that returns other than the journal holds (an action whose effect
        differs when run again: a build id, a time) would leave the agent's context describing
        another sandbox than the one it goes on in.  The replay stops there and the rebuild
        returns it as a `SandboxFailure`, which the caller recovers like any other: the checkpoint
        the replay started from restored again (or a fresh sandbox and the prompt) and the
        context cut back to it, the turns after it generated again (the router answers those
        whose context is unchanged from its records)."""
        journal, self.resume = self.resume, None
        replay, self._from_journal = self._from_journal, []
        if journal is None or not replay:
            return None  # no committed action taken from the journal: the lease's fresh sandbox is the state
        last = replay[-1].turn
        records = journal.checkpoint_records(self.lease.pool.store.trajectory_dir(self.trajectory_id))
        self.checkpoints = [c for c in records if c.turn <= last]
        target, sandbox = self._base, self.lease.sandbox
        failed: tuple[environment.SandboxFailure, float] | None = None
        while True:
            if self.checkpoints or failed is not None:
                target, sandbox, timings, actual = await self._restore_environment()
                if failed is not None:
                    self._record_restore(  # no turn is lost: the logged results stay in the context
                        f"{failed[0].reason} (rebuilding the resumed sandbox)",
                        failed[1],
                        target,
                        sandbox,
                        timings,
                        actual,
                        failed=(self.prefix, self.turn),
                    )
            assert target is not None
            replayed, failure, diverged = await self._replay_logged(replay, target.turn, sandbox)
            # (a replay that diverges is rebuilt from ``target`` too: its recovery restores it again)
            self.restored_from_checkpoint = target.checkpoint is not None
            if diverged is not None:
                self.num_actions_replayed += replayed
                self.replay_consistent = False
                # `_restore_environment` kept ``target`` last in `checkpoints`: the caller's recovery
                # restores it again (not a second record of it).
                return environment.SandboxFailure(
                    f"the logged action of turn {diverged} returned other than logged when run again "
                    "to rebuild the resumed sandbox"
                )
            if failure is None:
                break
            if len(self.recoveries) >= self.config.max_recoveries:
                raise UnrecoverableTrajectoryError(
                    self.trajectory_id,
                    f"more than {self.config.max_recoveries} sandbox failures (last, rebuilding the "
                    f"resumed sandbox: {failure.reason}); raise rollout.max_recoveries or lower the kill rate",
                )
            self.policy.on_failure(self._now(), exposure_s=failure.action_s)
            self.num_rebuild_failures += 1
            failed = (failure, time.monotonic())
        self.num_actions_replayed += replayed
        self.replay_consistent &= sandbox.prefix == self.prefix
        return None

    async def _replay_logged(
        self, replay: list[LoggedAction], after_turn: int, sandbox: SandboxLike
    ) -> tuple[int, environment.SandboxFailure | None, int | None]:
        """Run the logged actions after ``after_turn`` again in ``sandbox`` (chaos may kill it after
        each, as after any action); how many ran, the sandbox failure that stopped them, and the
        turn of the first that returned other than logged (the replay stops there)."""
        replayed = 0
        for logged in replay:
            if logged.turn <= after_turn:
                continue
            again = await anyio.to_thread.run_sync(
                environment.run_action, sandbox, logged.command, self.config.action_timeout_s, self.injector
            )
            if isinstance(again, environment.SandboxFailure):
                return replayed, again, None
            replayed += 1
            if (again.exit_code, again.stdout, again.stderr) != (
                logged.exit_code,
                logged.stdout,
                logged.stderr,
            ):
                return replayed, None, logged.turn
        return replayed, None, None

    def _record_restore(
        self,
        reason: str,
        started: float,
        target: CheckpointRecord,
        sandbox: SandboxLike,
        timings: dict[str, float],
        actual_hash: str,
        *,
        failed: tuple[int, int],
        lost: tuple[int, int] = (0, 0),
    ) -> None:
        """A recovery restored at ``target`` (verified by `_restore_environment`): its measured
        cost to the policy and its `RecoveryRecord` (``failed``: the prefix and turn that failed;
        ``lost``: the tokens and rounds generated again)."""
        restore_s = time.monotonic() - started
        self.policy.on_restore(restore_s)  # the measured restore cost feeds the estimators
        self.recoveries.append(
            RecoveryRecord(
                failed_prefix=failed[0],
                failed_turn=failed[1],
                reason=reason,
                restored_prefix=target.prefix,
                restored_turn=target.turn,
                from_checkpoint=target.checkpoint is not None,
                restore_s=restore_s,
                tokens_regenerated=lost[0],
                rounds_regenerated=lost[1],
                expected_repo_hash=target.repo_hash,
                actual_repo_hash=actual_hash,
                context_matches=True,  # verified by `_restore_environment`
                prefix_matches=sandbox.prefix == target.prefix
                and (target.checkpoint is None or sandbox.context_ref == target.context_ref),
                restore_timings_ms=timings,
                restored_kind=target.kind,
            )
        )

    async def _restart_without_state(self, failure: environment.SandboxFailure, started: float) -> None:
        """The control without recovery: a fresh sandbox from the image, the context kept but for
        the failed turn, so the agent goes on believing in the state the old sandbox held."""
        failed_prefix, failed_turn = self.prefix, self.turn
        sandbox = await self.lease.restart()
        sandbox.prefix = self.prefix  # the agent's count of committed actions goes on
        self.context.truncate(self._round_start)
        tokens_lost = self._response_tokens.pop(failed_turn, 0)
        self._observations.pop(failed_turn, None)
        self.turn = failed_turn - 1
        actual_hash = await anyio.to_thread.run_sync(environment.repository_hash, sandbox, self.task.workdir)
        restore_s = time.monotonic() - started
        self.recoveries.append(
            RecoveryRecord(
                failed_prefix=failed_prefix,
                failed_turn=failed_turn,
                reason=failure.reason,
                restored_prefix=self.prefix,
                restored_turn=self.turn,
                from_checkpoint=False,
                restore_s=restore_s,
                tokens_regenerated=tokens_lost,
                rounds_regenerated=1,
                expected_repo_hash=self._base.repo_hash if self._base and self.prefix == 0 else "",
                actual_repo_hash=actual_hash,
                context_matches=True,
                prefix_matches=self.prefix == 0,  # a fresh sandbox holds the state of prefix 0 only
            )
        )

    async def _replay_actions(self, failure: environment.SandboxFailure, started: float) -> None:
        """The baseline of a harness without Belayer: a fresh sandbox from the image, every committed
        action run again verbatim, the context kept but for the failed turn.  The recovery is
        consistent only when every replayed action returned what the agent saw the first time
        (``context_matches``); an effect that differs on re-execution (a build id, a time) breaks
        it, silently for the agent."""
        failed_prefix, failed_turn = self.prefix, self.turn
        sandbox = await self.lease.restart()
        self._observations.pop(failed_turn, None)
        same = True
        for turn in sorted(self._observations):
            seen = self._observations[turn]
            again = await anyio.to_thread.run_sync(
                lambda: sandbox.exec(seen.command, timeout_s=self.config.action_timeout_s)  # noqa: B023
            )
            same = same and (again.exit_code, again.stdout + again.stderr) == (seen.exit_code, seen.output)
        self.context.truncate(self._round_start)
        tokens_lost = self._response_tokens.pop(failed_turn, 0)
        self.turn = failed_turn - 1
        self.prefix = sandbox.prefix
        del self._steps[self.prefix :]
        actual_hash = await anyio.to_thread.run_sync(environment.repository_hash, sandbox, self.task.workdir)
        self.recoveries.append(
            RecoveryRecord(
                failed_prefix=failed_prefix,
                failed_turn=failed_turn,
                reason=failure.reason,
                restored_prefix=self.prefix,
                restored_turn=self.turn,
                from_checkpoint=False,
                restore_s=time.monotonic() - started,
                tokens_regenerated=tokens_lost,
                rounds_regenerated=1,
                expected_repo_hash=actual_hash,  # no hash of the lost state: the outputs are compared
                actual_repo_hash=actual_hash,
                context_matches=same,
                prefix_matches=True,
                replayed=True,
            )
        )

    async def _restore_environment(self) -> tuple[CheckpointRecord, SandboxLike, dict[str, float], str]:
        """Restore the newest ready checkpoint that restores and verifies (its repository hashes to
        what it recorded, the router's ``L_turn`` is the context it was taken with); each one
        that does not is given up for the one before it (a fallback).  With none left, start
        afresh from the image and the prompt (tried twice).  Returns the checkpoint (the base
        record for a fresh start), the sandbox, the restore's timings and the repository hash.

        Which failures refuse the fresh start, per cause and whatever the order they come in: a
        context mismatch (the router's ``L_turn`` is not what the checkpoint was taken with) is
        sticky: the trajectory is unrecoverable unless an earlier checkpoint restores and
        verifies (the router's context can no longer be trusted for a replay from the prompt).
        A checkpoint that does not restore, or whose repository does not hash to what it
        recorded, only falls back: with none left, the sandbox starts afresh from the image.
        """
        pool = self.lease.pool
        unverified = ""  # the newest context mismatch: sticky (see above)
        while self.checkpoints:
            record = self.checkpoints.pop()
            assert record.checkpoint is not None
            checkpoint, current = record.checkpoint, self.lease.sandbox
            try:
                sandbox = await anyio.to_thread.run_sync(
                    lambda: pool.restore(checkpoint, current)  # noqa: B023  (awaited at once)
                )
                await self.lease.replace(sandbox)
                actual = await anyio.to_thread.run_sync(
                    environment.repository_hash, sandbox, self.task.workdir
                )
            except _FAILED:
                self.num_checkpoint_fallbacks += 1  # corrupt or unreadable: the one before it
                continue
            problem, context_mismatch = await self._verify(record, actual)
            if problem:
                self.num_checkpoint_fallbacks += 1
                if context_mismatch and not unverified:
                    unverified = f"the checkpoint of prefix {record.prefix} fails verification ({problem})"
                continue
            self.checkpoints.append(record)
            return record, sandbox, dict(sandbox.restore_timings_ms), actual
        if unverified:
            raise UnrecoverableTrajectoryError(self.trajectory_id, f"{unverified} and no earlier one is left")
        assert self._base is not None
        for attempt in range(2):
            try:
                sandbox = await self.lease.restart()
                actual = await anyio.to_thread.run_sync(
                    environment.repository_hash, sandbox, self.task.workdir
                )
            except _FAILED as error:
                if attempt == 1:
                    raise UnrecoverableTrajectoryError(
                        self.trajectory_id, f"a fresh sandbox failed twice: {describe_error(error)}"
                    ) from error
                continue
            return self._base, sandbox, {}, actual
        raise AssertionError("unreachable")  # pragma: no cover

    async def _verify(self, record: CheckpointRecord, actual_hash: str) -> tuple[str, bool]:
        """What is wrong with a restored ``record`` ("" if nothing): its repository, its context;
        and whether it is the context (the router's ``L_turn``)."""
        if actual_hash != record.repo_hash:
            return f"repository hash {actual_hash[:12]} != recorded {record.repo_hash[:12]}", False
        turn, token_ids = await self.router.get_context(self.trajectory_id, record.turn)
        if (
            turn != record.turn
            or context_digest(token_ids) != record.context_hash
            or token_ids != self.context.token_ids[: len(token_ids)]
        ):
            return f"the router's L_{record.turn} is not the context the checkpoint was taken with", True
        self._verified_length = len(token_ids)
        return "", False

    def _context_length(self, target: CheckpointRecord) -> int:
        """The context's length at ``target`` (the prompt's for a fresh start)."""
        if target.checkpoint is None:
            return self.context.num_prompt_tokens
        return self._verified_length

    def _finish(self, finish: str, reward: float, exit_code: int, output: str) -> AgenticTrajectory:
        return AgenticTrajectory(
            trajectory_id=self.trajectory_id,
            task_id=self.task.instance_id,
            group_index=self.group_index,
            sample_index=self.sample_index,
            token_ids=list(self.context.token_ids),
            loss_mask=[int(g) for g in self.context.generated],
            logprobs=list(self.context.logprobs),
            num_prompt_tokens=self.context.num_prompt_tokens,
            reward=reward,
            finish=finish,
            rounds=self.turn,
            num_actions=self.prefix,
            num_responses=self.num_responses,
            test_exit_code=exit_code,
            test_output=output[-2000:],
            policy=self.policy.name,
            wall_s=self._now(),
            checkpoints=list(self.checkpoints),
            recoveries=list(self.recoveries),
            num_checkpoint_failures=self.num_checkpoint_failures,
            num_resumed_responses=self.num_resumed_responses,
            num_checkpoint_fallbacks=self.num_checkpoint_fallbacks,
            kind_query_s=self.kind_query_s,
            decide_waited_s=self.decide_waited_s,
            step_response_s=[float(step[0] or 0.0) for step in self._steps],
            step_action_s=[float(step[1] or 0.0) for step in self._steps],
            step_checkpoint_s=[step[2] for step in self._steps],
            step_checkpoint_kind=[self._step_kinds.get(i + 1) for i in range(len(self._steps))],
            failed_steps=list(self._failed_steps),
        )


@attrs.frozen
class _Step:
    """A committed step awaiting its decision: the checkpoint it would be, and its durations."""

    record: CheckpointRecord
    response_s: float
    action_s: float


@attrs.frozen
class _TestResult:
    exit_code: int
    stdout: str
    stderr: str
