"""The router's per-request path to a worker: one streamed ``POST /generate``, its NDJSON lines.

For workers that do not serve the worker link (`_link`): `FakeWorker` by default, harness
workers, https:// workers.  The answer is read through the dispatcher's httpx client (its
timeouts: a read slower than ``worker_read_timeout_s`` breaks the stream); the lines come in
batches as the chunks arrive, so a worker that sends a step's tokens at once costs one wake-up.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator

import httpx

from belayer_router._errors import WorkerStreamError

__all__ = ["stream_lines"]


async def stream_lines(
    client: httpx.AsyncClient, url: str, body: dict[str, object], max_line_bytes: int
) -> AsyncGenerator[list[bytes], None]:
    """The complete lines (without newlines) of the worker's answer to ``body``, batch by batch.

    Raises `WorkerStreamError` for a non-200 answer or a line over ``max_line_bytes``; httpx's
    errors (connection lost, read timeout, a body cut short) propagate as they are.  Close it
    (`contextlib.aclosing`) when leaving early: that closes the worker's connection, which stops
    its generation.
    """
    async with client.stream("POST", f"{url}/generate", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            raise WorkerStreamError(f"worker {url} answered {response.status_code}: {response.text[:500]}")
        pending = b""
        async for chunk in response.aiter_raw():
            *lines, pending = (pending + chunk).split(b"\n")
            if len(pending) > max_line_bytes:
                raise WorkerStreamError(f"worker {url} sent a line over {max_line_bytes} bytes")
            if lines:
                yield lines
        if pending:
            yield [pending]
