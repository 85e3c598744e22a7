"""``python -m benchmarks.peers`` runs end to end (a smoke test: speed is never judged here).

The lonnymq rows run from the project's own virtualenv, so the runner cannot rot where the
peers are not installed; the peers themselves run from ``.venv-peers`` when
``benchmarks/peers/setup.sh`` has made it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest

ROOT = Path(__file__).resolve().parents[2]
PEERS_PYTHON = ROOT / ".venv-peers" / "bin" / "python"
LONNYMQ_ROWS = {"durable floor", "Worker", "AsyncWorker"}


def _run(python: Path | str, dsn: str, out: Path, *args: str) -> tuple[dict[str, Any], str]:
    schema = f"t_{uuid.uuid4().hex[:16]}"
    command = [str(python), "-m", "benchmarks.peers", "--concurrency", "8", "--seconds", "0.3",
               "--schema", schema, "--out", str(out), *args]  # fmt: skip
    env = {**os.environ, "LONNYMQ_DSN": dsn}
    done = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, env=env, timeout=280, check=False
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    with psycopg.connect(dsn, autocommit=True) as conn:
        left = conn.execute(
            "SELECT datname FROM pg_database WHERE datname LIKE %s"
            " UNION ALL SELECT nspname FROM pg_namespace WHERE nspname LIKE %s",
            (f"{schema}%", f"{schema}%"),
        ).fetchall()
    assert left == []  # every peer's database and lonnymq's schemas were dropped
    return json.loads((out / "peers.json").read_text()), done.stdout


def _check_rows(rows: list[dict[str, Any]], consumers: set[str]) -> None:
    assert {r["consumer"] for r in rows} == consumers
    for row in rows:
        assert "error" not in row, row
        assert row["concurrency"] == 8
        assert row["msgs_per_s"] > 0
        assert row["pickup_saturated"]["p50_ms"] > 0
        assert row["pickup_paced"]["p50_ms"] > 0
        assert row["loadavg_1m"] >= 0


@pytest.mark.slow
def test_runner_measures_lonnymq_rows(dsn: str, tmp_path: Path) -> None:
    report, stdout = _run(sys.executable, dsn, tmp_path, "--peers", "")
    _check_rows(report["rows"], LONNYMQ_ROWS)
    floor = next(r for r in report["rows"] if r["consumer"] == "durable floor")
    assert floor["x_floor"] == pytest.approx(1.0)
    assert report["peers"] == {}
    assert report["seconds_per_phase"] == 0.3
    assert "| Worker | 8 |" in stdout  # the table


def test_unknown_peer_is_refused(dsn: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.peers", "--dsn", dsn, "--peers", "celery"],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2
    assert "unknown peers ['celery']" in done.stderr


@pytest.mark.slow
@pytest.mark.skipif(
    not PEERS_PYTHON.exists(), reason="no .venv-peers: run benchmarks/peers/setup.sh to make it"
)
def test_runner_measures_every_peer(dsn: str, tmp_path: Path) -> None:
    report, _ = _run(PEERS_PYTHON, dsn, tmp_path, "--no-lonnymq")
    _check_rows(report["rows"], {"procrastinate", "pgqueuer", "awa"})
    pins = dict(
        line.split("==")
        for line in (ROOT / "benchmarks" / "peers" / "requirements.txt").read_text().splitlines()
        if "==" in line and not line.startswith("#")
    )
    for peer in report["peers"].values():
        assert peer["version"] == pins[peer["package"]]
        assert peer["settings"]["8"]
