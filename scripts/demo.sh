#!/usr/bin/env bash
# Runs the demo pipeline on the embedded PostgreSQL (or on $LONNYMQ_DSN when set).
# Creates .venv and installs the package first (again only when pyproject.toml changed).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
venv_ready demo
exec .venv/bin/lonnymq demo "$@"
