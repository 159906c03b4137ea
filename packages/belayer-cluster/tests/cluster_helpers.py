"""Helpers of the cluster tests: process ancestry, greedy rollouts through the router."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import anyio

from belayer_router import FinishEvent, RouterClient, TokenEvent

TOKEN = "cluster-test-admin-token"
PROMPTS = [[10 + i, 20 + 3 * i, 30, 40 + i, 50] for i in range(6)]


def parent(pid: int) -> int | None:
    """The parent pid, or None when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return int(stat.read().rsplit(") ", 1)[1].split()[1])
    except (FileNotFoundError, ProcessLookupError):
        return None


def ancestors(pid: int) -> list[int]:
    """Every ancestor pid of `pid`, nearest first."""
    chain: list[int] = []
    current = parent(pid)
    while current not in (None, 0):
        chain.append(current)
        current = parent(current)
    return chain


def gone(pid: int) -> bool:
    """True when `pid` no longer runs (absent or a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(") ", 1)[1].startswith("Z")
    except FileNotFoundError:
        return True


def processes_mentioning(text: str) -> list[int]:
    """Live (not zombie) processes whose command line contains `text`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if text in cmdline and stat[stat.rindex(")") + 2 :].split()[0] != "Z":
            found.append(int(entry.name))
    return found


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll `condition` until it holds; fail with `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.05)


class Rollout:
    """Concurrent greedy streams through the router, run in a thread the test can wait on."""

    def __init__(self, url: str, prompts: Sequence[list[int]], max_tokens: int) -> None:
        self.url, self.prompts, self.max_tokens = url, prompts, max_tokens
        self.tokens: list[list[int]] = [[] for _ in prompts]
        self.indices: list[list[int]] = [[] for _ in prompts]
        self.finishes: list[FinishEvent | None] = [None for _ in prompts]
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Rollout:
        self._thread.start()
        return self

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), f"the rollout did not finish within {timeout_s} s"
        if self.error is not None:
            raise self.error

    def wait_tokens(self, count: int, timeout_s: float = 120.0) -> None:
        wait_until(lambda: min(len(t) for t in self.tokens) >= count, timeout_s, f"{count} tokens per stream")

    def _run(self) -> None:
        try:
            anyio.run(self._all)
        except BaseException as exc:  # reported by join()
            self.error = exc

    async def _all(self) -> None:
        async with RouterClient(self.url) as client, anyio.create_task_group() as group:
            for i in range(len(self.prompts)):
                group.start_soon(self._one, client, i)

    async def _one(self, client: RouterClient, i: int) -> None:
        stream = client.generate_stream(self.prompts[i], self.max_tokens, temperature=0.0, seed=i)
        async for event in stream:
            if isinstance(event, TokenEvent):
                self.tokens[i].append(event.token_id)
                self.indices[i].append(event.index)
            else:
                self.finishes[i] = event


def rollout(url: str, prompts: Sequence[list[int]], max_tokens: int, timeout_s: float = 240.0) -> Rollout:
    """A whole rollout, waited for."""
    run = Rollout(url, prompts, max_tokens).start()
    run.join(timeout_s)
    return run
