"""ModelConfig: validation, round trips through dicts, JSON files and transformers' Qwen3Config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from belayer_router import ByteTokenizer
from belayer_shadow import (
    ModelConfig,
    ModelConfigError,
    init_weights,
    kv_layout,
    load_safetensors,
    load_tokenizer,
    save_safetensors,
    weight_layout,
)
from belayer_shadow._engine._config import parameter_shapes


def test_round_trips() -> None:
    config = ModelConfig.default()
    assert ModelConfig.from_dict(config.to_dict()) == config
    assert ModelConfig.from_hf(config.to_hf()) == config
    untied = ModelConfig.from_dict(config.to_dict() | {"tie_word_embeddings": False, "dtype": "bfloat16"})
    assert ModelConfig.from_hf(untied.to_hf()) == untied


def test_from_json_file_reads_an_hf_model_folder(tmp_path: Path) -> None:
    config = ModelConfig.default()
    config.to_hf().save_pretrained(tmp_path)
    assert ModelConfig.from_json_file(tmp_path) == config
    (tmp_path / "ours.json").write_text(json.dumps(config.to_dict()))
    assert ModelConfig.from_json_file(tmp_path / "ours.json") == config


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"hidden_size": 0}, "hidden_size"),
        ({"num_key_value_heads": 3}, "multiple"),
        ({"head_dim": 31}, "even"),
        ({"dtype": "int8"}, "dtype"),
        ({"rms_norm_eps": -1.0}, "rms_norm_eps"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling"),
        ({"use_sliding_window": True}, "sliding"),
    ],
)
def test_invalid_configs_raise_config_error(change: dict[str, object], message: str) -> None:
    with pytest.raises(ModelConfigError, match=message):
        ModelConfig.from_dict(ModelConfig.default().to_dict() | change)


def test_unreadable_or_incomplete_config_files(tmp_path: Path) -> None:
    with pytest.raises(ModelConfigError, match="cannot read"):
        ModelConfig.from_json_file(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ModelConfigError, match="not valid JSON"):
        ModelConfig.from_json_file(tmp_path / "bad.json")
    (tmp_path / "short.json").write_text(json.dumps({"vocab_size": 10}))
    with pytest.raises(ModelConfigError, match="incomplete"):
        ModelConfig.from_json_file(tmp_path / "short.json")


def test_layouts_cover_every_parameter_and_the_kv_arena() -> None:
    config = ModelConfig.default()
    layout = weight_layout(config)
    assert [t.name for t in layout.tensors] == list(parameter_shapes(config))
    assert "lm_head.weight" not in layout.by_name  # tied
    assert all(t.dtype == "float32" for t in layout.tensors)
    kv = kv_layout(config, num_blocks=10, block_size=16)
    assert kv.shape == (4, 2, 10, 16, 2, 32)
    assert kv.dtype == "float32"


def test_init_weights_is_seeded_and_safetensors_round_trip(tmp_path: Path) -> None:
    config = ModelConfig.default()
    a, b, c = init_weights(config, 1), init_weights(config, 1), init_weights(config, 2)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.norm.weight"], c["model.norm.weight"])
    save_safetensors(a, tmp_path / "m.safetensors")
    loaded = load_safetensors(tmp_path)
    assert loaded.keys() == a.keys()
    assert all(torch.equal(a[k], loaded[k]) for k in a)


def test_tokenizer_default_is_bytes_and_bad_specs_are_config_errors(tmp_path: Path) -> None:
    tokenizer = load_tokenizer()
    assert isinstance(tokenizer, ByteTokenizer)
    ids = tokenizer.encode("héllo")
    assert max(ids) < ModelConfig.default().vocab_size
    assert tokenizer.decode(ids) == "héllo"
    with pytest.raises(ModelConfigError, match="tokenizer"):
        load_tokenizer(tmp_path / "nowhere")


def test_tokenizer_from_a_local_hf_folder(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    inner = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    inner.pre_tokenizer = pre_tokenizers.Whitespace()
    inner.save(str(tmp_path / "tokenizer.json"))
    tokenizer = load_tokenizer(tmp_path)
    assert tokenizer.encode("hello world nope") == [1, 2, 0]
