"""A Worker under a steady offered load while another session holds the xmin horizon back (idle
in a transaction, then a long SELECT), and after: pickup latency, completion rate, backlog,
dead rows, index sizes and the pages each probe of a take touches, per window (the measurement
is ``lonnymq.bench_long_txn``; ``lonnymq bench --long-txn`` runs it with the default durations).

    python benchmarks/long_txn.py [--dsn DSN] [--hold 600] [--clean 120] [--recovery 180]
                                  [--window 10] [--rate N] [--capacity 20] [--concurrency 32]
                                  [--handler-ms 1] [--channels 1] [--holders idle,reader]
                                  [--schema NAME] [--out DIR] [--quick]
"""

from __future__ import annotations

import sys

from lonnymq.bench_long_txn import main

if __name__ == "__main__":
    sys.exit(main())
