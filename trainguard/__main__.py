"""``python -m trainguard``: the same command line as the ``trainguard`` console script."""

import sys

from trainguard.cli import main

sys.exit(main())
