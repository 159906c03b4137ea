"""``python -m belayer_router``: the ``belayer-router`` command."""

from __future__ import annotations

import sys

from belayer_router._cli import main

if __name__ == "__main__":
    sys.exit(main())
