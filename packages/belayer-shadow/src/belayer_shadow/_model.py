"""The Qwen3 decoder as a function of externally owned tensors (weights and paged KV cache)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs
import torch
import torch.nn.functional as F

from belayer_shadow._config import ModelConfig, parameter_shapes
from belayer_shadow._errors import WeightsError
from belayer_shadow._layers import AttentionMetadata, RotaryEmbedding, paged_attention, rms_norm, swiglu

__all__ = ["Qwen3Model", "check_params", "torch_dtype"]


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype called `name` ("float32", "bfloat16", ...)."""
    dtype = getattr(torch, name)
    assert isinstance(dtype, torch.dtype)
    return dtype


def check_params(config: ModelConfig, params: Mapping[str, torch.Tensor]) -> None:
    """Raise WeightsError unless `params` holds every parameter of `config` with its shape and dtype."""
    expected = parameter_shapes(config)
    missing = sorted(set(expected) - set(params))
    if missing:
        raise WeightsError(
            f"{len(missing)} parameters missing, e.g. {missing[:3]}; do the weights fit the config?"
        )
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


class Qwen3Model:
    """`Qwen3ForCausalLM`'s forward pass over weights it only references (zero copy)."""

    def __init__(self, config: ModelConfig, params: Mapping[str, torch.Tensor], device: torch.device) -> None:
        self.config = config
        self.device = device
        self.rotary = RotaryEmbedding(
            config.head_dim, config.rope_theta, config.max_position_embeddings, torch_dtype(config.dtype)
        )
        self.rotary.cos = self.rotary.cos.to(device)
        self.rotary.sin = self.rotary.sin.to(device)
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
        self.layers = [
            _Layer(*(params[f"model.layers.{i}.{name}.weight"] for name in _LAYER_PARAMS))
            for i in range(self.config.num_hidden_layers)
        ]

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
        hidden = F.embedding(input_ids, self.embed)
        num_tokens = input_ids.shape[0]
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            x = rms_norm(hidden, layer.input_norm, c.rms_norm_eps)
            q = F.linear(x, layer.q_proj).view(num_tokens, c.num_attention_heads, c.head_dim)
            k = F.linear(x, layer.k_proj).view(num_tokens, c.num_key_value_heads, c.head_dim)
            v = F.linear(x, layer.v_proj).view(num_tokens, c.num_key_value_heads, c.head_dim)
            q = self.rotary(rms_norm(q, layer.q_norm, c.rms_norm_eps), positions)
            k = self.rotary(rms_norm(k, layer.k_norm, c.rms_norm_eps), positions)
            attn = paged_attention(q, k, v, k_cache, v_cache, meta)
            hidden = hidden + F.linear(attn, layer.o_proj)
            x = rms_norm(hidden, layer.post_norm, c.rms_norm_eps)
            hidden = hidden + swiglu(x, layer.gate_proj, layer.up_proj, layer.down_proj)
        last = rms_norm(hidden[logit_indices], self.norm, c.rms_norm_eps)
        return F.linear(last, self.lm_head)


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
