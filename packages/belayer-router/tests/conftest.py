from __future__ import annotations

import os

import pytest

# litellm (imported by test modules) would fetch its model price map from the internet at import;
# the machines reach only package registries: use the copy it ships.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")  # mini-swe-agent's banner


@pytest.fixture
def anyio_backend() -> str:
    # uvicorn serves on asyncio only.
    return "asyncio"
