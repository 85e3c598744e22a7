#!/usr/bin/env bash
# Create .venv-peers at the checkout's root: lonnymq from this checkout plus the peers pinned
# in benchmarks/peers/requirements.txt (again only when either file changed; one caller at a
# time, so that the two test runs of .ci/run can both ask for it). Then, from the root:
#   .venv-peers/bin/python -m benchmarks.peers --dsn postgresql://...
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
python="${PYTHON:-python3}"
exec 9>.venv-peers.lock
flock 9
if [ ! -x .venv-peers/bin/python ]; then
    "$python" -m venv .venv-peers
fi
stamp=.venv-peers/.lonnymq-peers
want="$(cat pyproject.toml benchmarks/peers/requirements.txt | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    echo "Installing the peers into .venv-peers ..." >&2
    .venv-peers/bin/python -m pip install --quiet --disable-pip-version-check \
        -e . -r benchmarks/peers/requirements.txt
    .venv-peers/bin/python -c 'import procrastinate, pgqueuer, asyncpg, awa'
    echo "$want" > "$stamp"
fi
