"""The queues with and without maintenance, side by side, in one run on one PostgreSQL.

    python benchmarks/maintenance.py [--dsn DSN] [--seconds 8] [--rounds 3]
        [--shape steady:1:lonnymq:100 ...]

A few load shapes of ``lonnymq bench`` (pgbench, 8 clients per side), each timed twice per
round: once with the vacuuming a Worker does (``Queue.maintain()`` every second for lonnymq;
the raw queue's table vacuumed by the same rule), once without, alternating which goes first.
Each figure is the median over rounds of messages per second; the ratio is with / without.
The bench's schemas are dropped at the end.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import statistics
import tempfile
from pathlib import Path

from lonnymq.bench import BATCH, PROFILES, Bench

# (shape, messages per call, queue, channels)
SHAPES = [
    ("steady", 1, "raw", 1),
    ("steady", 1, "lonnymq", 100),
    ("steady", 1, "lonnymq", 1),
    ("steady", BATCH, "raw", 1),
    ("steady", BATCH, "lonnymq", 100),
    ("drain", 1, "raw", 1),
    ("drain", 1, "lonnymq", 100),
]


def _once(bench: Bench, shape: tuple[str, int, str, int], maintenance: bool) -> float:
    kind_shape, batch, kind, channels = shape
    bench.maintenance = maintenance
    bench.reset()
    before = 0
    if kind_shape == "drain":
        before = bench.profile.prefill * (10 if kind == "raw" else 1)
        bench.prefill(kind, before, channels)
    with bench._maintained(kind):
        return bench._run(kind, kind_shape, batch, channels, before)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", default=os.environ.get("LONNYMQ_DSN"))
    parser.add_argument("--seconds", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--shape",
        action="append",
        help="only these shapes, as shape:batch:queue:channels (default: all of SHAPES)",
    )
    args = parser.parse_args()
    shapes = SHAPES
    if args.shape:
        shapes = []
        for text in args.shape:
            kind_shape, batch, kind, channels = text.split(":")
            shapes.append((kind_shape, int(batch), kind, int(channels)))
    if not args.dsn:
        parser.error("--dsn (or LONNYMQ_DSN) is required")
    profile = dataclasses.replace(PROFILES["default"], seconds=args.seconds)
    out = Path(tempfile.mkdtemp(prefix="lonnymq-maint-"))
    bench = Bench(args.dsn, profile, out, print)
    rates: dict[tuple[tuple[str, int, str, int], bool], list[float]] = {}
    try:
        for round_no in range(args.rounds):
            for shape in shapes:
                order = (True, False) if round_no % 2 == 0 else (False, True)
                for maintenance in order:
                    rate = _once(bench, shape, maintenance)
                    rates.setdefault((shape, maintenance), []).append(rate)
                    label = "with" if maintenance else "without"
                    print(f"  round {round_no + 1} {shape} {label}: {rate:,.0f} msg/s", flush=True)
        print(
            f"msg/s, {profile.clients} clients per side, {args.seconds}s per run, "
            f"median of {args.rounds} rounds ({bench.vacuums} vacuums in all):"
        )
        for shape in shapes:
            kind_shape, batch, kind, channels = shape
            on, off = (statistics.median(rates[shape, m]) for m in (True, False))
            label = "raw" if kind == "raw" else f"lonnymq, {channels:,} ch"
            print(
                f"  {kind_shape:<6} batch {batch:<3} {label:<18} without {off:>9,.0f}  "
                f"with {on:>9,.0f}  ({on / off:.2f}x)"
            )
    finally:
        bench.close()
        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
