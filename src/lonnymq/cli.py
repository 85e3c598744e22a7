"""The ``lonnymq`` command line (placeholder until the CLI lands)."""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``lonnymq`` command."""
    raise SystemExit("not yet")
