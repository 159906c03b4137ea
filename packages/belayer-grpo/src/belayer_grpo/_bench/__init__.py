"""`belayer-grpo bench`: the paper's experiments, each measured against its baseline in the same run.

    belayer-grpo bench [--config FILE] [--scale small|full] [--experiment NAME ...] [--quick] [--out DIR]

Experiments (`EXPERIMENTS`): ``overhead`` (failure-free, Belayer on vs off, math and agentic),
``worker-failure`` (shadow handover vs conventional recovery), ``env-failures`` (sandbox kills
under each checkpoint policy) and ``checkpoint-cost`` (durations, and the share the LLM response
bubbles hid).  The result is ``report.md``, PNG plots and ``results.json`` in the results folder.
"""

from __future__ import annotations

from belayer_grpo._bench.runner import quick_config, run_bench
from belayer_grpo._bench.settings import EXPERIMENTS, BenchConfig, load_bench_config

__all__ = ["EXPERIMENTS", "BenchConfig", "load_bench_config", "quick_config", "run_bench"]
