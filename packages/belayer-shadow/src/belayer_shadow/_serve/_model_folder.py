"""`ModelFolder`: what `serve` reads from a Hugging Face model folder, checked before anything starts."""

from __future__ import annotations

import json
from pathlib import Path

import attrs

from belayer_shadow._engine._config import ModelConfig
from belayer_shadow._errors import ModelConfigError, UnsupportedModelError, WeightsError

__all__ = ["SUPPORTED_ARCHITECTURES", "ModelFolder"]

# What both engines serve: the weight server's table is `weight_layout`'s Qwen3 decoder.
SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM",)
_SUPPORTED_MODEL_TYPES = ("qwen3",)


@attrs.frozen
class ModelFolder:
    """A local model folder: `config.json`, `*.safetensors` (one file or shards), and optionally a
    tokenizer (`tokenizer.json`, `tokenizer_config.json` with a chat template)."""

    path: Path
    config: ModelConfig
    has_tokenizer: bool

    @classmethod
    def inspect(cls, path: str | Path) -> ModelFolder:
        """Read and check the folder: ModelConfigError (UnsupportedModelError for another
        architecture) or WeightsError, each naming the file and what to do."""
        folder = Path(path)
        if not folder.is_dir():
            raise ModelConfigError(
                f"model folder {str(folder)!r} does not exist or is not a folder; "
                "give a local Hugging Face model folder (config.json, *.safetensors, tokenizer)"
            )
        config_file = folder / "config.json"
        try:
            data = json.loads(config_file.read_text())
        except OSError as exc:
            raise ModelConfigError(f"cannot read {str(config_file)!r}: {exc}") from exc
        except ValueError as exc:
            raise ModelConfigError(f"{str(config_file)!r} is not valid JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise ModelConfigError(f"{str(config_file)!r} must hold a JSON object")
        check_architecture(data, config_file)
        config = ModelConfig.from_dict(data)
        if not sorted(folder.glob("*.safetensors")):
            raise WeightsError(
                f"no *.safetensors file in {str(folder)!r}; save the model with "
                "save_pretrained(..., safe_serialization=True)"
            )
        has_tokenizer = (folder / "tokenizer.json").is_file() or (folder / "tokenizer_config.json").is_file()
        return cls(path=folder, config=config, has_tokenizer=has_tokenizer)


def check_architecture(data: dict[str, object], source: Path) -> None:
    """UnsupportedModelError unless the config names a supported architecture (or model type)."""
    architectures = data.get("architectures")
    model_type = data.get("model_type")
    named = [str(a) for a in architectures] if isinstance(architectures, list) and architectures else []
    if named:
        unsupported = [a for a in named if a not in SUPPORTED_ARCHITECTURES]
        if not unsupported:
            return
        what = unsupported[0]
    elif model_type in _SUPPORTED_MODEL_TYPES:
        return
    else:
        what = f"model_type {model_type!r}" if model_type is not None else "an unnamed architecture"
    raise UnsupportedModelError(
        f"{source}: {what} cannot be served; belayer-shadow serves {list(SUPPORTED_ARCHITECTURES)} "
        f"(model_type {list(_SUPPORTED_MODEL_TYPES)})"
    )
