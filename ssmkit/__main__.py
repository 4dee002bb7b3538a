"""`python -m ssmkit`: the `ssmkit` command line."""

import sys

from ssmkit.cli import main

sys.exit(main())
