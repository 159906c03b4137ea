"""Shared fixtures: one torch thread (two shared cores), the model folder."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


def pytest_configure(config: pytest.Config) -> None:
    import torch

    torch.set_num_threads(1)
