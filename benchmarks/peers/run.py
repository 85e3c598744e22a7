"""The runner: at each concurrency in turn, lonnymq's rows (the durable floor, ``AsyncWorker``,
``Worker``) from ``lonnymq.bench_worker``, then each peer, measured the same way
(``measure_consumer``); a table on stdout and ``peers.json``.

    python -m benchmarks.peers [--dsn DSN] [--concurrency 8,32,128] [--seconds 20]
                               [--peers procrastinate,pgqueuer,awa] [--no-lonnymq]
                               [--schema lonnymq_peers] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import platform
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import psycopg

from lonnymq.bench import PROFILES, Bench
from lonnymq.bench_worker import (
    BACKLOG,
    CHANNELS,
    HANDLER_S,
    Load,
    describe,
    measure_consumer,
    run_worker_shape,
)

from .common import Peer, fresh_database

PEERS = {
    "procrastinate": ("procrastinate_peer", "Procrastinate"),
    "pgqueuer": ("pgqueuer_peer", "PgQueuer"),
    "awa": ("awa_peer", "Awa"),
}
ROOT = Path(__file__).resolve().parents[2]


def load_peer(key: str) -> Peer:
    """The peer ``key``; a clear error when its package is not installed."""
    module_name, class_name = PEERS[key]
    try:
        module = importlib.import_module(f"{__package__}.{module_name}")
    except ImportError as exc:
        raise SystemExit(
            f"peer {key!r} cannot be imported ({exc}): run benchmarks/peers/setup.sh and use "
            ".venv-peers/bin/python"
        ) from exc
    peer: Peer = getattr(module, class_name)()
    return peer


def _csv_ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def _csv(text: str) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = sorted(set(names) - set(PEERS))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown peers {unknown}; known: {sorted(PEERS)}")
    return names


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.peers",
        description="lonnymq's worker shape beside other PostgreSQL job queues, in one run.",
    )
    parser.add_argument(
        "--dsn",
        default=os.environ.get("LONNYMQ_DSN"),
        help="the server, a URL or key=value string (default: $LONNYMQ_DSN)",
    )
    parser.add_argument(
        "--concurrency",
        type=_csv_ints,
        default=[8, 32, 128],
        help="handler slots, comma-separated (default 8,32,128)",
    )
    parser.add_argument(
        "--seconds",
        type=float,
        default=20.0,
        help="each phase (saturated, paced) of each row (default 20)",
    )
    parser.add_argument(
        "--peers",
        type=_csv,
        default=list(PEERS),
        help="comma-separated, '' for none (default: all)",
    )
    parser.add_argument(
        "--no-lonnymq", action="store_true", help="leave out lonnymq's rows and the floor"
    )
    parser.add_argument(
        "--schema",
        default="lonnymq_peers",
        help="lonnymq's schema (the floor's is SCHEMA_raw); peers get databases "
        "named SCHEMA_<peer>",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=ROOT / "benchmarks" / "results",
        help="where peers.json is written",
    )
    args = parser.parse_args(argv)
    if not args.dsn:
        parser.error("give --dsn or set LONNYMQ_DSN")
    return args  # fmt: skip


def _commit() -> str | None:
    done = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True, check=False)  # fmt: skip
    return done.stdout.strip() or None


def _lonnymq_rows(bench: Bench, concurrency: int, log: Any) -> list[dict[str, Any]]:
    """lonnymq's rows at ``concurrency``, each with the load average when it was measured
    (``run_worker_shape`` logs each row as soon as it is measured: the load is read then)."""
    bench.profile = dataclasses.replace(bench.profile, worker_concurrency=(concurrency,))
    loads: list[float] = []
    bench.log = lambda line: (loads.append(os.getloadavg()[0]), log(line))
    rows = run_worker_shape(bench)
    for row, load in zip(rows, loads, strict=True):
        row["loadavg_1m"] = load
    return rows


def _peer_row(args: argparse.Namespace, key: str, peer: Peer, concurrency: int) -> dict[str, Any]:
    with fresh_database(args.dsn, f"{args.schema}_{key}") as dsn:
        peer.open(dsn)
        try:
            load = Load(peer.create)
            consumer = peer.consumer(concurrency, load)
            return measure_consumer(
                peer.name,
                concurrency,
                args.seconds,
                load=load,
                consumer=consumer,
                finished=peer.finished,
            )
        finally:
            peer.close()


def _peer_row_or_error(
    args: argparse.Namespace,
    key: str,
    peer: Peer,
    concurrency: int,
    *,
    floor: float | None,
    log: Any,
) -> dict[str, Any]:
    """The peer's row, with its ratio to the floor; a peer that fails gets a row that says so
    (the others still run)."""
    try:
        row = _peer_row(args, key, peer, concurrency)
    except Exception as exc:
        log(f"  {peer.name} at {concurrency}: FAILED {exc!r}")
        return {"consumer": peer.name, "concurrency": concurrency, "error": repr(exc)}
    row["x_floor"] = row["msgs_per_s"] / floor if floor else None
    row["loadavg_1m"] = os.getloadavg()[0]
    log(describe(row))
    return row


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as a Markdown table, by concurrency, lonnymq's rows first."""
    lines = [
        "| consumer | slots | msg/s | x floor | pickup p50 / p99 ms (saturated) "
        "| paced msg/s | pickup p50 / p99 ms (paced) | load 1 min |",
        "|---|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for row in sorted(rows, key=lambda r: r["concurrency"]):
        if "error" in row:
            lines.append(f"| {row['consumer']} | {row['concurrency']} | failed: "
                         f"{row['error'][:60]} | | | | | |")  # fmt: skip
            continue
        sat, paced = row["pickup_saturated"], row["pickup_paced"]
        ratio = "-" if row.get("x_floor") is None else f"{row['x_floor']:.2f}"
        kept = "" if row["kept_up"] else " (behind)"
        lines.append(
            f"| {row['consumer']} | {row['concurrency']} | {row['msgs_per_s']:,.0f} | {ratio} "
            f"| {_ms(sat['p50_ms'])} / {_ms(sat['p99_ms'])} | {row['paced_rate']:,.0f}{kept} "
            f"| {_ms(paced['p50_ms'])} / {_ms(paced['p99_ms'])} | {row['loadavg_1m']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def log(line: str) -> None:
        print(line, flush=True)

    peers = {key: load_peer(key) for key in args.peers}
    with psycopg.connect(args.dsn) as conn:
        row = conn.execute("SHOW server_version").fetchone()
    server = row[0] if row else None
    log(f"peers: PostgreSQL {server}, {args.seconds}s per phase, concurrency "
        f"{args.concurrency}, load average {os.getloadavg()}")  # fmt: skip
    started, load_before = time.perf_counter(), os.getloadavg()
    rows: list[dict[str, Any]] = []
    profile = dataclasses.replace(PROFILES["default"], name="peers", worker_seconds=args.seconds)
    bench = Bench(args.dsn, profile, args.out, log, schemas=(args.schema, f"{args.schema}_raw"))
    try:
        # By concurrency, so that the rows compared with one another run minutes apart at most.
        for concurrency in args.concurrency:
            floor = None
            if not args.no_lonnymq:
                ours = _lonnymq_rows(bench, concurrency, log)
                rows += ours
                floor = next(r["msgs_per_s"] for r in ours if r["consumer"] == "durable floor")
            for key, peer in peers.items():
                rows.append(_peer_row_or_error(args, key, peer, concurrency, floor=floor, log=log))
    finally:
        bench.close()  # drops the schemas it made
    report = {
        "command": ["python", "-m", "benchmarks.peers", *(sys.argv[1:] if argv is None else argv)],
        "commit": _commit(),
        "server_version": server,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "seconds_per_phase": args.seconds,
        "concurrency": args.concurrency,
        "shape": {"backlog": BACKLOG, "lonnymq_channels": CHANNELS, "handler_s": HANDLER_S},
        "lonnymq": metadata.version("lonnymq"),
        "peers": {
            peer.name: {
                "package": peer.package,
                "version": metadata.version(peer.package),
                "fair_key": peer.fair_key,
                "settings": {str(c): peer.settings(c) for c in args.concurrency},
            }
            for peer in peers.values()
        },
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "rows": rows,
        "seconds": time.perf_counter() - started,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "peers.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    log("\n" + table(rows))
    log(f"\nwrote {path} ({report['seconds']:.0f}s)")
    return 1 if any("error" in r for r in rows) else 0
