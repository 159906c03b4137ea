"""The client side (private): what workers and trainers use to talk to routers.

`_client` (`RouterClient`), `_mux` (the client's side of the client link: every stream of one
client on one connection), `_calls` (one call's queue and one link's calls under `_mux`), and
`_fleet` (`RouterFleet`: several routers, each request owned by one). The public API is
re-exported from `belayer_router`.
"""
