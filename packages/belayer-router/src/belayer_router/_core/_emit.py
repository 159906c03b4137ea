"""`Emit`: where a request's tokens go; the one interface between the resume loop and the clients.

The dispatcher (and a worker link's reader) hands each request's tokens to its emit synchronously,
right after journaling them, so fencing check, journal append and emit happen with no await in
between.  Each client format implements both methods: `EventEmit` (a list or an OpenAI choice:
events), the ``/generate`` stream (NDJSON rendered straight to bytes) and the client link
(``TOKENS`` entries); the dispatcher never asks an emit what it can do.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from belayer_router._wire._protocol import FinishEvent, TokenEvent, TokensEvent

__all__ = ["Emit", "Event", "EventEmit"]

Event = TokenEvent | TokensEvent | FinishEvent


class Emit(Protocol):
    """A request's output: its events, and its frames of checked, journaled tokens."""

    def __call__(self, event: Event) -> None:
        """One event: a token given one at a time (a resume's replay, a stream with stop strings),
        a whole-request frame as a `TokensEvent`, or the request's `FinishEvent` (always last)."""

    def frame(self, start: int, token_ids: Sequence[int], logprobs: Sequence[float]) -> None:
        """A frame's tokens at completion indices ``start, start+1, ...``, already checked and
        journaled: render them as this client wants them (the common path: one call per frame)."""


class EventEmit:
    """An `Emit` over a plain event callback: a frame becomes one `TokensEvent` when the request
    asked for ``frames``, else one `TokenEvent` per token."""

    __slots__ = ("events", "frames")

    def __init__(self, events: Callable[[Event], None], frames: bool) -> None:
        self.events, self.frames = events, frames

    def __call__(self, event: Event) -> None:
        self.events(event)

    def frame(self, start: int, token_ids: Sequence[int], logprobs: Sequence[float]) -> None:
        if self.frames:
            self.events(TokensEvent(start, tuple(token_ids), tuple(logprobs)))
            return
        for offset, token_id in enumerate(token_ids):
            self.events(TokenEvent(start + offset, token_id, logprobs[offset]))
