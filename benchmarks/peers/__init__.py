"""lonnymq's worker shape (``lonnymq bench --worker``) run on other job queues in PostgreSQL,
in the same run on the same server: ``python -m benchmarks.peers --help``.

Each peer lives in a module of its own behind :class:`benchmarks.peers.common.Peer`, runs in a
database of its own created fresh for each measurement, and is installed from
``requirements.txt`` into a virtualenv of its own (``setup.sh``): none is a dependency of
lonnymq."""
