"""`python -m moe_plan`: the `moe-plan` command."""

import sys

from moe_plan.cli import main

sys.exit(main())
