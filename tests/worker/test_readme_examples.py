"""The README's Schedules and Events examples run as written."""

from __future__ import annotations

import re
import uuid
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

README = Path(__file__).resolve().parents[2] / "README.md"


def _block(marker: str) -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text("utf-8"), flags=re.DOTALL)
    [found] = [b for b in blocks if marker in b]
    return str(found)


@pytest.mark.parametrize(
    ("marker", "schema"),
    [("q.schedule(", "schedules_example"), ("q.wait(", "events_example")],
)
def test_readme_example_runs(
    dsn: str, monkeypatch: pytest.MonkeyPatch, marker: str, schema: str
) -> None:
    monkeypatch.setenv("LONNYMQ_DSN", dsn)
    # A schema of its own, so that concurrent runs on one server do not collide.
    unique = f"t_{uuid.uuid4().hex[:16]}"
    code = _block(marker).replace(f'schema="{schema}"', f'schema="{unique}"')
    assert unique in code
    try:
        exec(compile(code, "README.md", "exec"), {})
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(unique)))
