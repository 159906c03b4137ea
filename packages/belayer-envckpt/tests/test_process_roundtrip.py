"""Process state survives: in-memory state, a child, an open appended file, a pipe between two."""

from __future__ import annotations

import time

from conftest import BUSYBOX, DEBIAN, read_from_layer, wait_for

from belayer_envckpt import CheckpointStore, full_checkpoint, full_restore

# Parent: an in-memory counter, appended to an open log and written into a pipe; the child reads
# the pipe and appends what it gets to its own open log.  After a restore both logs must continue
# 1, 2, 3, ... with no restart and no gap.
TREE_APP = r"""
import os, time
os.makedirs('/work', exist_ok=True)
r, w = os.pipe()
if os.fork() == 0:
    os.close(w)
    out = open('/work/child.log', 'a', buffering=1)
    for line in os.fdopen(r):
        out.write(line)
else:
    os.close(r)
    pipe = os.fdopen(w, 'w', buffering=1)
    log = open('/work/parent.log', 'a', buffering=1)
    n = 0
    while True:
        n += 1
        log.write(f'{n}\n')
        pipe.write(f'{n}\n')
        with open('/work/state.tmp', 'w') as f:
            f.write(str(n))
        os.rename('/work/state.tmp', '/work/state')
        time.sleep(0.02)
"""


# How many processes of the app tree run (parent and child share the app's command line).
COUNT_APP = (
    "import os\n"
    "cmds = [open(f'/proc/{p}/cmdline', 'rb').read() for p in os.listdir('/proc') if p.isdigit()]\n"
    "print(sum(b'os.pipe' in c and b'COUNT_APP' not in c for c in cmds))  # COUNT_APP"
)


def _numbers(text: str) -> list[int]:
    return [int(x) for x in text.split()]


def test_process_tree_resumes(make_sandbox, track, engine, tmp_path):
    sandbox = make_sandbox(DEBIAN, "proc", command=("python3", "-c", TREE_APP))
    wait_for(lambda: len(_numbers(sandbox.exec("cat /work/child.log 2>/dev/null").stdout)) > 20)
    assert sandbox.exec(["python3", "-c", COUNT_APP]).stdout == "2\n"
    ckpt = full_checkpoint(sandbox, "proc", store=CheckpointStore(tmp_path))
    at_checkpoint = int(read_from_layer(ckpt.path / "layer.tar", "work/state"))
    time.sleep(0.3)
    sandbox.kill()

    restored = track(full_restore(ckpt, engine=engine))
    wait_for(lambda: _numbers(restored.exec("cat /work/state").stdout or "0")[0] > at_checkpoint + 10)
    parent = _numbers(restored.exec("cat /work/parent.log").stdout)
    child = _numbers(restored.exec("cat /work/child.log").stdout)
    # No restart (1 appears once) and no gap: the in-memory counter and the open files resumed.
    assert parent == list(range(1, len(parent) + 1))
    assert parent.count(at_checkpoint) == 1
    assert parent[-1] > at_checkpoint + 10
    # The pipe kept working across the restore: the child saw every number (it may lag by a few).
    assert child == list(range(1, len(child) + 1))
    assert child[-1] > at_checkpoint
    assert restored.exec(["python3", "-c", COUNT_APP]).stdout == "2\n"  # parent and child both back


def test_shell_counter_resumes_from_checkpointed_value(make_sandbox, track, engine, tmp_path):
    # Written to a side file and renamed, so neither a read nor the frozen layer sees it half-written.
    counter = (
        "/bin/sh",
        "-c",
        "i=0; while :; do i=$((i+1)); echo $i > /tmp/count.new; mv /tmp/count.new /tmp/count; sleep 0.05; done",
    )
    sandbox = make_sandbox(BUSYBOX, "counter", command=counter)
    wait_for(lambda: int(sandbox.exec("cat /tmp/count 2>/dev/null").stdout.strip() or 0) >= 10)
    ckpt = full_checkpoint(sandbox, "counter", store=CheckpointStore(tmp_path))
    checkpointed = int(read_from_layer(ckpt.path / "layer.tar", "tmp/count"))
    sandbox.kill()
    restored = track(full_restore(ckpt, engine=engine))
    first = int(restored.exec("cat /tmp/count").stdout)
    # Resumed from the checkpointed value, not from the start (the start would be 1, 2, ...).
    assert checkpointed <= first  # a restart would count from 1 again; checkpointed is >= 10
