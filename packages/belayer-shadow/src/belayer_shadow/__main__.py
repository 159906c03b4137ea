"""`python -m belayer_shadow`: the `belayer-shadow` command."""

import sys

from belayer_shadow._cli import main

sys.exit(main())
