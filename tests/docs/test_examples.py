"""Every example of the documentation is a file in examples/, included into the pages, and
runs here against the test server as a user runs it (the Spark one in tests/spark, the
roles one in tests/security)."""

from __future__ import annotations

import re
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
DOCS = ROOT / "docs"
# Examples that need more than a server: each has a test of its own.
ELSEWHERE = {
    "spark_pipeline.py": "tests/spark/test_readme.py",
    "security.py": "tests/security/test_grant.py",
    "dashboard_embed.py": "tests/dashboard/test_http.py",
}
RUN_HERE = sorted(
    p.name for p in EXAMPLES.glob("*.py") if p.name not in ELSEWHERE and p.name != "quickstart.py"
)
FENCE = re.compile(r"^```(\w+)[^\n]*\n(.*?)^```", re.M | re.S)
# An example is included in the block form (ruff would format the one-line form as Python).
INCLUDE = re.compile(r"^--8<--\n([^\n]+)\n--8<--$", re.M)


def _pages() -> dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text("utf-8") for p in DOCS.rglob("*.md")}


def _drop(dsn: str, schema: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


def _run(path: Path, code: str) -> dict[str, Any]:
    namespace: dict[str, Any] = {"__name__": "__main__"}
    exec(compile(code, str(path), "exec"), namespace)
    return namespace


@pytest.mark.parametrize("name", RUN_HERE)
def test_the_example_runs(
    name: str, dsn: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = EXAMPLES / name
    code = path.read_text("utf-8")
    [schema] = re.findall(r'schema="(\w+)"', code)
    # A schema of its own, so that runs on one server do not collide.
    unique = f"t_{uuid.uuid4().hex[:16]}"
    monkeypatch.setenv("LONNYMQ_DSN", dsn)
    try:
        _run(path, code.replace(f'schema="{schema}"', f'schema="{unique}"'))
    finally:
        _drop(dsn, unique)


def test_the_quick_start_runs_again_and_again(
    dsn: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = EXAMPLES / "quickstart.py"
    monkeypatch.setenv("LONNYMQ_DSN", dsn)
    _drop(dsn, "quickstart")
    try:
        for _ in range(2):  # as written, in the same schema: the second run starts where
            _run(path, path.read_text("utf-8"))  # the first ended
            printed = capsys.readouterr().out.splitlines()
            assert len(printed) == 5, printed
            # The urgent message leaves its channel first (priority 0).
            tenant_42 = [line for line in printed if line.startswith("tenant-42")]
            assert tenant_42[0].startswith("tenant-42 b'urgent'")
        with psycopg.connect(dsn) as conn:
            assert conn.execute("SELECT count(*) FROM quickstart.message").fetchone() == (0,)
    finally:
        _drop(dsn, "quickstart")


def test_every_example_is_shown_and_run() -> None:
    included = {
        target
        for text in [*_pages().values(), (ROOT / "README.md").read_text("utf-8")]
        for target in INCLUDE.findall(text)
    }
    for path in [*EXAMPLES.glob("*.py"), *EXAMPLES.glob("sql/*.sql")]:
        name = str(path.relative_to(ROOT))
        assert name in included, f"{name} is on no page"
    for name, test in ELSEWHERE.items():
        assert f"examples/{name}" in (ROOT / test).read_text("utf-8")


def test_code_on_the_pages_comes_from_the_examples() -> None:
    """A Python or SQL block of a page is one included example file (so the tests ran it)."""
    for page, text in _pages().items():
        for language, body in FENCE.findall(text):
            if language not in ("python", "sql"):
                continue
            targets = INCLUDE.findall(body)
            assert len(targets) == 1, f"{page}: a {language} block that is not an example"
            assert body.strip() == f"--8<--\n{targets[0]}\n--8<--", page
            assert (ROOT / targets[0]).is_file(), f"{page}: {targets[0]}"
