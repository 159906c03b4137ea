"""Test helpers for code that drives a belayer-router: a fake worker, a chat tokenizer folder, and
the JSON lines of server processes.

The audience is tests and benchmarks (here and in other packages): `FakeWorker` stands in for the
inference engine behind a real router, `write_chat_tokenizer` writes a local tokenizer folder with
a Qwen3-style chat template for ``/v1/chat/completions``.
"""

from __future__ import annotations

from belayer_router._testing._chat_folder import CHAT_TEMPLATE, write_chat_tokenizer
from belayer_router._testing._fake_worker import (
    POISON,
    FakeWorker,
    Script,
    WorkerKilled,
    expected_tokens,
    logprob_of,
    running_worker,
    text_script,
    token_at,
    wait_until,
)
from belayer_router._testing._processes import JsonLines, process_gone

__all__ = [
    "CHAT_TEMPLATE",
    "POISON",
    "FakeWorker",
    "JsonLines",
    "Script",
    "WorkerKilled",
    "expected_tokens",
    "logprob_of",
    "process_gone",
    "running_worker",
    "text_script",
    "token_at",
    "wait_until",
    "write_chat_tokenizer",
]
