"""The request journal (prompt, streamed tokens, preserved prefix) and the context log ``L_k``."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

import attrs

from belayer_router._core._journal_file import JournalStore
from belayer_router._errors import InvalidRequestError, JournalError, NotFoundError, RequestConflictError
from belayer_router._wire._protocol import GenerateRequest

__all__ = ["Journal", "RequestRecord"]

_REQUEST_FIELDS = ("max_tokens", "temperature", "top_p", "stop_token_ids", "trajectory_id", "turn")


@attrs.define(eq=False)
class RequestRecord:
    """Everything the router knows about one request.

    ``token_ids[:num_preserved]`` is the preserved prefix: persisted (when a store is
    configured), so it survives a router restart.
    """

    request_id: str
    request: GenerateRequest
    seed: int
    token_ids: list[int] = attrs.field(factory=list)
    logprobs: list[float] = attrs.field(factory=list)
    num_preserved: int = 0
    finish_reason: str | None = None
    num_resumes: int = 0
    in_flight: bool = False
    session_id: str | None = None  # ``X-Session-ID``: the session's slot serves it (not journaled)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready view for ``GET /requests/{id}``."""
        return {
            "request_id": self.request_id,
            "prompt_token_ids": list(self.request.prompt_token_ids),
            "seed": self.seed,
            "token_ids": self.token_ids,
            "logprobs": self.logprobs,
            "num_preserved": self.num_preserved,
            "finish_reason": self.finish_reason,
            "num_resumes": self.num_resumes,
        }


def _begin_op(record: RequestRecord) -> dict[str, Any]:
    request = record.request
    op: dict[str, Any] = {"op": "begin", "request_id": record.request_id, "seed": record.seed}
    op["prompt_token_ids"] = list(request.prompt_token_ids)
    for name in _REQUEST_FIELDS:
        value = getattr(request, name)
        op[name] = list(value) if isinstance(value, tuple) else value
    if request.stop:
        op["stop"] = list(request.stop)
    return op


def _same_request(a: GenerateRequest, b: GenerateRequest) -> bool:
    fields = ("prompt_token_ids", "stop", *_REQUEST_FIELDS)
    return all(getattr(a, name) == getattr(b, name) for name in fields)


