#!/usr/bin/env bash
# Create .venv (if needed) and install npformer in editable mode with the given extras.
# Usage: bash scripts/setup.sh dev,book[,oracle]
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-dev}"
PY="${PYTHON:-python3}"

if ! command -v "$PY" >/dev/null 2>&1; then
    echo "error: $PY not found; install Python 3.10 or newer" >&2
    exit 1
fi
if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 10))'; then
    echo "error: Python 3.10 or newer is needed, found $("$PY" --version 2>&1)" >&2
    exit 1
fi
if [ ! -x .venv/bin/python ]; then
    if ! "$PY" -m venv .venv; then
        rm -rf .venv
        echo "error: '$PY -m venv' failed. On Debian/Ubuntu: sudo apt-get install python3-venv" >&2
        exit 1
    fi
fi
stamp=".venv/.installed-$(echo "$extras" | tr ',' '-')"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    .venv/bin/python -m pip install --quiet --upgrade pip
    .venv/bin/python -m pip install --quiet -e ".[$extras]"
    touch "$stamp"
fi
