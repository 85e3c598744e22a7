"""One row of ``lonnymq bench``'s throughput table for two checkouts, in turns, in one run on one
PostgreSQL.

    git worktree add /tmp/before <rev>
    python benchmarks/bench_rows.py /tmp/before . [--dsn DSN] [--shape steady] [--batch 1]
        [--channels 100] [--rounds 3] [--seconds 4]

Each run is exactly what the bench does for that row (``Bench.row_run``: a fresh schema
installed by the checkout's own package, the same prefill, pgbench with the bench's scripts,
and its maintenance thread), in a subprocess with ``PYTHONPATH`` set to the
checkout's ``src``; the order of the two is swapped every round. The bench's schemas are
dropped at the end. ``benchmarks/checkouts.py``
drives the same consumer script but sets up its own way (schemas installed once, a ``VACUUM``
before each run); this script keeps the bench's setup, which matters when a change is about
how the tables look while sessions plan (migration 0037).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

from lonnymq.bench import BENCH_SCHEMAS, drop_schemas

ONE_ROW = """
import dataclasses, shutil, sys
from pathlib import Path
from lonnymq.bench import Bench, PROFILES
dsn, shape, batch, channels, seconds = sys.argv[1:6]
profile = dataclasses.replace(PROFILES["default"], seconds=int(seconds))
bench = Bench(dsn, profile, Path("."), lambda _: None)
try:
    if hasattr(bench, "row_run"):
        print(bench.row_run("lonnymq", shape, int(batch), int(channels)))
    else:
        # A checkout from before row_run: the same steps as its throughput() ran them since
        # 859fc1d (older checkouts set up differently, or lack _maintained).
        bench.reset()
        before = 0
        if shape == "drain":
            scale = 4 if int(batch) > 1 and int(channels) < 1000 else 1
            before = profile.prefill * scale
            bench.prefill("lonnymq", before, int(channels))
        with bench._maintained("lonnymq"):
            print(bench._run("lonnymq", shape, int(batch), int(channels), before))
finally:
    shutil.rmtree(bench.tmp, ignore_errors=True)
"""


def _row(tree: Path, args: argparse.Namespace) -> float:
    env = {**os.environ, "PYTHONPATH": str(tree.resolve() / "src")}
    row = [args.dsn, args.shape, str(args.batch), str(args.channels), str(args.seconds)]
    done = subprocess.run(
        [sys.executable, "-c", ONE_ROW, *row], check=False, env=env, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise SystemExit(f"a run of {tree} failed:\n{done.stderr[-3000:]}")
    return float(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("a", type=Path, help="the first checkout (a source tree)")
    parser.add_argument("b", type=Path, help="the second checkout")
    parser.add_argument("--dsn", default=os.environ.get("LONNYMQ_DSN"))
    parser.add_argument("--shape", choices=("enqueue", "drain", "steady"), default="steady")
    parser.add_argument("--batch", type=int, choices=(1, 100), default=1)
    parser.add_argument("--channels", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=int, default=4)
    args = parser.parse_args()
    if not args.dsn:
        parser.error("--dsn (or LONNYMQ_DSN) is required")
    trees = {"a": args.a, "b": args.b}
    rates: dict[str, list[float]] = {"a": [], "b": []}
    try:
        for round_no in range(args.rounds):
            for label in ("a", "b") if round_no % 2 == 0 else ("b", "a"):
                rate = _row(trees[label], args)
                rates[label].append(rate)
                print(f"  round {round_no + 1} {trees[label]}: {rate:,.0f} msg/s", flush=True)
    finally:
        drop_schemas(args.dsn, *BENCH_SCHEMAS)
    medians = {label: statistics.median(values) for label, values in rates.items()}
    for label, tree in trees.items():
        runs = ", ".join(f"{r:,.0f}" for r in rates[label])
        print(f"{label} {tree}: median {medians[label]:,.0f} msg/s ({runs})")
    print(f"b / a: {medians['b'] / medians['a']:.3f}")


if __name__ == "__main__":
    main()
