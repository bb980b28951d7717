"""`python -m cluster ...` (from the checkout) is scripts/emulate-cluster.sh."""

import sys

from cluster.cli import main

sys.exit(main())
