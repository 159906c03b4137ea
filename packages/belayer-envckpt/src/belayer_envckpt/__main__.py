"""`python -m belayer_envckpt`: the same command as `belayer-envckpt`."""

from __future__ import annotations

import sys

from ._cli import main

sys.exit(main())
