#!/usr/bin/env bash
# The test command: sets up .venv (scripts/env.sh) and runs the whole suite on CPU.
# Extra arguments go to pytest (e.g. scripts/test.sh -k parity). pytest's exit code is kept,
# so a run that collects no tests (exit 5) fails.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
export OMP_NUM_THREADS=1
exec python -m pytest -q -rs tests "$@"
