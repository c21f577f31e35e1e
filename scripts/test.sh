#!/usr/bin/env bash
# Set up .venv with the test tools, tangle the book into src/npformer, run the tests.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k softmax`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh "${NPFORMER_EXTRAS:-dev,mpi,fast}"
source .venv/bin/activate
python tangle.py && pytest "$@"
