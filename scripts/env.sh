#!/usr/bin/env bash
# Creates (or reuses) .venv and installs what the project needs. Sourced by the other scripts.
# torch is pinned to the 2.13.0 CPU wheel (constraints.txt) so set-up never pulls a CUDA build.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${MEGATRON_SP_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
STAMP="$VENV/.megatron_sp_stamp"
want="$(cat "$ROOT/constraints.txt" "$ROOT/requirements.txt" "$ROOT/requirements-dev.txt" "$ROOT/setup.py" $(ls "$ROOT"/csrc/*.cpp "$ROOT"/csrc/*.h "$ROOT"/csrc/cuda/* 2>/dev/null) | sha1sum | cut -d' ' -f1)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$want" ]; then
  PIP="$VENV/bin/python -m pip"
  $PIP install -q --disable-pip-version-check -c "$ROOT/constraints.txt" torch==2.13.0
  $PIP install -q --disable-pip-version-check -c "$ROOT/constraints.txt" \
      -r "$ROOT/requirements.txt" -r "$ROOT/requirements-dev.txt"
  # --no-build-isolation: the extension builds against the torch above, never a fresh (CUDA) one.
  MAX_JOBS="${MAX_JOBS:-2}" $PIP install -q --disable-pip-version-check --no-build-isolation \
      --no-deps -e "$ROOT"
  echo "$want" > "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
