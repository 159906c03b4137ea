"""The model configuration and the memory-server layouts it implies."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from belayer_gpumem import FusedSpec, KVLayout, WeightLayout
from belayer_shadow._errors import ModelConfigError

if TYPE_CHECKING:
    from transformers import Qwen3Config

__all__ = [
    "FUSED_PROJECTIONS",
    "ModelConfig",
    "fused_projections",
    "kv_layout",
    "parameter_shapes",
    "weight_layout",
]

_FLOAT_DTYPES = ("float32", "float16", "bfloat16")


def _positive(_inst: object, attr: attrs.Attribute[int], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ModelConfigError(f"ModelConfig.{attr.name} must be a positive int, got {value!r}")


def _positive_float(_inst: object, attr: attrs.Attribute[float], value: float) -> None:
    if not isinstance(value, int | float) or not value > 0:
        raise ModelConfigError(f"ModelConfig.{attr.name} must be a positive number, got {value!r}")


def _float_dtype(_inst: object, _attr: object, value: str) -> None:
    if value not in _FLOAT_DTYPES:
        raise ModelConfigError(f"ModelConfig.dtype must be one of {_FLOAT_DTYPES}, got {value!r}")


@attrs.frozen
class ModelConfig:
    """Shape of a Qwen3-architecture decoder (the fields of `transformers.Qwen3Config` we use)."""

    vocab_size: int = attrs.field(validator=_positive)
    hidden_size: int = attrs.field(validator=_positive)
    intermediate_size: int = attrs.field(validator=_positive)
    num_hidden_layers: int = attrs.field(validator=_positive)
    num_attention_heads: int = attrs.field(validator=_positive)
    num_key_value_heads: int = attrs.field(validator=_positive)
    head_dim: int = attrs.field(validator=_positive)
    rms_norm_eps: float = attrs.field(default=1e-6, converter=float, validator=_positive_float)
    rope_theta: float = attrs.field(default=1_000_000.0, converter=float, validator=_positive_float)
    max_position_embeddings: int = attrs.field(default=4096, validator=_positive)
    tie_word_embeddings: bool = True
    dtype: str = attrs.field(default="float32", validator=_float_dtype)

    def __attrs_post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ModelConfigError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")

    @classmethod
    def default(cls) -> ModelConfig:
        """The small built-in model: fast on two CPU cores; ids 0..255 are ByteTokenizer's bytes."""
        return cls(
            vocab_size=512,
            hidden_size=128,
            intermediate_size=384,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
        )

    @property
    def num_query_groups(self) -> int:
        """Query heads per key/value head."""
        return self.num_attention_heads // self.num_key_value_heads

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict (the inverse of `from_dict`)."""
        return attrs.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelConfig:
        """Build from `to_dict()` output or an HF `config.json` dict; unknown keys are ignored."""
        if not isinstance(data, Mapping):
            raise ModelConfigError(f"a model configuration must be a JSON object, got {type(data).__name__}")
        values = dict(data)
        # HF config.json spellings.
        if "dtype" not in values and "torch_dtype" in values:
            values["dtype"] = values["torch_dtype"]
        if values.get("dtype") is None:
            values.pop("dtype", None)
        rope = values.get("rope_parameters") or values.get("rope_scaling")
        if isinstance(rope, Mapping):
            if rope.get("rope_type", rope.get("type", "default")) != "default":
                raise ModelConfigError(
                    f"only plain rotary embeddings are supported, not rope scaling {rope!r}"
                )
            values.setdefault("rope_theta", rope.get("rope_theta", 1_000_000.0))
        if values.get("use_sliding_window"):
            raise ModelConfigError(
                "sliding-window attention is not supported; set use_sliding_window to false"
            )
        if "head_dim" not in values and "hidden_size" in values and "num_attention_heads" in values:
            values["head_dim"] = values["hidden_size"] // values["num_attention_heads"]
        if "num_key_value_heads" not in values and "num_attention_heads" in values:
            values["num_key_value_heads"] = values["num_attention_heads"]
        names = [f.name for f in attrs.fields(cls)]
        try:
            return cls(**{name: values[name] for name in names if name in values})
        except TypeError as exc:
            raise ModelConfigError(f"incomplete model configuration ({exc}); required: {names[:7]}") from exc

    @classmethod
    def from_json_file(cls, path: str | Path) -> ModelConfig:
        """Read a JSON file written from `to_dict()`, an HF `config.json`, or an HF model folder."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            data = json.loads(path.read_text())
        except OSError as exc:
            raise ModelConfigError(f"cannot read model configuration {str(path)!r}: {exc}") from exc
        except ValueError as exc:
            raise ModelConfigError(f"model configuration {str(path)!r} is not valid JSON: {exc}") from exc
        return cls.from_dict(data)

    @classmethod
    def from_hf(cls, hf: Qwen3Config) -> ModelConfig:
        """From a `transformers.Qwen3Config`."""
        return cls.from_dict(hf.to_dict())

    def to_hf(self) -> Qwen3Config:
        """A `transformers.Qwen3Config` with the same shape (sliding window off, no attention bias)."""
        from transformers import Qwen3Config

        # Passed as a dict: transformers 5 renamed these two (rope_parameters, dtype) but still
        # accepts the names that 4.51 knows.
        legacy: dict[str, Any] = {"rope_theta": self.rope_theta, "torch_dtype": self.dtype}
        return Qwen3Config(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=self.tie_word_embeddings,
            attention_bias=False,
            use_sliding_window=False,
            hidden_act="silu",
            **legacy,
        )


