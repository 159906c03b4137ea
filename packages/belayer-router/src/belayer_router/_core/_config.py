"""`RouterConfig`: everything a router is configured with."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import attrs

from belayer_router._core._journal_file import DURABILITY_MODES, Durability
from belayer_router._core._tokenizer import Tokenizer

__all__ = ["RouterConfig", "api_keys_from"]


def _config_alias(config: RouterConfig, old: str, new: str) -> None:
    value = getattr(config, old)
    if value is not None:  # the pre-0.2 spelling wins when given: callers that still use it
        object.__setattr__(config, new, value)


def _key_tuple(keys: Iterable[str]) -> tuple[str, ...]:
    return tuple(keys)


def api_keys_from(flag: Iterable[str] | None) -> tuple[str, ...]:
    """The API keys of an ``--api-key`` flag, else of ``$VLLM_API_KEY`` (as ``vllm serve``: the flag
    wins); empty when neither names one (no key needed)."""
    keys = list(flag or []) or [os.environ.get("VLLM_API_KEY", "")]
    return tuple(key for key in keys if key)


def _api_keys(_inst: object, _attr: object, value: tuple[str, ...]) -> None:
    for key in value:
        if not isinstance(key, str) or not key or key != key.strip() or any(c.isspace() for c in key):
            raise ValueError(
                f"RouterConfig.api_keys: an API key must be a non-empty string without spaces, got {key!r}"
            )


def _optional_seed(_inst: object, _attr: object, value: int | None) -> None:
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**63
    ):
        raise ValueError(f"RouterConfig.seed must be an int in [0, 2**63) or None, got {value!r}")


@attrs.frozen
class RouterConfig:
    """Everything a router is configured with; the CLI flags map one to one.

    ``max_body_bytes`` caps every request body (413 past it), ``max_prompt_tokens`` a prompt's
    length (400), ``max_choices`` the choices of one OpenAI request (``n`` times the prompts).
    ``resume_wait`` and ``worker_read_timeout`` are the old spellings of the ``*_s`` fields,
    still accepted (they win when given) until the next minor release.
    """

    admin_token: str | None = None
    journal_path: Path | None = None
    prefix_interval: int = attrs.field(default=256, validator=attrs.validators.ge(1))
    resume_wait_s: float = attrs.field(default=5.0, validator=attrs.validators.ge(0))
    worker_read_timeout_s: float = attrs.field(default=120.0, validator=attrs.validators.gt(0))
    fsync: bool = False  # the old spelling of durability="fsync"
    durability: Durability = attrs.field(default="none", validator=attrs.validators.in_(DURABILITY_MODES))
    tokenizer: Tokenizer | None = None
    model_name: str = "belayer"
    max_body_bytes: int = attrs.field(default=8 * 1024 * 1024, validator=attrs.validators.ge(1024))
    max_prompt_tokens: int = attrs.field(default=131_072, validator=attrs.validators.ge(1))
    max_choices: int = attrs.field(default=64, validator=attrs.validators.ge(1))
    default_max_tokens: int = attrs.field(default=4096, validator=attrs.validators.ge(1))
    # `vllm serve --api-key`: with any, every route but /health needs `Authorization: Bearer <key>`
    # (one of these, or the admin token); 401 otherwise. Empty: no check (the admin routes keep theirs).
    api_keys: tuple[str, ...] = attrs.field(default=(), converter=_key_tuple, validator=_api_keys)
    # `vllm serve --seed`: requests without a seed get one derived from it and their body
    # (`_seeds.SeedSource`); None: a random seed each.
    seed: int | None = attrs.field(default=None, validator=_optional_seed)
    resume_wait: float | None = attrs.field(default=None, kw_only=True)
    worker_read_timeout: float | None = attrs.field(default=None, kw_only=True)

    def __attrs_post_init__(self) -> None:
        _config_alias(self, "resume_wait", "resume_wait_s")
        _config_alias(self, "worker_read_timeout", "worker_read_timeout_s")
