#!/usr/bin/env bash
# The prepared check for a lent GPU (issue 33): Zero3D's correctness cases on the device, bf16
# training of a 1.1B Llama against PyTorch / FSDP2 / DeepSpeed (eager and compiled), and
# `zero3d simulate` of a 70B rank, in at most 8 minutes. Results: $OUT (or ./gpu_suite_out)
# gets gpu_suite.json and gpu_suite.md, and docs/benchmarks.md its tables.
#
#   scripts/gpu_suite.sh [--budget-s 480] [--cpu-sized]     (PYTHON=... picks the interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
out="${OUT:-gpu_suite_out}"
"$PYTHON" -c "import torch, transformers, deepspeed" >/dev/null  # fail at once, not in a part, if the stack is missing
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}" TOKENIZERS_PARALLELISM=false
exec "$PYTHON" scripts/gpu_suite.py --out "$out" --docs "$@"
