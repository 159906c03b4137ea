"""`python -m belayer_gpumem` is the `belayer-gpumem` command."""

from __future__ import annotations

from belayer_gpumem._cli import main

if __name__ == "__main__":
    raise SystemExit(main())
