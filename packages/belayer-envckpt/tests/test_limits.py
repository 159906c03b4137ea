"""Limits and privileges on real containers: each test first shows the limit in force, then pushes it."""

from __future__ import annotations

import io
import subprocess
import tarfile
import threading
from pathlib import Path

import attrs
import pytest
from conftest import BUSYBOX, DEBIAN, TEST_LABELS, wait_for

from belayer_envckpt import (
    CheckpointFailedError,
    CheckpointStore,
    CheckpointTooLargeError,
    ExecResult,
    InvalidConfigError,
    LimitCause,
    OutsideGuaranteeError,
    Sandbox,
    SandboxLimitError,
    SandboxLimits,
    full_checkpoint,
    full_restore,
)

MIB = 1024 * 1024
SMALL = SandboxLimits(pids=48, memory_mb=96, cpus=0.5, disk_mb=16)
# The engine-side settings a restore must reproduce exactly.
HOST_FIELDS = (
    "PidsLimit",
    "Memory",
    "MemorySwap",
    "NanoCpus",
    "CapAdd",
    "CapDrop",
    "SecurityOpt",
    "Privileged",
)
SETUID_CAT = (
    "cp /bin/cat /tmp/cat && chmod u+s /tmp/cat && echo secret > /tmp/secret && chmod 600 /tmp/secret"
)
CAP_BITS = {"CHOWN": 0, "DAC_OVERRIDE": 1, "FOWNER": 3, "FSETID": 4, "KILL": 5, "SETGID": 6, "SETUID": 7}


def cgroup_dir(sandbox: Sandbox, controller: str) -> Path:
    pid = sandbox.inspect()["State"]["Pid"]
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, names, path = line.split(":", 2)
        if controller in names.split(","):
            return Path("/sys/fs/cgroup") / controller / path.lstrip("/")
    raise AssertionError(f"no {controller} cgroup for {sandbox.id[:12]}")


def cgroup_value(sandbox: Sandbox, controller: str, name: str) -> str:
    return (cgroup_dir(sandbox, controller) / name).read_text().strip()


def in_force(sandbox: Sandbox) -> dict[str, object]:
    """What the engine and the kernel apply to ``sandbox``, read from the outside and the inside."""
    info = sandbox.inspect()
    status = dict(
        line.split(":\t", 1)
        for line in sandbox.probe("cat /proc/1/status").stdout.splitlines()
        if ":\t" in line
    )
    return {
        "host": {field: info["HostConfig"].get(field) for field in HOST_FIELDS},
        "user": info["Config"].get("User"),
        "pids.max": cgroup_value(sandbox, "pids", "pids.max"),
        "memory": cgroup_value(sandbox, "memory", "memory.limit_in_bytes"),
        "memory+swap": cgroup_value(sandbox, "memory", "memory.memsw.limit_in_bytes"),
        "cfs": (
            cgroup_value(sandbox, "cpu", "cpu.cfs_quota_us"),
            cgroup_value(sandbox, "cpu", "cpu.cfs_period_us"),
        ),
        "caps": (status["CapEff"].strip(), status["CapBnd"].strip()),
        "no_new_privs": status["NoNewPrivs"].strip(),
        "seccomp": status["Seccomp"].strip(),
    }


def assert_small_limits(seen: dict[str, object]) -> None:
    mask = f"{sum(1 << bit for bit in CAP_BITS.values()):016x}"
    assert seen["pids.max"] == "48"
    assert seen["memory"] == seen["memory+swap"] == str(96 * MIB)  # no swap on top of the memory
    cfs = seen["cfs"]
    assert isinstance(cfs, tuple)
    quota, period = cfs
    assert int(quota) / int(period) == 0.5
    assert seen["caps"] == (mask, mask)
    assert seen["no_new_privs"] == "1"
    assert seen["seccomp"] == "2"  # the engine's default seccomp filter is in place


