"""The text side of one OpenAI choice: decoding, stop strings, and what may be streamed yet.

A choice's text is the decoded completion cut before the first stop string.  While streaming, the
last characters that could still turn into a stop string (or into a marker the endpoint
withholds, like ``<tool_call>``) and an incomplete UTF-8 sequence are held back, so no client
ever sees text that a later token takes back.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

from belayer_router._core._tokenizer import Tokenizer
from belayer_router._wire._protocol import FinishEvent, TokenEvent, TokensEvent

__all__ = ["ChoiceText", "cut_at_stop"]

_INCOMPLETE = "\ufffd"


def cut_at_stop(text: str, stop: tuple[str, ...]) -> tuple[str, bool]:
    """``text`` before its first stop string, and whether one was found."""
    cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=-1)
    return (text, False) if cut < 0 else (text[:cut], True)


@attrs.define
class ChoiceText:
    """Tokens, logprobs and text of one choice as its events arrive.

    While streaming, the text is decoded incrementally (as vLLM's detokenizer does): the text of
    the tokens before ``_read`` is settled, and each event decodes only the tokens from
    ``_prefix`` on (the last settled step's tokens give the decoder its context), so a stream
    costs time linear in its length, not quadratic.  Stop strings and the marker are searched only
    in the new text (plus the longest one's length - 1 before it).  `text` (whole answers, the
    tool-call parse) decodes everything once.
    """

    tokenizer: Tokenizer | None
    stop: tuple[str, ...]
    hold_chars: int = 0  # extra characters to hold back (a withheld marker's length - 1)
    decode: Callable[[list[int]], str] | None = None  # the text of token ids (default: tokenizer's)
    token_ids: list[int] = attrs.field(factory=list)
    logprobs: list[float] = attrs.field(factory=list)
    finish: FinishEvent | None = None
    num_sent: int = 0  # characters of text already streamed
    _settled: str = ""  # the text of token_ids[:_read]
    _prefix: int = 0  # where the decode window starts (a settled step's first token)
    _read: int = 0  # tokens whose text is settled
    _before: str | None = None  # the text of token_ids[_prefix:_read] (cached)
    _searched: int = 0  # characters searched for stop strings / the marker
    _cut: int = -1  # where the first stop string starts (-1: none yet)
    _marker_at: int = -1  # where the marker first starts (-1: none yet)

    def __attrs_post_init__(self) -> None:
        if self.decode is None and self.tokenizer is not None:
            self.decode = self.tokenizer.decode

    def add(self, event: TokenEvent | TokensEvent | FinishEvent) -> None:
        """Take one event of this choice's router stream."""
        if isinstance(event, FinishEvent):
            self.finish = event
        elif isinstance(event, TokensEvent):
            self.token_ids.extend(event.token_ids)
            self.logprobs.extend(event.logprobs)
        else:
            self.token_ids.append(event.token_id)
            self.logprobs.append(event.logprob)

    def text(self) -> str:
        """The whole text so far, cut before the first stop string (empty without a tokenizer)."""
        if self.decode is None:
            return ""
        return cut_at_stop(self.decode(self.token_ids), self.stop)[0]

    def _decoded(self, decode: Callable[[list[int]], str]) -> str:
        """The text of every token so far, decoding only the window from ``_prefix`` on."""
        ids = self.token_ids
        if self._read == len(ids):
            return self._settled
        window = decode(ids[self._prefix :])
        if self._before is None:
            self._before = decode(ids[self._prefix : self._read]) if self._read > self._prefix else ""
        before = self._before
        if len(window) > len(before) and not window.endswith(_INCOMPLETE):
            self._settled += window[len(before) :]
            self._prefix, self._read, self._before = self._read, len(ids), None
            return self._settled
        return self._settled + window[len(before) :]  # not settled: a later token may change it

    def _search(self, text: str, marker: str | None) -> None:
        """Find the first stop string (and ``marker``) in what is new since the last search."""
        needles = [*self.stop, *([marker] if marker else [])]
        if not needles or self._cut >= 0:
            return
        start = max(0, self._searched - max(map(len, needles)) + 1)
        found = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
        if found:
            self._cut = min(found)
        if marker and self._marker_at < 0:
            self._marker_at = text.find(marker, start)
        self._searched = len(text.rstrip(_INCOMPLETE))  # an incomplete character may still change

    def streamable(self, marker: str | None = None) -> str:
        """The prefix of `text` that no later token can change, and before ``marker`` if given
        (one choice is always asked with the same ``marker``)."""
        if self.decode is None:
            return ""
        text = self._decoded(self.decode)
        self._search(text, marker)
        stopped = self._cut >= 0
        if stopped:
            text = text[: self._cut]
        if marker is not None and 0 <= self._marker_at <= len(text) - len(marker):
            return text[: self._marker_at]
        if self.finish is not None or stopped:
            return text
        text = text.rstrip(_INCOMPLETE)
        hold = max([self.hold_chars, *(len(s) - 1 for s in self.stop)])
        return text[: max(0, len(text) - hold)]

    def take(self, upto: str) -> str:
        """The part of ``upto`` (a streamable text) not streamed yet; marks it streamed."""
        delta = upto[self.num_sent :]
        self.num_sent = max(self.num_sent, len(upto))
        return delta

    def token_text(self, token_id: int) -> str:
        """One token's text (``token_id:N`` without a tokenizer)."""
        return f"token_id:{token_id}" if self.tokenizer is None else self.tokenizer.decode([token_id])
