"""`python -m belayer_cluster` is `belayer-cluster`."""

import sys

from belayer_cluster._cli import main

sys.exit(main())
