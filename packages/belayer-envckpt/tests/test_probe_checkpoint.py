"""`probe_then_checkpoint` (one quiescent state read and checkpointed under one action boundary)
and the `SandboxLike` protocol, on the real engine and CRIU."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from belayer_envckpt import (
    CheckpointStore,
    InvalidConfigError,
    ProbeFailedError,
    Sandbox,
    SandboxLike,
    full_restore,
    probe_then_checkpoint,
)

COUNT = "n=$(cat /tmp/tries 2>/dev/null || echo 0); n=$((n+1)); echo $n > /tmp/tries"


def test_an_answer_not_accepted_is_asked_again_and_the_checkpoint_holds_the_probed_state(
    make_sandbox: Callable[..., Sandbox], track: Callable[[Sandbox], Sandbox], tmp_path: Path
) -> None:
    sandbox = make_sandbox()
    sandbox.exec("echo 41 > /tmp/value")
    store = CheckpointStore(tmp_path / "store")
    # The probe counts its tries in the container (a probe is not an action: the prefix stays);
    # the first two answers are refused, the third accepted.
    probe = f"{COUNT}; cat /tmp/tries"
    result, checkpoint = probe_then_checkpoint(
        sandbox, "t", probe, store=store, context_ref="ctx/1",
        accept=lambda r: r.ok and r.stdout.strip() == "3", retry_pause_s=0.0,
    )  # fmt: skip
    assert result.stdout.strip() == "3"
    assert (checkpoint.prefix, checkpoint.context_ref) == (1, "ctx/1")
    assert sandbox.prefix == 1
    assert store.latest_ready("t") == checkpoint
    restored = track(full_restore(checkpoint))
    assert restored.probe("cat /tmp/tries /tmp/value").stdout.split() == ["3", "41"]


def test_no_accepted_answer_checkpoints_nothing(make_sandbox: Callable[..., Sandbox], tmp_path: Path) -> None:
    sandbox = make_sandbox()
    store = CheckpointStore(tmp_path / "store")
    with pytest.raises(ProbeFailedError, match="no accepted answer in 2 tries") as caught:
        probe_then_checkpoint(
            sandbox, "t", ["/bin/sh", "-c", f"{COUNT}; exit 3"], store=store, attempts=2, retry_pause_s=0.0
        )
    assert caught.value.result.exit_code == 3
    assert sandbox.probe("cat /tmp/tries").stdout.strip() == "2"
    assert store.latest_ready("t") is None


def test_bad_tries_are_refused_before_the_sandbox_is_touched(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "store")
    untouched = _Untouched()
    with pytest.raises(InvalidConfigError, match="attempts must be >= 1"):
        probe_then_checkpoint(untouched, "t", "true", store=store, attempts=0)  # type: ignore[arg-type]
    with pytest.raises(InvalidConfigError, match="retry_pause_s must be >= 0"):
        probe_then_checkpoint(untouched, "t", "true", store=store, retry_pause_s=-1)  # type: ignore[arg-type]


def test_a_sandbox_is_sandbox_like(make_sandbox: Callable[..., Sandbox]) -> None:
    sandbox = make_sandbox()
    assert isinstance(sandbox, SandboxLike)
    like: SandboxLike = sandbox
    assert like.exec("true").ok
    assert like.status() == "running"
    assert not isinstance(object(), SandboxLike)


class _Untouched:
    """Fails the test if `probe_then_checkpoint` uses the sandbox at all."""

    def __getattr__(self, name: str) -> object:
        raise AssertionError(f"the sandbox was used ({name}) before the arguments were checked")
