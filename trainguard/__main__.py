"""``python -m trainguard``: the same command line as the ``trainguard`` console script."""

from trainguard.cli import entry

entry()
