"""`python -m moe_train.cli`: the same as the `moe-train` command."""

import sys

from moe_train.cli import main

sys.exit(main())
