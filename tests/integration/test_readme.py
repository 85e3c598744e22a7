"""The README's quick start runs as written."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import psycopg
import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text("utf-8"), flags=re.DOTALL)


def test_quick_start_runs(dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    quick_start = _python_blocks()[0]
    assert 'Queue(schema="quickstart")' in quick_start
    monkeypatch.setenv("LONNYMQ_DSN", dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DROP SCHEMA IF EXISTS quickstart CASCADE")
        try:
            namespace: dict[str, Any] = {}
            exec(compile(quick_start, str(README), "exec"), namespace)
            # The example dequeued the urgent message and finished or deferred it.
            rows = conn.execute("SELECT content FROM quickstart.message ORDER BY id").fetchall()
            assert [bytes(r[0]) for r in rows] == [b"resize image 1", b"later", b"a", b"b"]
        finally:
            conn.execute("DROP SCHEMA IF EXISTS quickstart CASCADE")
