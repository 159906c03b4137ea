"""``python -m belayer_grpo`` runs the ``belayer-grpo`` command."""

from __future__ import annotations

import sys

from belayer_grpo._cli import main

sys.exit(main())