def test_limits_validate_and_round_trip():
    limits = SandboxLimits(pids=10, capabilities=["cap_chown", "kill"])
    assert limits.capabilities == ("CHOWN", "KILL")
    assert SandboxLimits.from_dict(limits.to_dict()) == limits
    assert SandboxLimits().checkpoint_cap_mb == 2048 + 2048 + 256
    for bad in ({"pids": -1}, {"memory_mb": -5}, {"capabilities": ["SYS_ADMIN"]}, {"disk_poll_s": 0}):
        with pytest.raises(InvalidConfigError):
            SandboxLimits(**bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidConfigError, match="unknown keys"):
        SandboxLimits.from_dict({"pids": 1, "swap": True})


def test_defaults_apply_to_every_sandbox(make_sandbox):
    sandbox = make_sandbox(BUSYBOX, "defaults")
    assert sandbox.enforced_limits() == SandboxLimits().engine_view()
    seen = in_force(sandbox)
    assert seen["pids.max"] == "512"
    assert seen["memory"] == seen["memory+swap"] == str(2048 * MIB)


def test_throwaway_containers_get_the_engine_enforced_limits(engine):
    probe = "cat /sys/fs/cgroup/pids/pids.max; grep -E '^(CapEff|NoNewPrivs)' /proc/self/status"
    out = engine.run(BUSYBOX, ["sh", "-c", probe], labels=TEST_LABELS, limits=SMALL).stdout.split()
    mask = f"{sum(1 << bit for bit in CAP_BITS.values()):016x}"
    assert out == ["48", "CapEff:", mask, "NoNewPrivs:", "1"]


def test_restore_keeps_every_limit(make_sandbox, track, engine, tmp_path):
    sandbox = make_sandbox(BUSYBOX, "keep", limits=SMALL)
    before = in_force(sandbox)
    assert_small_limits(before)
    assert sandbox.enforced_limits() == SMALL.engine_view()
    ckpt = full_checkpoint(sandbox, "keep", store=CheckpointStore(tmp_path))
    sandbox.kill()
    restored = track(full_restore(ckpt, engine=engine))
    assert restored.config.limits == SMALL
    assert in_force(restored) == before  # docker inspect, cgroup files and the process's own view


def test_fork_bomb_hits_the_pids_limit(make_sandbox, track, engine, tmp_path):
    sandbox = make_sandbox(BUSYBOX, "bomb", limits=SMALL)
    neighbour = make_sandbox(BUSYBOX, "neighbour", limits=SMALL)
    assert cgroup_value(sandbox, "pids", "pids.max") == "48"
    sandbox.exec("echo before > /tmp/marker")
    store = CheckpointStore(tmp_path)
    ready = full_checkpoint(sandbox, "bomb", store=store)
    # Bounded: 200 forks, far past the limit; then spin (builtins only) until the host says stop.
    bomb = (
        "i=0; while [ $i -lt 200 ]; do sleep 600 >/dev/null 2>&1 & i=$((i+1)); done; "
        "while [ ! -e /tmp/stop ]; do :; done"
    )
    raised: list[BaseException] = []

    def run_bomb() -> None:
        try:
            sandbox.exec(bomb, timeout_s=120)
        except BaseException as exc:
            raised.append(exc)

    worker = threading.Thread(target=run_bomb)
    worker.start()
    try:
        wait_for(lambda: int(cgroup_value(sandbox, "pids", "pids.events").split()[1]) > 0, timeout=120)
        assert int(cgroup_value(sandbox, "pids", "pids.current")) <= 48
        # The host and the other sandbox still start processes while the bomb sits at its limit.
        assert subprocess.run(["true"], timeout=60).returncode == 0
        assert neighbour.exec("echo alive").stdout == "alive\n"
    finally:
        _put_file(sandbox, "/tmp/stop")
        worker.join(180)
    assert len(raised) == 1, raised
    assert isinstance(raised[0], SandboxLimitError), raised
    assert raised[0].cause is LimitCause.PIDS
    assert "pids limit of 48" in str(raised[0])
    # The bomb's processes were killed (and, once reaped, released from the pids count).
    wait_for(lambda: int(cgroup_value(sandbox, "pids", "pids.current")) < 5, timeout=60)
    restored = track(full_restore(store.latest_ready("bomb"), engine=engine))
    assert restored.prefix == ready.prefix
    assert restored.exec("cat /tmp/marker").stdout == "before\n"
    assert cgroup_value(restored, "pids", "pids.max") == "48"


