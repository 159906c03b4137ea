"""Names shared by the router tests and their conftest fixtures."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio.abc

ADMIN_TOKEN = "tok"  # the admin token of the routers the `router_process` fixture starts
StartRouter = Callable[..., Awaitable[tuple[anyio.abc.Process, str]]]  # what `router_process` yields
