"""`ServeConfig`: everything `belayer-shadow serve` is started with; its flags map to it one to one."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import attrs

if TYPE_CHECKING:
    from belayer_router import RouterConfig
    from belayer_shadow._serve._model_folder import ModelFolder

__all__ = ["ServeConfig"]


def _key_tuple(keys: Iterable[str]) -> tuple[str, ...]:
    return tuple(keys)


def _optional_path(value: str | Path | None) -> Path | None:
    return None if value is None else Path(value)


def _optional_positive(_inst: object, attr: attrs.Attribute[int | None], value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"ServeConfig.{attr.name} must be a positive int, got {value!r}")


@attrs.frozen
class ServeConfig:
    """One machine's rollout service: the router on `host:port` and `num_slots` slots.

    Names follow `vllm serve` where the meaning is the same: `served_model_name` (default: the
    model path as given), `max_model_len` (the longest prompt the
    router accepts; it must fit the model and one slot's KV pool; default: the smaller of the two). `run_dir` holds the
    slots' sockets, logs and event logs; without one a temporary folder is made and removed at the
    end (also after a SIGKILL of the command). `backend="cuda"` puts slot `i` on GPU `i`.
    `api_keys` and `seed` are the router's (`RouterConfig.api_keys`, `.seed`): `--api-key`, `--seed`.
    """

    model_dir: Path = attrs.field(converter=Path)
    num_slots: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    engine: Literal["belayer", "vllm"] = attrs.field(
        default="belayer", validator=attrs.validators.in_(("belayer", "vllm"))
    )
    host: str = "127.0.0.1"
    port: int = attrs.field(default=8000, validator=[attrs.validators.ge(0), attrs.validators.le(65535)])
    served_model_name: str | None = None
    max_model_len: int | None = attrs.field(default=None, validator=_optional_positive)
    run_dir: Path | None = attrs.field(default=None, converter=_optional_path)
    recovery: Literal["shadow", "conventional", "restart"] = attrs.field(
        default="shadow", validator=attrs.validators.in_(("shadow", "conventional", "restart"))
    )
    backend: Literal["host", "cuda"] = attrs.field(
        default="host", validator=attrs.validators.in_(("host", "cuda"))
    )
    num_kv_blocks: int = attrs.field(default=512, validator=attrs.validators.ge(1))
    block_size: int = attrs.field(default=16, validator=attrs.validators.ge(1))
    max_num_seqs: int = attrs.field(default=64, validator=attrs.validators.ge(1))
    # A main worker whose heartbeat is older than this counts as hung (the shadow takes over).
    # Generous: on a loaded machine a busy worker must not pass for a hung one.
    hang_threshold_s: float = attrs.field(default=3.0, validator=attrs.validators.gt(0))
    resume_wait_s: float = attrs.field(default=30.0, validator=attrs.validators.ge(0))
    start_timeout_s: float = attrs.field(default=300.0, validator=attrs.validators.gt(0))
    router_server: str | None = None  # the router's HTTP server: uvicorn (default) or belayer
    # `vllm serve --api-key`: every route but /health then needs `Authorization: Bearer <key>`.
    api_keys: tuple[str, ...] = attrs.field(default=(), converter=_key_tuple)
    # `vllm serve --seed`: the seed of requests that name none, derived from it and the request
    # (belayer-router's `RouterConfig.seed`); None: a random seed each.
    seed: int | None = None
    # The router's journal (`RouterConfig.journal_path`): a router started again on it knows the
    # workers, epochs and the tokens already streamed, and resumes the requests cut by its death.
    journal: Path | None = attrs.field(default=None, converter=_optional_path)
    # Start each slot on the weights an earlier start of this service kept in its slot folder
    # (`SlotSupervisor.adopt_kept_weights`), at their version: set by `serve --keep-running` for
    # the service it starts again, so a restart does not go back to MODEL_DIR's weights.
    adopt_kept_weights: bool = False

    @property
    def model_name(self) -> str:
        """The name `/v1/models` lists and requests name."""
        return self.served_model_name or str(self.model_dir)

    def prompt_limit(self, model: ModelFolder) -> int:
        """`max_model_len` checked against the model and one slot's KV pool (`ModelConfigError`);
        without one, the model's length capped to one slot's KV pool."""
        from belayer_shadow._errors import ModelConfigError

        limit = model.config.max_position_embeddings
        capacity = self.num_kv_blocks * self.block_size
        if self.max_model_len is None:
            return min(limit, capacity)
        length = self.max_model_len
        if length > limit:
            raise ModelConfigError(
                f"--max-model-len {length} is longer than the model's max_position_embeddings ({limit})"
            )
        if length > capacity:
            raise ModelConfigError(
                f"one slot's KV pool holds {capacity} positions ({self.num_kv_blocks} blocks of "
                f"{self.block_size}), fewer than --max-model-len {length}: raise --num-kv-blocks to at "
                f"least {-(-length // self.block_size)} or lower --max-model-len"
            )
        return length

    def router_config(self, model: ModelFolder, admin_token: str) -> RouterConfig:
        """The router's settings for this service: the folder's tokenizer (if it has one), the
        served name, `prompt_limit`, `resume_wait_s`, `api_keys`, `seed` and the slots' token."""
        from belayer_router import RouterConfig
        from belayer_shadow._engine._loader import load_tokenizer

        limit = self.prompt_limit(model)  # a ModelConfigError before the tokenizer is read
        return RouterConfig(
            admin_token=admin_token,
            tokenizer=load_tokenizer(model.path) if model.has_tokenizer else None,
            model_name=self.model_name,
            max_prompt_tokens=limit,
            resume_wait_s=self.resume_wait_s,
            api_keys=self.api_keys,
            seed=self.seed,
            journal_path=self.journal,
        )

    def slot_options(self) -> dict[str, Any]:
        """The `SlotConfig` fields every slot of this service shares (all but `slot`,
        `router_url`, `run_dir`, `admin_token` and `device`)."""
        return {
            "model": self.model_dir,
            "weights": self.model_dir,
            "recovery": self.recovery,
            "backend": self.backend,
            "engine": self.engine,
            "num_kv_blocks": self.num_kv_blocks,
            "block_size": self.block_size,
            "max_num_seqs": self.max_num_seqs,
            "start_timeout_s": self.start_timeout_s,
            "stale_s": self.hang_threshold_s,
        }
