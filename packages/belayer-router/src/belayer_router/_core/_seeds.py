"""`SeedSource`: the seed of a request that names none (`RouterConfig.seed`, `serve --seed`).

Without a server seed every such request gets a fresh random seed (then kept in its journal
record, so a resumed request continues exactly). With one, `S`, the `k`-th request since the
router started whose body is the same (every field but the request id and the stream options) is
sampled with the seed `sha256(S, k, body)` (63 bits). So the same requests sent to a router
started with the same `--seed` give the same tokens, in any order, on any slot and across
handovers (the engines draw token `i` of a request from `(seed, i)` alone); and `n` identical
requests (one GRPO group) still get `n` different seeds. The counts are kept for the last
`max_bodies` distinct bodies (a body seen longer ago starts again from `k = 0`).
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from typing import Any

import attrs

from belayer_router._core._dispatch import new_seed

__all__ = ["SeedSource"]

_IGNORED = ("request_id", "stream", "stream_options", "user")


@attrs.define
class SeedSource:
    """Seeds for requests without one: random (`base` None) or derived from `base` and the body."""

    base: int | None = None
    max_bodies: int = 1_000_000
    _counts: OrderedDict[bytes, int] = attrs.field(factory=OrderedDict, init=False)

    def next(self, body: dict[str, Any]) -> int:
        """The seed of the next request with this body (a JSON object, or a request's fields)."""
        if self.base is None:
            return new_seed()
        fields = {k: v for k, v in body.items() if k not in _IGNORED}
        digest = hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).digest()
        count = self._counts.pop(digest, 0)
        self._counts[digest] = count + 1
        if len(self._counts) > self.max_bodies:
            self._counts.popitem(last=False)
        mixed = hashlib.sha256(f"{self.base}:{count}:".encode() + digest).digest()
        return int.from_bytes(mixed[:8], "big") >> 1
