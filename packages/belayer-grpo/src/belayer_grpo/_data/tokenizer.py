"""Tokenizers for the policy: a character tokenizer for generated tasks, or a local HF tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import attrs

from belayer_grpo._errors import DataError

__all__ = [
    "ARITHMETIC_ALPHABET",
    "BytePolicyTokenizer",
    "CharTokenizer",
    "HuggingFacePolicyTokenizer",
    "PolicyTokenizer",
]

ARITHMETIC_ALPHABET = "0123456789+-*= ?"
_SPECIALS = ("<pad>", "<bos>", "<eos>")


class PolicyTokenizer(Protocol):
    """What training needs from a tokenizer."""

    @property
    def vocab_size(self) -> int:
        """Number of token ids (the model's vocabulary must be at least this large)."""
        ...

    @property
    def eos_token_id(self) -> int:
        """The id that ends a completion."""
        ...

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a prompt, with whatever start token the model expects."""
        ...

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without special tokens."""
        ...

    def decode(self, token_ids: list[int]) -> str:
        """Text of ``token_ids`` without special tokens."""
        ...


@attrs.frozen
class CharTokenizer:
    """One id per character of ``alphabet``, after ``<pad>`` (0), ``<bos>`` (1) and ``<eos>`` (2)."""

    alphabet: str = ARITHMETIC_ALPHABET

    def __attrs_post_init__(self) -> None:
        if len(set(self.alphabet)) != len(self.alphabet) or not self.alphabet:
            raise DataError(f"the alphabet {self.alphabet!r} must be non-empty without repeated characters")

    @property
    def vocab_size(self) -> int:
        """Specials plus the alphabet."""
        return len(_SPECIALS) + len(self.alphabet)

    @property
    def pad_token_id(self) -> int:
        """``<pad>``."""
        return 0

    @property
    def bos_token_id(self) -> int:
        """``<bos>``."""
        return 1

    @property
    def eos_token_id(self) -> int:
        """``<eos>``."""
        return 2

    def encode(self, text: str) -> list[int]:
        """One id per character; a character outside the alphabet raises `DataError`."""
        try:
            return [len(_SPECIALS) + self.alphabet.index(char) for char in text]
        except ValueError:
            bad = sorted(set(text) - set(self.alphabet))
            raise DataError(
                f"characters {bad} are not in the tokenizer's alphabet {self.alphabet!r}"
            ) from None

    def encode_prompt(self, text: str) -> list[int]:
        """``<bos>`` then the characters."""
        return [self.bos_token_id, *self.encode(text)]

    def decode(self, token_ids: list[int]) -> str:
        """Characters of the ids; special ids and ids outside the vocabulary are dropped."""
        offset = len(_SPECIALS)
        return "".join(
            self.alphabet[i - offset] for i in token_ids if offset <= i < offset + len(self.alphabet)
        )


@attrs.frozen
class BytePolicyTokenizer:
    """UTF-8 bytes as ids 0..255 (belayer-router's `ByteTokenizer`), then ``<eos>`` (256).

    For the agentic workload with a fresh model: task texts, shell commands and observations are
    arbitrary text, which no fixed alphabet covers.  The model's vocabulary is 257.
    """

    @property
    def vocab_size(self) -> int:
        """256 bytes plus ``<eos>``."""
        return 257

    @property
    def eos_token_id(self) -> int:
        """``<eos>``, the one id that is not a byte."""
        return 256

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of ``text``."""
        from belayer_router import ByteTokenizer

        return ByteTokenizer().encode(text)

    def encode_prompt(self, text: str) -> list[int]:
        """The bytes of the prompt (no begin-of-sequence token)."""
        return self.encode(text)

    def decode(self, token_ids: list[int]) -> str:
        """Text of the byte ids; ``<eos>`` is dropped, broken UTF-8 becomes U+FFFD."""
        from belayer_router import ByteTokenizer

        return ByteTokenizer().decode([t for t in token_ids if t < 256])


@attrs.frozen
class HuggingFacePolicyTokenizer:
    """A tokenizer from a local Hugging Face model directory (no hub access)."""

    inner: Any

    @classmethod
    def from_directory(cls, path: str | Path) -> HuggingFacePolicyTokenizer:
        """Load with ``transformers.AutoTokenizer`` from a local folder only."""
        from transformers import AutoTokenizer

        if not Path(path).is_dir():
            raise DataError(f"model path {str(path)!r} is not a directory holding a Hugging Face model")
        try:
            return cls(AutoTokenizer.from_pretrained(str(path), local_files_only=True))
        except (OSError, ValueError) as error:
            raise DataError(f"cannot load a tokenizer from {str(path)!r}: {error}") from error

    @property
    def vocab_size(self) -> int:
        """``len(tokenizer)``, added tokens included."""
        return len(self.inner)

    @property
    def eos_token_id(self) -> int:
        """The tokenizer's end-of-sequence id."""
        eos = self.inner.eos_token_id
        if eos is None:
            raise DataError("the tokenizer has no eos token; completions could never stop")
        return int(eos)

    def encode(self, text: str) -> list[int]:
        """Ids without special tokens."""
        return list(self.inner.encode(text, add_special_tokens=False))

    def encode_prompt(self, text: str) -> list[int]:
        """The chat template as a user turn when the tokenizer has one, else the plain ids."""
        if getattr(self.inner, "chat_template", None):
            ids = self.inner.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
            )
            return [int(i) for i in ids]
        return self.encode(text)

    def decode(self, token_ids: list[int]) -> str:
        """Text without special tokens."""
        return str(self.inner.decode(token_ids, skip_special_tokens=True))
