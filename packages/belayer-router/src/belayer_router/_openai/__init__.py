"""The OpenAI surface (private): parsing and rendering of ``/v1/completions`` and ``/v1/chat/completions``.

`_params` (the sampling parameters and the split of one request into n choices), `_completions`
and `_chat` (request parsing, response and SSE rendering), `_choices` (a choice's text: decoding
and stop strings). The routes that serve them live in `_server._openai_routes`.
"""
