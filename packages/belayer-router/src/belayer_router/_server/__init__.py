"""The router as an HTTP server (private): the ASGI app, its routes, and the servers that host it.

`_app` (`RouterApp`: routes, admin authentication, errors), `_openai_routes`, `_client_link` (the
router's side of ``POST /client-link``), `_asgi` (the little of ASGI the router needs), `_http`
(the router's own HTTP/1.1 server), `_lifespan`, and `_serve` (uvicorn or `_http` on a bound
socket). The public API is re-exported from `belayer_router` and `belayer_router.asgi`.
"""
