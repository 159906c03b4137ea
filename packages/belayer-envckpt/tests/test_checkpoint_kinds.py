"""Checkpoint kinds against the real engine and CRIU: which kind each change gives, and that the
restore of each gives back exactly the state of its prefix."""

from __future__ import annotations

import os
import time

import pytest
from conftest import BUSYBOX, DEBIAN

from belayer_envckpt import (
    CheckpointFault,
    CheckpointKind,
    CheckpointStore,
    CrashPoint,
    FaultAction,
    InjectedCrash,
    Sandbox,
    UncapturedProcessError,
    checkpoint,
    full_checkpoint,
    full_restore,
    next_checkpoint_kind,
)

# A process that keeps changing its memory: a counter it only writes to a file when asked (SIGUSR1).
COUNTER = (
    "import os, signal, time\n"
    "open('/tmp/pid', 'w').write(str(os.getpid()))\n"
    "n = 0\n"
    "def dump(*_):\n"
    "    open('/tmp/count', 'w').write(str(n))\n"
    "signal.signal(signal.SIGUSR1, dump)\n"
    "while True:\n"
    "    n += 1\n"
    "    time.sleep(0.01)\n"
)


def processes(sandbox: Sandbox) -> list[str]:
    """Command lines of the sandbox's processes, without the probe's own."""
    out = sandbox.probe(
        "for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline; echo; done 2>/dev/null", timeout_s=30
    ).stdout
    return sorted(line.strip() for line in out.splitlines() if line.strip() and "/proc/[0-9]" not in line)


def kill_matching(text: str) -> str:
    """A shell command that kills the sandbox's processes whose command line holds ``text``."""
    return (
        f"for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline 2>/dev/null | grep -q '^{text}' "
        "&& kill ${p#/proc/}; done; sleep 0.2"
    )


def state(sandbox: Sandbox) -> tuple[str, list[str]]:
    """What the tests compare: the files under /work and the processes."""
    files = sandbox.probe('cd /work && for f in *; do echo "$f=$(cat $f)"; done', timeout_s=30).stdout
    return files, processes(sandbox)


@pytest.fixture
def store(tmp_path):
    return CheckpointStore(tmp_path / "store")


def test_a_sandbox_running_only_its_init_gets_a_fresh_runtime_checkpoint(make_sandbox, track, engine, store):
    sandbox = make_sandbox(BUSYBOX, "fresh")
    sandbox.exec("mkdir -p /work && echo one > /work/a && rm /bin/cal")  # a file of the image deleted
    assert next_checkpoint_kind(sandbox, store, "fresh") is CheckpointKind.FRESH_RUNTIME
    before = state(sandbox)
    ckpt = checkpoint(sandbox, "fresh", context_ref="ctx/1", store=store)
    assert (ckpt.kind, ckpt.runtime, ckpt.artifacts_of) == ("fresh-runtime", "fresh", "")
    assert sorted(ckpt.files) == ["layer.tar"]  # no CRIU images
    assert not (ckpt.path / "criu").exists()
    assert '"kind": "fresh-runtime"' in (ckpt.path / "manifest.json").read_text()
    assert ckpt.timings_ms["freeze_ms"] == 0
    assert store.verify(ckpt) == ckpt

    sandbox.kill()
    restored = track(full_restore(store.latest_ready("fresh"), engine=engine))
    assert (restored.prefix, restored.context_ref) == (1, "ctx/1")
    assert state(restored) == before
    assert restored.probe("test -e /bin/cal || echo deleted").stdout == "deleted\n"
    assert "start_ms" in restored.restore_timings_ms


def test_each_change_gives_a_real_checkpoint_and_no_change_a_reference(make_sandbox, track, engine, store):
    sandbox = make_sandbox(BUSYBOX, "changes")
    taken = []

    def step(command: str) -> str:
        if command:
            sandbox.exec(command)
        predicted = next_checkpoint_kind(sandbox, store, "changes")
        ckpt = checkpoint(sandbox, "changes", store=store)
        assert ckpt.kind == predicted
        taken.append((ckpt, state(sandbox)))
        return ckpt.kind

    assert step("mkdir -p /work && echo 1 > /work/a") == "fresh-runtime"
    assert step("") == "reference"  # nothing ran
    assert step("cat /work/a >/dev/null; ls /") == "reference"  # an action that only reads
    assert step("echo 2 > /work/a") == "fresh-runtime"  # a file written
    assert step("echo 2 > /work/b; rm /work/b") == "fresh-runtime"  # created and deleted again
    assert step("rm /work/a") == "fresh-runtime"  # a file deleted
    assert step("chmod 700 /work") == "fresh-runtime"  # only metadata
    assert step("sleep 300 >/dev/null 2>&1 &") == "full"  # a background process
    assert step("") == "full"  # it still runs: never a reference to a CRIU checkpoint
    assert step(kill_matching("sleep 300")) == "fresh-runtime"  # the init alone again
    assert step("echo x > /dev/shm/left") == "full"  # state outside the layer, held by no process

    # The references share their owner's artifacts (hard links), and gc keeps them.
    references = [(c, s) for c, s in taken if c.kind == "reference"]
    assert len(references) >= 2
    for ref, _ in references:
        owner = ref.path.parent / ref.artifacts_of
        assert os.stat(ref.path / "layer.tar").st_ino == os.stat(owner / "layer.tar").st_ino
    store.gc("changes", keep=len(taken) - 1)  # the first (fresh-runtime) checkpoint goes
    assert not taken[0][0].path.exists()
    assert store.verify(taken[1][0].path).artifacts_of == taken[0][0].checkpoint_id

    # Each restore gives back exactly the state of its prefix.
    for ckpt, expected in taken[1:]:
        restored = track(full_restore(store.verify(ckpt.path), engine=engine, remove_failed=False))
        assert state(restored) == expected, ckpt.kind
        assert restored.prefix == ckpt.prefix
        restored.remove()


