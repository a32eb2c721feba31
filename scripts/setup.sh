#!/usr/bin/env bash
# Create .venv with everything clawray and its tests need. Idempotent and quick when nothing
# changed (a stamp holds the hash of pyproject.toml). torch is pinned to 2.13.0 first: on this
# kind of machine that takes the CPU build from local disk instead of a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.clawray-setup
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv/bin/pip install -q --upgrade pip
  .venv/bin/pip install -q torch==2.13.0
  .venv/bin/pip install -q -e '.[dev]'
  echo "$want" > "$stamp"
fi
