"""Functions as a development migration defined them, for benchmarks that run an earlier
version next to the current one in the same schema. Those migrations were collapsed into the
baseline: their files are read from the last commit that had them."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

# The last commit with the development migrations (sql/migrations/0001..0041).
BEFORE_BASELINE = "880282b"


def function_text(migration: str, name: str, rename: str | None = None) -> str:
    """The ``CREATE [OR REPLACE] FUNCTION name(...) ... $$;`` statement of ``name`` in the
    migration file ``migration`` (e.g. ``"0002_fast_paths.sql"``), as ``CREATE OR REPLACE``;
    with ``rename``, every mention of ``name`` in it becomes ``rename``."""
    text = subprocess.run(
        ["git", "show", f"{BEFORE_BASELINE}:src/lonnymq/sql/migrations/{migration}"],
        cwd=Path(__file__).parent,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    found = re.search(rf"CREATE (?:OR REPLACE )?FUNCTION {name}\(.*?\n\$\$;", text, re.S)
    if found is None:
        raise LookupError(f"{migration} defines no function {name}")
    statement = re.sub(r"^CREATE (?:OR REPLACE )?FUNCTION", "CREATE OR REPLACE FUNCTION", found[0])
    return statement.replace(name, rename) if rename else statement
