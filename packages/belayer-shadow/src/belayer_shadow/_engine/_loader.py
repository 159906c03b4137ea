"""Where weights and tokenizers come from: a seeded init, safetensors files, the weight server."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from belayer_gpumem import WeightClient
from belayer_router import Tokenizer
from belayer_router import load_tokenizer as _router_load_tokenizer
from belayer_shadow._engine._config import ModelConfig, parameter_shapes
from belayer_shadow._engine._model import torch_dtype
from belayer_shadow._errors import ModelConfigError, WeightsError

__all__ = ["fill_weight_server", "init_weights", "load_safetensors", "load_tokenizer", "save_safetensors"]

# Scales of the seeded init: activations of order one and logits with a few units of spread, so
# greedy and sampled outputs differ and are not dominated by ties.
_EMBED_STD = 0.25
_NORM_NOISE = 0.1


def init_weights(config: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """A seeded random init of every parameter (same seed, same config -> same bytes), on the CPU."""
    generator = torch.Generator().manual_seed(seed)
    dtype = torch_dtype(config.dtype)
    weights: dict[str, torch.Tensor] = {}
    for name, shape in parameter_shapes(config).items():
        noise = torch.randn(shape, generator=generator, dtype=torch.float32)
        if name.endswith("norm.weight"):
            value = 1.0 + _NORM_NOISE * noise
        elif name == "model.embed_tokens.weight" or name == "lm_head.weight":
            value = _EMBED_STD * noise
        else:
            value = noise / shape[1] ** 0.5
        weights[name] = value.to(dtype)
    return weights


def load_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file, or of every `*.safetensors` file in a folder (shards)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files or not all(f.is_file() for f in files):
        raise WeightsError(
            f"no safetensors file at {str(path)!r}; give a .safetensors file or a folder of them"
        )
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            tensors.update(load_file(str(file)))
        except (SafetensorError, OSError) as exc:
            raise WeightsError(f"cannot read {str(file)!r}: {exc}") from exc
    return tensors


def save_safetensors(tensors: Mapping[str, torch.Tensor], path: str | Path) -> None:
    """Write tensors to a safetensors file (e.g. a seeded init, for a weight server's --safetensors)."""
    from safetensors.torch import save_file

    save_file({name: t.contiguous() for name, t in tensors.items()}, str(path))


def fill_weight_server(weights_socket: str | Path, tensors: Mapping[str, torch.Tensor]) -> int:
    """Write `tensors` into the weight server as one atomic update; returns the new version.

    Every tensor of the server's table must be given with its shape (values are cast to its
    dtype); `lm_head.weight` may be given extra (tied embeddings). Raises WeightsError otherwise.
    """
    client = WeightClient.attach(weights_socket)
    try:
        table = client.layout.by_name
        missing = sorted(set(table) - set(tensors))
        extra = sorted(set(tensors) - set(table) - {"lm_head.weight"})
        if missing or extra:
            raise WeightsError(
                f"tensors do not match the weight server's table: missing {missing[:3]}, unexpected {extra[:3]}"
            )
        for name, spec in table.items():
            if tuple(tensors[name].shape) != spec.shape:
                raise WeightsError(
                    f"{name} has shape {tuple(tensors[name].shape)}, the server's table {spec.shape}"
                )
        with client.update() as update:
            for name, view in update.tensors().items():
                view.copy_(tensors[name])
            return update.commit()
    finally:
        client.detach()


def load_tokenizer(spec: str | Path | None = None) -> Tokenizer:
    """The tokenizer for a model: None or "bytes" -> belayer_router's ByteTokenizer (the default
    model's ids 0..255), else a local HF tokenizer folder or `tokenizer.json` file."""
    text = "bytes" if spec is None else str(spec)
    try:
        return _router_load_tokenizer(text)
    except Exception as exc:  # the tokenizers library raises its own bare Exception on bad files
        raise ModelConfigError(f"cannot load tokenizer {text!r}: {exc}") from exc
