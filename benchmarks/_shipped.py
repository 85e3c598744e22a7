"""Functions as a shipped migration defined them, for benchmarks that run an earlier version
next to the current one in the same schema."""

from __future__ import annotations

import re
from importlib import resources


def function_text(migration: str, name: str, rename: str | None = None) -> str:
    """The ``CREATE [OR REPLACE] FUNCTION name(...) ... $$;`` statement of ``name`` in the
    migration file ``migration`` (e.g. ``"0002_fast_paths.sql"``), as ``CREATE OR REPLACE``;
    with ``rename``, every mention of ``name`` in it becomes ``rename``."""
    text = resources.files("lonnymq").joinpath(f"sql/migrations/{migration}").read_text()
    found = re.search(rf"CREATE (?:OR REPLACE )?FUNCTION {name}\(.*?\n\$\$;", text, re.S)
    if found is None:
        raise LookupError(f"{migration} defines no function {name}")
    statement = re.sub(r"^CREATE (?:OR REPLACE )?FUNCTION", "CREATE OR REPLACE FUNCTION", found[0])
    return statement.replace(name, rename) if rename else statement
