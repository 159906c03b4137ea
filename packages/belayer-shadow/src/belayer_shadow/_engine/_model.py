"""The Qwen3 decoder as a function of externally owned tensors (weights and paged KV cache)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs
import torch
import torch.nn.functional as F

from belayer_shadow._engine._config import ModelConfig, fused_projections, parameter_shapes
from belayer_shadow._engine._layers import (
    AttentionMetadata,
    RotaryEmbedding,
    paged_attention,
    rms_norm,
    swiglu,
)
from belayer_shadow._errors import WeightsError

__all__ = ["Qwen3Model", "check_params", "merged_shapes", "outside_region", "stacked_view", "torch_dtype"]


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype called `name` ("float32", "bfloat16", ...)."""
    dtype = getattr(torch, name)
    assert isinstance(dtype, torch.dtype)
    return dtype


def merged_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The merged projections (`qkv_proj`, `gate_up_proj` of every layer) and their shapes."""
    shapes = parameter_shapes(config)
    return {
        spec.name: (sum(shapes[p][0] for p in spec.parts), shapes[spec.parts[0]][1])
        for spec in fused_projections(config)
    }


def check_params(config: ModelConfig, params: Mapping[str, torch.Tensor]) -> None:
    """Raise WeightsError unless `params` holds every parameter of `config` with its shape and dtype
    (merged projections, the weight server's views over their parts, may be given too)."""
    expected = parameter_shapes(config)
    missing = sorted(set(expected) - set(params))
    if missing:
        raise WeightsError(
            f"{len(missing)} parameters missing, e.g. {missing[:3]}; do the weights fit the config?"
        )
    merged = merged_shapes(config)
    expected.update({name: shape for name, shape in merged.items() if name in params})
    allowed = set(expected) | {"lm_head.weight"}
    extra = sorted(set(params) - allowed)
    if extra:
        raise WeightsError(f"unexpected parameters {extra[:3]}; do the weights fit the config?")
    dtype = torch_dtype(config.dtype)
    for name, shape in expected.items():
        tensor = params[name]
        if tuple(tensor.shape) != shape:
            raise WeightsError(f"{name} has shape {tuple(tensor.shape)}, the config wants {shape}")
        if tensor.dtype != dtype:
            raise WeightsError(f"{name} is {tensor.dtype}, the config wants {config.dtype}")


def stacked_view(parts: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """One (sum of rows, cols) view over 2-D tensors that lie back to back in memory, else None.

    The weight server's layout packs q/k/v and gate/up projections back to back, so each layer
    needs two matmuls fewer, without copying a byte.
    """
    first = parts[0]
    cols = first.shape[1]
    address = first.data_ptr()
    storage = first.untyped_storage().data_ptr()
    for part in parts:
        if (
            part.dim() != 2
            or part.shape[1] != cols
            or not part.is_contiguous()
            or part.dtype != first.dtype
            or part.untyped_storage().data_ptr() != storage
            or part.data_ptr() != address
        ):
            return None
        address += part.numel() * part.element_size()
    rows = sum(part.shape[0] for part in parts)
    return torch.as_strided(first, (rows, cols), (cols, 1), first.storage_offset())


def outside_region(params: Mapping[str, torch.Tensor], region: torch.Tensor) -> list[str]:
    """The names in `params` whose bytes do not all lie inside `region` (the weight server's
    mapping in this process): private copies of a weight, where the design wants views."""
    start = region.data_ptr()
    end = start + region.numel() * region.element_size()
    outside = []
    for name, tensor in params.items():
        if not tensor.numel():
            continue
        first = tensor.data_ptr()
        span = sum(
            (size - 1) * abs(stride) for size, stride in zip(tensor.shape, tensor.stride(), strict=True)
        )
        if not start <= first or first + (span + 1) * tensor.element_size() > end:
            outside.append(name)
    return sorted(outside)


@attrs.frozen
class _Layer:
    input_norm: torch.Tensor
    q_proj: torch.Tensor
    k_proj: torch.Tensor
    v_proj: torch.Tensor
    o_proj: torch.Tensor
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    post_norm: torch.Tensor
    gate_proj: torch.Tensor
    up_proj: torch.Tensor
    down_proj: torch.Tensor
    qkv_proj: torch.Tensor | None = attrs.field(init=False)
    gate_up_proj: torch.Tensor | None = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "qkv_proj", stacked_view((self.q_proj, self.k_proj, self.v_proj)))
        object.__setattr__(self, "gate_up_proj", stacked_view((self.gate_proj, self.up_proj)))

    @classmethod
    def of(cls, params: Mapping[str, torch.Tensor], index: int) -> _Layer:
        """Layer `index` of `params`; its fused matmuls read the weight server's merged views
        (`qkv_proj`, `gate_up_proj` of its layout) when `params` has them."""
        prefix = f"model.layers.{index}."
        layer = cls(*(params[f"{prefix}{name}.weight"] for name in _LAYER_PARAMS))
        for field, merged in (("qkv_proj", "self_attn.qkv_proj"), ("gate_up_proj", "mlp.gate_up_proj")):
            view = params.get(f"{prefix}{merged}.weight")
            if view is not None:
                object.__setattr__(layer, field, view)
        return layer


class Qwen3Model:
    """`Qwen3ForCausalLM`'s forward pass over weights it only references (zero copy)."""

    def __init__(self, config: ModelConfig, params: Mapping[str, torch.Tensor], device: torch.device) -> None:
        self.config = config
        self.device = device
        rotary = RotaryEmbedding(
            config.head_dim, config.rope_theta, config.max_position_embeddings, torch_dtype(config.dtype)
        )
        self.rotary = rotary.to(device)
        self.bind(params)

    def bind(self, params: Mapping[str, torch.Tensor]) -> None:
        """Use `params` from now on (after a weight update); no tensor is copied."""
        check_params(self.config, params)
        for name, tensor in params.items():
            if tensor.device != self.device:
                raise WeightsError(f"{name} is on {tensor.device}, the engine runs on {self.device}")
        self.embed = params["model.embed_tokens.weight"]
        self.norm = params["model.norm.weight"]
        tied = self.config.tie_word_embeddings
        self.lm_head = self.embed if tied else params["lm_head.weight"]
        self.layers = [_Layer.of(params, i) for i in range(self.config.num_hidden_layers)]

    def named_weights(self) -> dict[str, torch.Tensor]:
        """Every weight tensor the forward pass reads (the merged projections it uses included)."""
        weights = {
            "model.embed_tokens.weight": self.embed,
            "model.norm.weight": self.norm,
            "lm_head": self.lm_head,
        }
        for i, layer in enumerate(self.layers):
            for field in attrs.fields(_Layer):
                value = getattr(layer, field.name)
                if isinstance(value, torch.Tensor):
                    weights[f"model.layers.{i}.{field.name}"] = value
        return weights

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        logit_indices: torch.Tensor,
    ) -> torch.Tensor:
        """Logits (len(logit_indices), vocab) of the tokens at `logit_indices`, storing K/V on the way."""
        c = self.config
        eps = c.rms_norm_eps
        hidden = F.embedding(input_ids, self.embed)
        rotary = self.rotary.tables(positions)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            q, k, v = self._qkv(layer, rms_norm(hidden, layer.input_norm, eps))
            q = self.rotary.apply(rms_norm(q, layer.q_norm, eps), rotary)
            k = self.rotary.apply(rms_norm(k, layer.k_norm, eps), rotary)
            attn = paged_attention(q, k, v, k_cache, v_cache, meta)
            hidden = hidden + F.linear(attn, layer.o_proj)
            x = rms_norm(hidden, layer.post_norm, eps)
            if layer.gate_up_proj is not None:
                hidden = hidden + swiglu(x, layer.gate_up_proj, layer.down_proj)
            else:
                gated = F.silu(F.linear(x, layer.gate_proj)) * F.linear(x, layer.up_proj)
                hidden = hidden + F.linear(gated, layer.down_proj)
        last = rms_norm(hidden[logit_indices], self.norm, eps)
        return F.linear(last, self.lm_head)

    def _qkv(self, layer: _Layer, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        c = self.config
        num_tokens = x.shape[0]
        if layer.qkv_proj is not None:
            qkv = F.linear(x, layer.qkv_proj)
            nq, nk = layer.q_proj.shape[0], layer.k_proj.shape[0]
            q, k, v = qkv[:, :nq], qkv[:, nq : nq + nk], qkv[:, nq + nk :]
        else:
            q, k, v = F.linear(x, layer.q_proj), F.linear(x, layer.k_proj), F.linear(x, layer.v_proj)
        return (
            q.reshape(num_tokens, c.num_attention_heads, c.head_dim),
            k.reshape(num_tokens, c.num_key_value_heads, c.head_dim),
            v.reshape(num_tokens, c.num_key_value_heads, c.head_dim),
        )


_LAYER_PARAMS = (
    "input_layernorm",
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "self_attn.q_norm",
    "self_attn.k_norm",
    "post_attention_layernorm",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