def test_memory_hog_is_oom_killed_inside_only(make_sandbox, track, engine, tmp_path):
    sandbox = make_sandbox(DEBIAN, "hog", limits=SMALL)
    neighbour = make_sandbox(BUSYBOX, "hog-neighbour", limits=SMALL)
    assert cgroup_value(sandbox, "memory", "memory.memsw.limit_in_bytes") == str(96 * MIB)
    sandbox.exec("echo before > /tmp/marker")
    store = CheckpointStore(tmp_path)
    full_checkpoint(sandbox, "hog", store=store)
    with pytest.raises(SandboxLimitError, match="memory limit of 96 MB") as caught:
        sandbox.exec(["python3", "-c", "b = b'x' * (400 * 2**20); print('survived')"])
    assert caught.value.cause is LimitCause.MEMORY
    assert isinstance(caught.value.result, ExecResult)
    assert "survived" not in caught.value.result.stdout
    assert sandbox.exec("echo next").stdout == "next\n"  # reported once, not again
    # A hog a previous action left in the background is reported by the next action.
    sandbox.exec("(sleep 0.5; python3 -c \"b = b'x' * (400 * 2**20)\") >/dev/null 2>&1 &")
    wait_for(lambda: "oom_kill 2" in cgroup_value(sandbox, "memory", "memory.oom_control"), timeout=120)
    with pytest.raises(SandboxLimitError, match="OOM killer") as caught_later:
        sandbox.exec("true")
    assert caught_later.value.cause is LimitCause.MEMORY
    # Only the hog died: the sandbox's own init runs on, and nothing outside it saw an OOM kill.
    assert sandbox.is_running()
    assert "oom_kill 0" in cgroup_value(neighbour, "memory", "memory.oom_control")
    assert neighbour.exec("echo alive").stdout == "alive\n"
    restored = track(full_restore(store.latest_ready("hog"), engine=engine))
    assert restored.exec("cat /tmp/marker").stdout == "before\n"
    assert "oom_kill 0" in cgroup_value(restored, "memory", "memory.oom_control")


def test_an_init_killed_by_the_oom_killer_is_a_limit_failure(make_sandbox, track, engine, tmp_path):
    # The init waits for /tmp/go, then becomes the hog itself: the whole sandbox goes down.
    hog = "while [ ! -e /tmp/go ]; do sleep 0.1; done; exec python3 -c \"b = b'x' * (400 * 2**20)\""
    sandbox = make_sandbox(DEBIAN, "init-hog", command=("/bin/sh", "-c", hog), limits=SMALL)
    assert sandbox.enforced_limits()["memory_mb"] == 96
    store = CheckpointStore(tmp_path)
    ready = full_checkpoint(sandbox, "init-hog", store=store)
    assert sandbox.limit_failure() is None
    sandbox.exec("touch /tmp/go")
    wait_for(lambda: not sandbox.is_running(), timeout=120)
    assert sandbox.limit_failure() is LimitCause.MEMORY
    with pytest.raises(SandboxLimitError, match="killed its init") as caught:
        sandbox.exec("true")
    assert caught.value.cause is LimitCause.MEMORY
    restored = track(full_restore(ready, engine=engine))  # back to the init still waiting
    assert restored.is_running()
    assert restored.limit_failure() is None
    assert restored.exec("test -e /tmp/go || echo waiting").stdout == "waiting\n"


