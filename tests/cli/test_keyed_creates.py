"""``benchmarks/keyed_creates.py`` runs end to end on one tree given twice (a smoke test:
speed is never judged here): both sides created, the ratios are printed, and the schemas are
gone afterwards."""

from __future__ import annotations

import re
import subprocess
import sys
import uuid
from pathlib import Path

import psycopg

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "keyed_creates.py"


def test_keyed_creates_compares_two_trees_and_drops_its_schemas(dsn: str) -> None:
    prefix = f"t_{uuid.uuid4().hex[:12]}"
    result = subprocess.run(
        [
            sys.executable, str(SCRIPT), str(ROOT), str(ROOT), "--dsn", dsn,
            "--prefix", prefix, "--rounds", "1", "--clients", "2", "--seconds", "0.5",
            "--sizes", "50,100",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    batches = re.findall(r"^batch of ([\d,]+) keys: a [\d.]+ s, b [\d.]+ s", result.stdout, re.M)
    assert batches == ["50", "100"], result.stdout
    singles = re.search(
        r"^single keyed creates, 2 clients: a ([\d,]+)/s, b ([\d,]+)/s", result.stdout, re.M
    )
    assert singles is not None, result.stdout
    assert all(int(rate.replace(",", "")) > 0 for rate in singles.groups())
    with psycopg.connect(dsn, autocommit=True) as conn:
        left = conn.execute(
            "SELECT count(*) FROM pg_namespace WHERE nspname LIKE %s", (f"{prefix}%",)
        ).fetchone()
    assert left == (0,)
