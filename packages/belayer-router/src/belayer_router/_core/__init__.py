"""The router's core (private): slots and epochs, the journal, and the resume loop over them.

`_registry` (slots, epochs, health, weight versions, routing), `_journal` and `_store` (prompt,
tokens, preserved prefix, ``L_k``; JSON-lines persistence), `_metrics`, `_tokenizer`, `_config`,
`_dispatch`, the resume loop that streams a request from a worker (through `_worker`) and
continues it elsewhere when the stream breaks, and `_emit`: the `Emit` protocol every client
format implements, the dispatcher's only way out. No HTTP serving here: that is `_server`.
The public API is re-exported from `belayer_router`.
"""