def test_disk_filler_stops_at_the_cap(make_sandbox, track, engine, tmp_path):
    sandbox = make_sandbox(BUSYBOX, "filler", limits=SMALL)
    assert sandbox.config.limits.disk_mb == 16
    sandbox.exec("echo before > /tmp/marker")
    store = CheckpointStore(tmp_path)
    ready = full_checkpoint(sandbox, "filler", store=store)
    manifest = (ready.path / "manifest.json").read_bytes()
    # Never ends on its own: only the disk cap (or the 120 s timeout) stops it.
    filler = "while :; do dd if=/dev/zero bs=1048576 count=1 2>/dev/null >> /tmp/fill; done"
    with pytest.raises(SandboxLimitError, match="over its disk cap of 16 MB") as caught:
        sandbox.exec(filler, timeout_s=120)
    assert caught.value.cause is LimitCause.DISK
    assert isinstance(caught.value.result, ExecResult)
    assert not caught.value.result.timed_out  # the cap stopped it, not the timeout
    assert "dd" not in sandbox.probe("ps -o args").stdout
    # A checkpoint of the over-full layer is refused; the earlier ready one is untouched.
    with pytest.raises(SandboxLimitError, match="Nothing was checkpointed"):
        full_checkpoint(sandbox, "filler", store=store)
    assert [c.checkpoint_id for c in store.list("filler")] == [ready.checkpoint_id]
    assert (ready.path / "manifest.json").read_bytes() == manifest
    store.verify(ready)
    restored = track(full_restore(ready, engine=engine))
    assert restored.exec("cat /tmp/marker; test -e /tmp/fill || echo no-fill").stdout == "before\nno-fill\n"


def test_a_checkpoint_over_its_cap_is_not_published(make_sandbox, tmp_path):
    limits = SandboxLimits(pids=48, memory_mb=96, cpus=0.5, disk_mb=64, checkpoint_mb=8)
    sandbox = make_sandbox(BUSYBOX, "ckpt-cap", limits=limits)
    store = CheckpointStore(tmp_path)
    ready = full_checkpoint(sandbox, "ckpt-cap", store=store)
    assert ready.total_bytes < 8 * MIB
    manifest = (ready.path / "manifest.json").read_bytes()
    sandbox.exec("dd if=/dev/zero of=/tmp/ten bs=1048576 count=10 2>/dev/null")  # within disk_mb
    with pytest.raises(CheckpointTooLargeError, match="over its cap of 8 MB"):
        full_checkpoint(sandbox, "ckpt-cap", store=store)
    assert [c.checkpoint_id for c in store.list("ckpt-cap")] == [ready.checkpoint_id]
    assert store.leftovers() == []
    assert (ready.path / "manifest.json").read_bytes() == manifest
    assert sandbox.is_running()


def test_a_sparse_file_counts_at_its_full_size(make_sandbox):
    sandbox = make_sandbox(BUSYBOX, "sparse", limits=SMALL)
    with pytest.raises(SandboxLimitError) as caught:
        sandbox.exec("dd if=/dev/zero of=/tmp/sparse bs=1 count=1 seek=100M 2>/dev/null")
    assert caught.value.cause is LimitCause.DISK  # a layer archive would store all 100 MB of it


def test_no_privileges_to_escape(make_sandbox, tmp_path):
    sandbox = make_sandbox(DEBIAN, "privs", limits=SMALL)
    assert_small_limits(in_force(sandbox))
    raw = (
        "import socket\n"
        "for family, kind, proto in ((socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP),\n"
        "                            (socket.AF_PACKET, socket.SOCK_RAW, 0)):\n"
        "    try:\n"
        "        socket.socket(family, kind, proto)\n"
        "        print('opened')\n"
        "    except PermissionError:\n"
        "        print('refused')\n"
    )
    assert sandbox.exec(["python3", "-c", raw]).stdout == "refused\nrefused\n"
    assert "permission denied" in sandbox.exec("mkdir -p /mnt/t && mount -t tmpfs none /mnt/t").stderr
    assert "Operation not permitted" in sandbox.exec("unshare -Urm mount -t tmpfs none /mnt/t").stderr
    assert "Operation not permitted" in sandbox.exec("mknod /tmp/disk b 8 0").stderr
    # No way to the engine or to the checkpoint store: neither exists inside, nothing is mounted.
    store = CheckpointStore(tmp_path / "store")
    full_checkpoint(sandbox, "privs", store=store)
    for path in (
        "/var/run/docker.sock",
        "/run/docker.sock",
        "/run/containerd",
        str(tmp_path),
        "/var/lib/docker",
    ):
        assert sandbox.exec(["test", "-e", path]).exit_code == 1, path
    assert sandbox.inspect()["Mounts"] == []
    # no-new-privileges: a set-uid-root binary run by an unprivileged user stays unprivileged; the
    # same in a sandbox without it reads the secret (so the check can tell the two apart).
    control = make_sandbox(DEBIAN, "privs-control", limits=attrs.evolve(SMALL, no_new_privileges=False))
    for box, expected in ((sandbox, "Permission denied"), (control, "secret")):
        assert box.exec(SETUID_CAT).exit_code == 0
        read = box.exec(
            ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/tmp/cat", "/tmp/secret"]
        )
        assert expected in read.stdout + read.stderr


