"""Dequeue throughput while another session holds a snapshot open, and after it ends: lonnymq
against the raw SKIP LOCKED queue (the measurement is ``lonnymq.bench_long_txn``; ``lonnymq
bench --long-txn`` runs it with the default durations).

    python benchmarks/long_txn.py [--dsn DSN] [--hold 180] [--baseline 60] [--after 60]
                                  [--window 10] [--clients 4] [--out DIR] [--quick]
"""

from __future__ import annotations

import sys

from lonnymq.bench_long_txn import main

if __name__ == "__main__":
    sys.exit(main())
