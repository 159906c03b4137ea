"""What crosses a connection, without the I/O (private): formats only, importing nothing else here.

`_protocol`: the client's generate request, the router -> worker request body and the NDJSON
events of ``POST /generate``; `_frames`: the binary frames of the worker link and the client
link; `_response`: the httptools callbacks the router's own HTTP/1.1 readers share.
The public API is re-exported from `belayer_router` and `belayer_router.worker`.
"""
