"""Tokenizers for text prompts on ``/v1/completions`` (token ids need none)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import attrs

from belayer_router._errors import BelayerRouterError, InvalidRequestError

__all__ = ["ByteTokenizer", "HuggingFaceTokenizer", "Tokenizer", "load_tokenizer"]


class Tokenizer(Protocol):
    """What the router needs from a tokenizer."""

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``."""
        ...

    def decode(self, token_ids: list[int]) -> str:
        """Text of ``token_ids``."""
        ...


@attrs.frozen
class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255; for byte-level models and for trying the API out."""

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of ``text``."""
        return list(text.encode())

    def decode(self, token_ids: list[int]) -> str:
        """Ids >= 256 are not bytes and decode to U+FFFD, as do incomplete UTF-8 sequences."""
        return bytes(t if t < 256 else 0xFF for t in token_ids).decode(errors="replace")


@attrs.frozen
class HuggingFaceTokenizer:
    """A ``tokenizer.json`` loaded with the ``tokenizers`` library (``pip install tokenizers``)."""

    inner: Any

    def encode(self, text: str) -> list[int]:
        """Token ids without added special tokens (chat templates are the caller's business)."""
        return list(self.inner.encode(text, add_special_tokens=False).ids)

    def decode(self, token_ids: list[int]) -> str:
        """Text of ``token_ids``, special tokens kept."""
        return str(self.inner.decode(token_ids, skip_special_tokens=False))


def load_tokenizer(spec: str) -> Tokenizer:
    """``"bytes"`` for `ByteTokenizer`, else a path to a ``tokenizer.json`` file or its folder."""
    if spec == "bytes":
        return ByteTokenizer()
    path = Path(spec)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise InvalidRequestError(f"tokenizer {spec!r}: give 'bytes' or a path to a tokenizer.json file")
    try:
        import tokenizers
    except ImportError as error:
        raise BelayerRouterError("loading a tokenizer.json needs `pip install tokenizers`") from error
    return HuggingFaceTokenizer(tokenizers.Tokenizer.from_file(str(path)))
