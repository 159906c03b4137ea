"""The router's side of its connections to workers (private).

`_link`: the multiplexed worker link, one long-lived ``POST /link`` per worker carrying every
request (what belayer-shadow's workers serve); `_stream`: one ``POST /generate`` per attempt over
httpx, its NDJSON answer read line by line (any other worker). Both only move bytes and check
frames: the dispatcher (`_core._dispatch`) journals and emits.
What a worker itself needs (the frame encoders) is the public `belayer_router.worker`.
"""