def test_a_running_process_that_changed_its_memory_gives_a_full_checkpoint(
    make_sandbox, track, engine, store
):
    sandbox = make_sandbox(DEBIAN, "memory")
    sandbox.exec(["python3", "-c", f"open('/counter.py', 'w').write({COUNTER!r})"])
    sandbox.exec("python3 /counter.py >/dev/null 2>&1 & sleep 0.5")
    first = checkpoint(sandbox, "memory", store=store)
    assert first.kind == "full"
    sandbox.exec("sleep 0.3")  # the counter ran on
    second = checkpoint(sandbox, "memory", store=store)
    assert second.kind == "full"
    assert second.artifacts_of == ""
    sandbox.kill()
    counts = []
    for ckpt in (first, second):
        restored = track(full_restore(ckpt, engine=engine, remove_failed=False))
        restored.exec("kill -USR1 $(cat /tmp/pid); sleep 0.5")
        counts.append(int(restored.probe("cat /tmp/count").stdout))
        restored.remove()
    assert counts[0] < counts[1]  # each restore resumed its own counter


def test_a_message_left_in_a_pipe_gives_a_full_checkpoint_that_keeps_it(make_sandbox, track, engine, store):
    sandbox = make_sandbox(BUSYBOX, "pipe")
    # A process holds the FIFO open (read and write) without reading: bytes written stay queued.
    sandbox.exec("mkfifo /p && (exec 3<>/p; sleep 600) >/dev/null 2>&1 &")
    assert checkpoint(sandbox, "pipe", store=store).kind == "full"
    sandbox.exec("echo message > /p")
    ckpt = checkpoint(sandbox, "pipe", store=store)
    assert ckpt.kind == "full"
    sandbox.kill()
    restored = track(full_restore(ckpt, engine=engine))
    assert restored.exec("dd if=/p bs=8 count=1 2>/dev/null", timeout_s=20).stdout == "message\n"


def test_a_process_outside_the_init_tree_is_refused_not_lost(make_sandbox, track, engine, store):
    sandbox = make_sandbox(BUSYBOX, "outside")
    sandbox.exec("echo kept > /kept")
    ready = checkpoint(sandbox, "outside", store=store)
    # As `docker exec -d` does: the process's parent is the engine's shim, outside the container.
    engine._client.api.exec_start(engine._client.api.exec_create(sandbox.id, ["sleep", "613"]), detach=True)
    # A detached exec returns before runc has exec'd the command (it shows as `runc init` meanwhile).
    deadline = time.monotonic() + 30
    while not any(p.startswith("sleep 613") for p in processes(sandbox)):
        assert time.monotonic() < deadline, processes(sandbox)
        time.sleep(0.05)
    for take in (checkpoint, full_checkpoint):
        with pytest.raises(UncapturedProcessError, match="sleep 613") as raised:
            take(sandbox, "outside", store=store)
        assert any("sleep 613" in p for p in raised.value.processes)
    assert store.latest_ready("outside") == ready
    assert store.leftovers("outside") == []
    assert sandbox.status() == "running"

    # The same process started under the init (a background job of an action) is captured.
    sandbox.exec(kill_matching("sleep 613") + "; sleep 614 >/dev/null 2>&1 &")
    ckpt = checkpoint(sandbox, "outside", store=store)
    assert ckpt.kind == "full"
    sandbox.kill()
    restored = track(full_restore(ckpt, engine=engine))
    assert "sleep 614" in processes(restored)


def test_a_crash_before_publishing_a_cheap_checkpoint_leaves_the_previous_one(make_sandbox, store):
    sandbox = make_sandbox(BUSYBOX, "crash")
    sandbox.exec("echo 1 > /one")
    first = checkpoint(sandbox, "crash", store=store)
    assert next_checkpoint_kind(sandbox, store, "crash") is CheckpointKind.REFERENCE
    crash = CheckpointFault(CrashPoint.BEFORE_PUBLISH, FaultAction.CRASH)
    with pytest.raises(InjectedCrash):  # a reference, before its rename
        checkpoint(sandbox, "crash", store=store, fault=crash)
    assert store.latest_ready("crash") == first
    for point in (CrashPoint.AFTER_LAYER, CrashPoint.BEFORE_PUBLISH):
        sandbox.exec(f"echo {point} > /one")
        assert next_checkpoint_kind(sandbox, store, "crash") is CheckpointKind.FRESH_RUNTIME
        with pytest.raises(InjectedCrash):
            checkpoint(sandbox, "crash", store=store, fault=CheckpointFault(point, FaultAction.CRASH))
        assert store.latest_ready("crash") == first
    assert len(store.gc()) == 3  # the partial directories, found by gc as a crash leaves them
    assert checkpoint(sandbox, "crash", store=store).kind == "fresh-runtime"


def test_a_command_that_is_not_a_stateless_init_always_gets_full_checkpoints(make_sandbox, store):
    sandbox = make_sandbox(BUSYBOX, "busy", command=("sh", "-c", "while :; do sleep 1; done"))
    assert checkpoint(sandbox, "busy", store=store).kind == "full"
    assert checkpoint(sandbox, "busy", store=store).kind == "full"
    sleeper = make_sandbox(BUSYBOX, "sleeper", command=("sleep", "100000"))
    assert checkpoint(sleeper, "sleeper", store=store).kind == "fresh-runtime"
    assert checkpoint(sleeper, "sleeper", store=store).kind == "reference"
