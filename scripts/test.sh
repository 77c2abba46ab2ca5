#!/usr/bin/env bash
# Install Zero3D with its test dependencies into a virtual environment of its own and run the
# whole test suite (CPU, gloo). Extra arguments go to pytest, e.g.
# `bash scripts/test.sh tests/test_config.py -x`.
#
# The environment is ZERO3D_VENV (default .venv in the repository), created when missing and
# created anew when ZERO3D_FRESH_VENV=1 (CI does this): nothing installed by hand on the machine
# can hide a missing install step or a version difference. Every package is installed at the
# version in constraints.txt, the set the suite was last run with.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${ZERO3D_VENV:-.venv}
if [[ "${ZERO3D_FRESH_VENV:-0}" == 1 ]]; then
  rm -rf "$VENV"
fi
if [[ ! -x "$VENV/bin/python" ]]; then
  echo "scripts/test.sh: creating the virtual environment $VENV"
  "${PYTHON:-python3}" -m venv "$VENV"
fi
PY="$VENV/bin/python"
# the constraints hold in pip's isolated build environments too (the build backend of -e .)
export PIP_CONSTRAINT="$PWD/constraints.txt"
PIP=("$PY" -m pip install --quiet --disable-pip-version-check -c constraints.txt)
"${PIP[@]}" pip setuptools wheel
# torch first, from constraints.txt (the CPU wheel 2.13.0+cpu), so no dependency can pull a CUDA build
"${PIP[@]}" torch
# DeepSpeed ships only as an sdist whose setup.py imports torch: build it against the torch
# installed above instead of letting pip fetch a second torch into an isolated build env.
"${PIP[@]}" --no-build-isolation deepspeed
"${PIP[@]}" -e ".[test]"
"$PY" -m pip check
echo "scripts/test.sh: testing with $("$PY" --version) in $VENV:"
"$PY" -m pip freeze --exclude-editable --disable-pip-version-check | tr '\n' ' '
echo
export DS_ACCELERATOR=cpu
# --durations: every CI log lists the slowest tests, so a new slow one shows up where the time is counted
exec "$PY" -m pytest -q --durations=25 "$@"