def test_attach_refuses_an_unconfined_seccomp(engine):
    container = engine._client.containers.create(
        BUSYBOX,
        ["sleep", "60"],
        network_mode="none",
        security_opt=["seccomp=unconfined"],
        labels=TEST_LABELS,
    )
    try:
        with pytest.raises(OutsideGuaranteeError, match="seccomp unconfined"):
            Sandbox.attach(engine, container.id)
    finally:
        engine.remove(container.id)


def test_unprivileged_user(make_sandbox, track, engine, tmp_path):
    sandbox = make_sandbox(BUSYBOX, "nobody", user="65534:65534", limits=SMALL)
    assert sandbox.exec("id -u").stdout == "65534\n"
    assert sandbox.enforced_limits() == SMALL.engine_view()
    store = CheckpointStore(tmp_path)
    if _host_has_cap_sys_resource():
        ckpt = full_checkpoint(sandbox, "nobody", store=store)
        restored = track(full_restore(ckpt, engine=engine))
        assert restored.exec("id -u").stdout == "65534\n"
    else:
        # CRIU reads every process's rlimits; for a process of another uid that needs CAP_SYS_RESOURCE.
        with pytest.raises(CheckpointFailedError, match="CAP_SYS_RESOURCE"):
            full_checkpoint(sandbox, "nobody", store=store)
        assert store.list("nobody") == []
        assert store.leftovers() == []
        assert sandbox.is_running()


def _host_has_cap_sys_resource() -> bool:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> 24 & 1)
    return False


def _put_file(sandbox: Sandbox, path: str) -> None:
    """Create an empty file inside without starting a process there (the sandbox may be full)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.addfile(tarfile.TarInfo(Path(path).name))
    assert sandbox._container.put_archive(str(Path(path).parent), buf.getvalue())


def test_the_kill_at_a_limit_also_takes_processes_forked_while_it_ran(make_sandbox):
    # Ten shells fork a long sleep and kill it at once, without end: a shell killed just after a
    # fork leaves a `sleep 1000` that a single listing-then-kill of the action's processes misses.
    # (This did not reproduce CI's failure, where the disk filler's shell was still listed after the
    # kill, on a quiet machine: the kill now repeats until the action's processes are gone.)
    sandbox = make_sandbox(
        BUSYBOX, "forker", limits=SandboxLimits(pids=512, memory_mb=96, cpus=0.5, disk_mb=16)
    )
    forker = "while :; do sleep 1000 & kill $! 2>/dev/null; wait $!; done"
    action = f"for i in 1 2 3 4 5 6 7 8 9 10; do sh -c '{forker}' & done; sleep 1; " + (
        "while :; do dd if=/dev/zero bs=1048576 count=1 2>/dev/null >> /tmp/fill; done"
    )
    for _ in range(3):
        with pytest.raises(SandboxLimitError, match="over its disk cap of 16 MB"):
            sandbox.exec(action, timeout_s=120)
        left = sandbox.probe("ps -o args").stdout
        assert not [
            line for line in left.splitlines() if "sleep 1000" in line or "dd if" in line or "kill $!" in line
        ]
        sandbox.exec("rm -f /tmp/fill")
