"""The package version, single-sourced for pyproject and the wire protocol."""

__version__ = "0.1.0"
