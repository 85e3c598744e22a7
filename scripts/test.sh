#!/usr/bin/env bash
# Runs the whole test suite. Creates .venv and installs the package with its test
# dependencies first (again only when pyproject.toml changed), the Chromium the dashboard's
# browser tests drive (scripts/browser.sh), and .venv-peers, the other job queues the peers
# benchmark runs (benchmarks/peers/setup.sh). Extra arguments go to pytest.
#   LONNYMQ_TEST_DSN=postgresql://...   run against that server instead of the embedded one
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
venv_ready dev
bash scripts/browser.sh
bash benchmarks/peers/setup.sh
exec .venv/bin/python -m pytest "$@"
