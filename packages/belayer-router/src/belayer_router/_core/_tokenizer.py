"""Tokenizers for text prompts and chat messages (token-id prompts need none).

`load_tokenizer` takes ``"bytes"``, a ``tokenizer.json`` file, or a tokenizer folder.  A folder
whose ``tokenizer_config.json`` holds a ``chat_template`` loads as a `ChatTemplateTokenizer`
through transformers (``pip install belayer-router[chat]``): the router renders
``/v1/chat/completions`` messages with the model's own template, never a template of its own.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import attrs

from belayer_router._errors import InvalidRequestError, TokenizerError

__all__ = [
    "ByteTokenizer",
    "ChatTemplateTokenizer",
    "ChatTokenizer",
    "HuggingFaceTokenizer",
    "Tokenizer",
    "load_tokenizer",
]


class Tokenizer(Protocol):
    """What the router needs from a tokenizer."""

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``."""
        ...

    def decode(self, token_ids: list[int]) -> str:
        """Text of ``token_ids``."""
        ...


@runtime_checkable
class ChatTokenizer(Tokenizer, Protocol):
    """A tokenizer that also renders chat messages with the model's chat template."""

    @property
    def end_token_ids(self) -> tuple[int, ...]:
        """Token ids that end an assistant turn (the default stop tokens of a chat request)."""
        ...

    def decode_reply(self, token_ids: list[int]) -> str:
        """Text of a reply: special tokens (like the end of turn) left out, tool markers kept."""
        ...

    def render_chat(
        self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None
    ) -> list[int]:
        """Prompt token ids of ``messages`` (and ``tools``), ending in the assistant's header."""
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


@attrs.frozen
class ChatTemplateTokenizer:
    """A tokenizer folder loaded with transformers; renders chats with its ``chat_template``."""

    inner: Any
    end_token_ids: tuple[int, ...]

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special tokens written in the text are recognised."""
        return list(self.inner.encode(text, add_special_tokens=False))

    def decode(self, token_ids: list[int]) -> str:
        """Text of ``token_ids``, special tokens kept."""
        return str(self.inner.decode(token_ids, skip_special_tokens=False))

    def decode_reply(self, token_ids: list[int]) -> str:
        """Text of a reply: special tokens (like the end of turn) left out, tool markers kept."""
        return str(self.inner.decode(token_ids, skip_special_tokens=True))

    def render_chat(
        self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None
    ) -> list[int]:
        """The chat template applied to ``messages`` with the generation prompt, then encoded."""
        try:
            text = self.inner.apply_chat_template(
                list(messages),
                tools=None if not tools else list(tools),
                tokenize=False,
                add_generation_prompt=True,
            )
        except Exception as error:  # the template's own errors (jinja2's) are the request's fault
            raise InvalidRequestError(
                f"the tokenizer's chat template cannot render these messages: {error}"
            ) from error
        return self.encode(str(text))


def _load_chat_folder(folder: Path) -> ChatTemplateTokenizer:
    try:
        import transformers
    except ImportError as error:
        raise TokenizerError(
            f"tokenizer folder {folder} has a chat template; rendering it needs "
            "`pip install belayer-router[chat]` (transformers)"
        ) from error
    try:
        inner = transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError) as error:
        raise TokenizerError(f"cannot load the tokenizer folder {folder}: {error}") from error
    end = {inner.eos_token_id} if inner.eos_token_id is not None else set()
    for name in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>"):
        token_id = inner.convert_tokens_to_ids(name)
        if isinstance(token_id, int) and token_id != inner.unk_token_id and name in inner.get_vocab():
            end.add(token_id)
    return ChatTemplateTokenizer(inner, tuple(sorted(end)))


def _has_chat_template(folder: Path) -> bool:
    config = folder / "tokenizer_config.json"
    if (folder / "chat_template.jinja").is_file():
        return True
    if not config.is_file():
        return False
    try:
        return bool(json.loads(config.read_text()).get("chat_template"))
    except (OSError, ValueError) as error:
        raise TokenizerError(f"{config} is not readable JSON: {error}") from error


def load_tokenizer(spec: str | Path) -> Tokenizer:
    """``"bytes"`` for `ByteTokenizer`; a tokenizer folder or a ``tokenizer.json`` file otherwise.

    A folder with a chat template gives a `ChatTemplateTokenizer` (transformers); a bare
    ``tokenizer.json`` a `HuggingFaceTokenizer` (the ``tokenizers`` library), good for text
    prompts only.
    """
    if spec == "bytes":
        return ByteTokenizer()
    path = Path(spec)
    if path.is_dir():
        if _has_chat_template(path):
            return _load_chat_folder(path)
        path = path / "tokenizer.json"
    if not path.is_file():
        raise TokenizerError(
            f"tokenizer {str(spec)!r}: give 'bytes', a tokenizer folder or a tokenizer.json file"
        )
    try:
        import tokenizers
    except ImportError as error:
        raise TokenizerError("loading a tokenizer.json needs `pip install tokenizers`") from error
    try:
        return HuggingFaceTokenizer(tokenizers.Tokenizer.from_file(str(path)))
    except Exception as error:  # tokenizers raises a bare Exception for a malformed file
        raise TokenizerError(f"cannot load {path}: {error}") from error
