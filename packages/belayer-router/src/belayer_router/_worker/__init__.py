"""The router's side of its connections to workers (private).

`_stream`: one ``POST /generate`` per attempt, its NDJSON answer read line by line; `_link`: the
multiplexed worker link, one long-lived ``POST /link`` per worker carrying every request.
What a worker itself needs (the frame encoders) is the public `belayer_router.worker`.
"""
