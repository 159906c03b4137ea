"""Data for training: problems, tokenizers and the resumable prompt sampler."""

from __future__ import annotations

from belayer_grpo._data.problems import (
    Problem,
    extract_answer,
    generate_arithmetic,
    load_math_file,
    math_reward,
)
from belayer_grpo._data.sampler import PromptSampler
from belayer_grpo._data.tokenizer import (
    ARITHMETIC_ALPHABET,
    BytePolicyTokenizer,
    CharTokenizer,
    HuggingFacePolicyTokenizer,
    PolicyTokenizer,
)

__all__ = [
    "ARITHMETIC_ALPHABET",
    "BytePolicyTokenizer",
    "CharTokenizer",
    "HuggingFacePolicyTokenizer",
    "PolicyTokenizer",
    "Problem",
    "PromptSampler",
    "extract_answer",
    "generate_arithmetic",
    "load_math_file",
    "math_reward",
]
