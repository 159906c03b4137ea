"""The demo behind `belayer-envckpt demo`: checkpoint -> kill -> restore of a sandbox."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

from ._checkpoint import full_checkpoint, full_restore
from ._docker import Engine
from ._sandbox import Sandbox, SandboxConfig

# A long-running process with in-memory state and a file it keeps open and appends to.
COUNTER_APP = """
import time
n = 0
log = open('/tmp/ticks.log', 'a', buffering=1)
while True:
    n += 1
    log.write(f'{n}\\n')
    time.sleep(0.05)
"""


def _state(sandbox: Sandbox) -> str:
    """The trajectory-visible file state: a listing with checksums of /repo."""
    return sandbox.exec("cd /repo && find . -type f | sort | xargs md5sum").stdout


def run_demo(
    *,
    image: str = "belayer/debian-python:latest",
    store_root: str = "",
    say: Callable[[str], Any] | None = print,
) -> dict[str, Any]:
    """Run the demo; returns what it measured.  Cleans up its container and temporary store."""
    from ._store import CheckpointStore

    def tell(msg: str) -> None:
        if say is not None:
            say(msg)

    tmp = None if store_root else tempfile.mkdtemp(prefix="belayer-demo-")
    store = CheckpointStore(store_root or str(tmp))
    engine = Engine.connect()
    config = SandboxConfig(image=image, command=("python3", "-c", COUNTER_APP), working_dir="/")
    sandbox = Sandbox.create(engine, config, trajectory="demo")
    restored: Sandbox | None = None
    try:
        tell(f"sandbox {sandbox.id[:12]} from {image}: a Python process counts and appends to /tmp/ticks.log")
        sandbox.exec("mkdir -p /repo && printf 'def add(a, b):\\n    return a - b\\n' > /repo/calc.py")
        sandbox.exec("sed -i 's/a - b/a + b/' /repo/calc.py && echo fixed > /repo/NOTES")
        time.sleep(0.5)
        ckpt = full_checkpoint(sandbox, "demo", context_ref="demo/turn-2", store=store)
        at_k = _state(sandbox)  # read-only inspection; it counts as an action of its own
        tell(
            f"full_checkpoint at prefix k={ckpt.prefix}: freeze window {ckpt.timings_ms['freeze_ms']:.0f} ms, "
            f"total {ckpt.timings_ms['total_ms']:.0f} ms, {ckpt.total_bytes / 1e6:.1f} MB"
        )
        sandbox.exec("rm /repo/NOTES && echo 'garbage' >> /repo/calc.py")
        ticks_before = int(sandbox.exec("tail -n1 /tmp/ticks.log").stdout or 0)
        tell(
            f"two more actions ran (k={sandbox.prefix}); the counter is at {ticks_before}; killing the container"
        )
        sandbox.kill()
        latest = store.latest_ready("demo")
        assert latest is not None
        restored = full_restore(latest, engine=engine)
        restored_prefix = restored.prefix
        time.sleep(0.3)
        ticks = [int(x) for x in restored.exec("cat /tmp/ticks.log").stdout.split()]
        same = _state(restored) == at_k
        consecutive = ticks == list(range(1, len(ticks) + 1))
        tell(
            f"full_restore into {restored.id[:12]} in {restored.restore_timings_ms['total_ms']:.0f} ms: "
            f"prefix k={restored_prefix}, context {restored.context_ref!r}; /repo equals the state at k: "
            f"{same}; the counter resumed (log 1..{ticks[-1]} with no restart): {consecutive}"
        )
        return {
            "checkpoint_id": ckpt.checkpoint_id,
            "freeze_ms": ckpt.timings_ms["freeze_ms"],
            "checkpoint_total_ms": ckpt.timings_ms["total_ms"],
            "restore_total_ms": restored.restore_timings_ms["total_ms"],
            "state_matches_prefix": same,
            "process_resumed": consecutive,
        }
    finally:
        sandbox.remove()
        if restored is not None:
            restored.remove()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        elif store_root:
            store.gc("demo")
        engine.close()
