#!/usr/bin/env bash
# Install Zero3D with its test dependencies and run the whole test suite (CPU, gloo).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh tests/test_config.py -x`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
bash scripts/install.sh
# DeepSpeed ships only as an sdist whose setup.py imports torch: build it against the torch
# installed above instead of letting pip fetch a second torch into an isolated build env.
if ! "$PY" -c "import deepspeed" 2>/dev/null; then
  "$PY" -m pip install --quiet --no-build-isolation "deepspeed>=0.14"
fi
"$PY" -m pip install --quiet -e ".[test]"
export DS_ACCELERATOR=cpu
exec "$PY" -m pytest -q "$@"
