"""The GPU health check: run tiny kernels, check their results, within a deadline.

Handover runs it before a shadow worker takes over a GPU (docs/architecture.md, invariant 6: never reuse state
of a GPU that failed it). It polls a CUDA event instead of blocking, so a hung GPU shows up as a
failed check after `timeout_s` rather than as a hung caller.
"""

from __future__ import annotations

import time

import attrs

from belayer_gpumem._errors import BackendUnavailableError, GpuUnhealthyError

__all__ = ["HealthReport", "check_gpu_health"]

_N = 1 << 12  # sum of (2i + 1) for i < N is N**2 = 2**24: exact in float32


@attrs.frozen
class HealthReport:
    """A passed health check."""

    device: int
    elapsed_s: float
    detail: str


def check_gpu_health(device: int = 0, *, timeout_s: float = 5.0) -> HealthReport:
    """Run an arithmetic kernel and a memory round trip on `device`; raise GpuUnhealthyError on any fault."""
    import torch

    if not torch.cuda.is_available():
        raise BackendUnavailableError("no CUDA device is visible to torch; the GPU health check needs one")
    start = time.monotonic()
    try:
        with torch.cuda.device(device):
            stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
            with torch.cuda.stream(stream):
                index = torch.arange(_N, device=f"cuda:{device}", dtype=torch.float32)
                total = (index * 2 + 1).sum()
                pattern = torch.arange(_N, device=f"cuda:{device}", dtype=torch.int32) ^ 0x5A5A5A5A
                echoed = pattern.clone()
                mismatches = (echoed != pattern).sum()
                done = torch.cuda.Event()  # type: ignore[no-untyped-call]
                done.record(stream)
            while not done.query():  # type: ignore[no-untyped-call]
                if time.monotonic() - start > timeout_s:
                    raise GpuUnhealthyError(
                        f"GPU {device}: the health-check kernels did not finish in {timeout_s} s"
                    )
                time.sleep(0.001)
            got_total, got_mismatches = float(total.item()), int(mismatches.item())
    except RuntimeError as exc:  # CUDA errors surface as RuntimeError from torch
        raise GpuUnhealthyError(f"GPU {device}: CUDA error during the health check: {exc}") from exc
    if got_total != float(_N * _N) or got_mismatches:
        raise GpuUnhealthyError(
            f"GPU {device}: wrong results (sum {got_total}, expected {_N * _N}; {got_mismatches} memory mismatches)"
        )
    elapsed = time.monotonic() - start
    return HealthReport(
        device=device, elapsed_s=elapsed, detail=f"kernels correct in {elapsed * 1000:.1f} ms"
    )
