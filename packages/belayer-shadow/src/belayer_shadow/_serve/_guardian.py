"""The serve command's guardian: when `belayer-shadow serve` dies, however it dies, nothing stays.

Every slot already has its own guardian (`_workers/_processes.py`) that reaps the slot's recorded
processes when the command dies. This one covers the rest: it also reaps every slot folder (in
case a slot's guardian was itself killed, or the command died between starting a slot's children
and its guardian) and removes the run folder when the command made it (a temporary one). Same
mechanism: a pipe whose write end only the command holds; end-of-file means the command is gone
(or closed it after a clean stop).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from belayer_shadow._errors import SupervisorError
from belayer_shadow._workers._processes import reap_stale_processes

__all__ = ["ServeGuardian"]


class ServeGuardian:
    """A process in its own session holding the read end of the command's pipe."""

    def __init__(self, popen: subprocess.Popen[bytes], pipe: int) -> None:
        self.popen, self._pipe = popen, pipe

    @classmethod
    def start(cls, run_dir: Path, *, remove: bool) -> ServeGuardian:
        """Start the guardian of `run_dir` (`remove`: delete the folder once everything is reaped)."""
        read_end, write_end = os.pipe()  # not inheritable: no other child keeps the write end open
        command = [sys.executable, "-m", "belayer_shadow._serve._guardian", str(run_dir), str(read_end)]
        command.append("remove" if remove else "keep")
        try:
            popen = subprocess.Popen(
                command,
                pass_fds=(read_end,),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,  # a signal to the command's process group does not reach it
            )
        except BaseException:
            os.close(write_end)
            raise
        finally:
            os.close(read_end)
        return cls(popen, write_end)

    def close(self, timeout_s: float = 30.0) -> None:
        """Close the pipe (the guardian reaps what is left, removes a temporary folder, exits)."""
        if self._pipe >= 0:
            os.close(self._pipe)
            self._pipe = -1
        try:
            self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()


def _guard(run_dir: Path, fd: int, remove: bool) -> None:
    with contextlib.suppress(OSError):
        while os.read(fd, 4096):
            pass
    for slot_dir in sorted((run_dir / "slots").glob("*")):
        with contextlib.suppress(SupervisorError, OSError):
            reap_stale_processes(slot_dir, owner_gone=True)
    if remove:
        shutil.rmtree(run_dir, ignore_errors=True)


if __name__ == "__main__":  # python -m belayer_shadow._serve._guardian RUN_DIR FD remove|keep
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _guard(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "remove")
