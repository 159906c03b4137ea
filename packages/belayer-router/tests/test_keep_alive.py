"""Our clients drop an idle pooled connection well before a server of ours closes it.

At equal idle times (httpx's default pool expiry and the servers' keep-alive were both 5 s) a request
sent on a connection at the moment the server closes it fails with ``httpx.ReadError`` after the
server may have read it; under load that ended a training run.  The connection a request comes on is
seen by the server as the client's port.
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from belayer_router import RouterClient, serving
from belayer_router._wire._protocol import CLIENT_KEEP_ALIVE_S, KEEP_ALIVE_S
from belayer_router.asgi import Receive, Send

pytestmark = pytest.mark.anyio


async def _client_port_app(scope: dict[str, Any], receive: Receive, send: Send) -> None:
    """``GET /health`` answers with the port of the connection it came on."""
    assert scope["type"] == "http"
    body = b'{"port": %d}' % scope["client"][1]
    await send(
        {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]}
    )
    await send({"type": "http.response.body", "body": body})


def test_the_client_expires_connections_well_before_the_server_closes_them() -> None:
    assert CLIENT_KEEP_ALIVE_S <= KEEP_ALIVE_S / 2


@pytest.mark.parametrize("server", ["belayer", "uvicorn"])
async def test_an_idle_connection_is_dropped_by_the_client_not_reused_as_the_server_closes_it(
    server: str,
) -> None:
    async with serving(_client_port_app, server=server) as url, RouterClient(url) as client:
        first = (await client.health())["port"]
        assert (await client.health())["port"] == first  # busy connections are reused
        # idle past the client's expiry (at most half the server's keep-alive), not the server's
        await anyio.sleep(KEEP_ALIVE_S / 2 + 0.5)
        assert (await client.health())["port"] != first
