"""``python -m belayer_policy``: the ``belayer-policy`` command."""

from __future__ import annotations

import sys

from belayer_policy._cli import main

sys.exit(main())