def parameter_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter's name (as in `Qwen3ForCausalLM.state_dict()`) and shape, in a fixed order."""
    h, kv, hd = config.hidden_size, config.num_key_value_heads, config.head_dim
    q = config.num_attention_heads * hd
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (q, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv * hd, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv * hd, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, q)
        shapes[p + "self_attn.q_norm.weight"] = (hd,)
        shapes[p + "self_attn.k_norm.weight"] = (hd,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "mlp.gate_proj.weight"] = (config.intermediate_size, h)
        shapes[p + "mlp.up_proj.weight"] = (config.intermediate_size, h)
        shapes[p + "mlp.down_proj.weight"] = (h, config.intermediate_size)
    shapes["model.norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    return shapes


# The merged projections the engines read (vLLM's parameter names): each one region of the weight
# server over its parts, which writers still write by their Hugging Face names.
FUSED_PROJECTIONS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def fused_projections(config: ModelConfig) -> list[FusedSpec]:
    """Every layer's merged `qkv_proj` and `gate_up_proj` weight, over its parts' table names."""
    return [
        FusedSpec(f"model.layers.{i}.{merged}.weight", [f"model.layers.{i}.{part}.weight" for part in parts])
        for i in range(config.num_hidden_layers)
        for merged, parts in FUSED_PROJECTIONS.items()
    ]


def weight_layout(config: ModelConfig) -> WeightLayout:
    """The weight server's table for `config` (no `lm_head.weight` when embeddings are tied), in the
    layout the engines read: each layer's q|k|v and gate|up back to back with no gap, declared as
    the merged tensors `qkv_proj` and `gate_up_proj` (`fused_projections`), so that vLLM's merged
    parameters and the built-in engine's fused matmuls are views of the server, never copies."""
    entries = ((name, config.dtype, shape) for name, shape in parameter_shapes(config).items())
    return WeightLayout.pack(entries, fused_projections(config))


def kv_layout(config: ModelConfig, num_blocks: int, block_size: int) -> KVLayout:
    """The KV server's paged arena for `config`: `num_blocks` blocks of `block_size` positions."""
    return KVLayout(
        num_blocks=num_blocks,
        num_layers=config.num_hidden_layers,
        block_size=block_size,
        num_kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        dtype=config.dtype,
    )
