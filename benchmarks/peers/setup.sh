#!/usr/bin/env bash
# Create .venv-peers at the checkout's root: lonnymq from this checkout plus the peers pinned
# in benchmarks/peers/requirements.txt. Then, from the root:
#   .venv-peers/bin/python -m benchmarks.peers --dsn postgresql://...
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
python="${PYTHON:-python3}"
if [ ! -x .venv-peers/bin/python ]; then
    "$python" -m venv .venv-peers
fi
.venv-peers/bin/python -m pip install --quiet --disable-pip-version-check \
    -e . -r benchmarks/peers/requirements.txt
.venv-peers/bin/python -c 'import procrastinate, pgqueuer, asyncpg, awa; print("peers ready")'