@attrs.define
class Journal:
    """Per-request records and per-trajectory contexts, optionally persisted to a `JournalStore`.

    The preserved prefix advances every ``prefix_interval`` tokens and at completion; at most
    ``max_finished`` finished records are kept in memory (oldest dropped first).
    """

    store: JournalStore | None = None
    prefix_interval: int = attrs.field(default=256, validator=attrs.validators.ge(1))
    max_finished: int = attrs.field(default=10_000, validator=attrs.validators.ge(1))
    records: dict[str, RequestRecord] = attrs.field(factory=dict)
    contexts: dict[str, dict[int, list[int]]] = attrs.field(factory=dict)
    _finished: deque[str] = attrs.field(factory=deque, alias="_finished")

    def _write(self, op: dict[str, Any]) -> None:
        if self.store is not None:
            self.store.append(op)

    def begin(self, request_id: str, request: GenerateRequest, seed: int) -> RequestRecord:
        """Open (or reopen, for a resumed request id) the record of a request and mark it in flight."""
        record = self.records.get(request_id)
        if record is None:
            record = self.records[request_id] = RequestRecord(request_id, request, seed)
            self._write(_begin_op(record))
        elif record.in_flight:
            raise RequestConflictError(f"request {request_id!r} is still in flight; wait for it or cancel it")
        elif not _same_request(record.request, request):
            raise RequestConflictError(
                f"request id {request_id!r} was used for a different request; pick a new request_id"
            )
        record.in_flight = True
        return record

    def append(self, record: RequestRecord, token_id: int, logprob: float) -> None:
        """Journal one streamed token; advance the preserved prefix every ``prefix_interval``."""
        record.token_ids.append(token_id)
        record.logprobs.append(logprob)
        if len(record.token_ids) - record.num_preserved >= self.prefix_interval:
            self.preserve(record)

    def extend(self, record: RequestRecord, token_ids: Sequence[int], logprobs: Sequence[float]) -> None:
        """Journal a frame of streamed tokens at once (one prefix record when it crosses the interval)."""
        record.token_ids.extend(token_ids)
        record.logprobs.extend(logprobs)
        if len(record.token_ids) - record.num_preserved >= self.prefix_interval:
            self.preserve(record)

    def preserve(self, record: RequestRecord) -> None:
        """Advance the preserved prefix to every token streamed so far."""
        start = record.num_preserved
        if start == len(record.token_ids):
            return
        self._write(
            {
                "op": "prefix",
                "request_id": record.request_id,
                "start": start,
                "token_ids": record.token_ids[start:],
                "logprobs": record.logprobs[start:],
            }
        )
        record.num_preserved = len(record.token_ids)

    def finish(self, record: RequestRecord, finish_reason: str) -> None:
        """Preserve the whole completion, mark it finished and record ``L_k`` for a trajectory."""
        self.preserve(record)
        record.finish_reason = finish_reason
        record.in_flight = False
        self._write({"op": "finish", "request_id": record.request_id, "finish_reason": finish_reason})
        self._record_context(record)
        self._finished.append(record.request_id)
        while len(self._finished) > self.max_finished:
            self.records.pop(self._finished.popleft(), None)

    def _record_context(self, record: RequestRecord) -> None:
        """``L_turn`` = prompt + completion of a finished trajectory turn, in memory only: the
        journal already holds both (its ``begin`` and ``prefix`` lines), and replaying its
        ``finish`` rebuilds it, so the context is journaled once."""
        request = record.request
        if request.trajectory_id is not None and request.turn is not None:
            context = [*request.prompt_token_ids, *record.token_ids]
            self.contexts.setdefault(request.trajectory_id, {})[request.turn] = context

    def release(self, record: RequestRecord) -> None:
        """End an interrupted attempt: preserve what was streamed so the request can be resumed."""
        self.preserve(record)
        record.in_flight = False

    def put_context(self, trajectory_id: str, turn: int, token_ids: list[int]) -> None:
        """Record ``L_turn`` of a trajectory: the full token context after that turn's response."""
        if isinstance(turn, bool) or not isinstance(turn, int) or turn < 0:
            raise InvalidRequestError(f"turn must be a non-negative integer, got {turn!r}")
        self.contexts.setdefault(trajectory_id, {})[turn] = list(token_ids)
        self._write({"op": "context", "trajectory_id": trajectory_id, "turn": turn, "token_ids": token_ids})

    def append_context(self, trajectory_id: str, turn: int, token_ids: list[int]) -> int:
        """Append what turn ``turn`` added after its response (an observation) to ``L_turn``, which
        the turn's generation recorded at its finish (prompt + completion); returns the new length.
        Only the added tokens are journaled. `NotFoundError` when ``L_turn`` is not recorded."""
        if isinstance(turn, bool) or not isinstance(turn, int) or turn < 0:
            raise InvalidRequestError(f"turn must be a non-negative integer, got {turn!r}")
        context = self.contexts.get(trajectory_id, {}).get(turn)
        if context is None:
            raise NotFoundError(
                f"trajectory {trajectory_id!r} has no context for turn {turn} to append to: generate "
                "the turn with trajectory_id and turn first (its finish records the context), or put it"
            )
        context.extend(token_ids)
        self._write(
            {"op": "context_append", "trajectory_id": trajectory_id, "turn": turn, "token_ids": token_ids}
        )
        return len(context)

    def get_context(self, trajectory_id: str, turn: int | None = None) -> tuple[int, list[int]]:
        """``(turn, L_turn)``; with ``turn=None`` the latest turn recorded."""
        turns = self.contexts.get(trajectory_id)
        if not turns:
            raise NotFoundError(f"no context recorded for trajectory {trajectory_id!r}")
        if turn is None:
            turn = max(turns)
        if turn not in turns:
            raise NotFoundError(f"trajectory {trajectory_id!r} has no context for turn {turn}")
        return turn, turns[turn]

    def drop_trajectory(self, trajectory_id: str) -> None:
        """Forget every context of a finished trajectory."""
        if self.contexts.pop(trajectory_id, None) is not None:
            self._write({"op": "drop_trajectory", "trajectory_id": trajectory_id})

    def record_admin(self, op: dict[str, Any]) -> None:
        """Persist a registry change (``register``, ``unregister``, ``unhealthy``, ``slot_version``,
        ``require_version``) for `load`."""
        self._write(op)

    def load(self) -> list[dict[str, Any]]:
        """Replay the store into memory (at router start); unfinished records become resumable.

        Return the registry changes recorded with `record_admin`, oldest first.
        """
        admin_ops: list[dict[str, Any]] = []
        if self.store is None:
            return admin_ops
        for op in self.store.read():
            if op["op"] in ("register", "unregister", "unhealthy", "slot_version", "require_version"):
                admin_ops.append(op)
                continue
            try:
                self._replay(op)
            except (KeyError, TypeError, ValueError, AttributeError) as error:
                raise JournalError(
                    f"journal {self.store.path} holds a malformed {op.get('op')!r} operation "
                    f"({error!r}); move the file away to start with an empty journal"
                ) from error
        return admin_ops

    def _replay(self, op: dict[str, Any]) -> None:
        kind = op["op"]
        if kind == "begin":
            fields = {name: op[name] for name in _REQUEST_FIELDS}
            fields["stop_token_ids"] = tuple(fields["stop_token_ids"])
            fields["stop"] = tuple(op.get("stop", ()))
            request = GenerateRequest(prompt_token_ids=tuple(op["prompt_token_ids"]), **fields)
            self.records[op["request_id"]] = RequestRecord(op["request_id"], request, op["seed"])
        elif kind == "prefix":
            record = self.records.get(op["request_id"])
            if record is not None and op["start"] == record.num_preserved:
                record.token_ids.extend(op["token_ids"])
                record.logprobs.extend(op["logprobs"])
                record.num_preserved = len(record.token_ids)
        elif kind == "finish":
            record = self.records.get(op["request_id"])
            if record is not None:
                record.finish_reason = op["finish_reason"]
                self._record_context(record)
                self._finished.append(record.request_id)
        elif kind == "context":
            self.contexts.setdefault(op["trajectory_id"], {})[op["turn"]] = op["token_ids"]
        elif kind == "context_append":
            turns = self.contexts.get(op["trajectory_id"], {})
            if op["turn"] in turns:
                turns[op["turn"]].extend(op["token_ids"])
        elif kind == "drop_trajectory":
            self.contexts.pop(op["trajectory_id"], None)
