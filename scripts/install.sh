#!/usr/bin/env bash
# Install Zero3D into the current Python environment.
# A torch that is already installed (a CUDA build, say) is kept; otherwise the CPU build
# torch==2.13.0 is installed first, so that no dependency can pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install --quiet "torch==2.13.0"
fi
"$PY" -m pip install --quiet -e .
