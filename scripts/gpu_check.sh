#!/usr/bin/env bash
# The GPU readiness check (issue 12): every GPU path in one time-boxed run, under 8 minutes.
#   bash scripts/gpu_check.sh                  the full check where nvidia-smi finds a GPU, else its dry run
#   bash scripts/gpu_check.sh --dry-run        list each step and check that what it names exists and imports
#   bash scripts/gpu_check.sh --fetch-wheels   (where a package index answers) download into .whl/ the wheels
#                                              a GPU machine without one lacks; the check installs them there
# Other options go to benchmarks/gpu_check.py: --python PY, --out DIR, --export DIR, --budget-s S, --steps a,b.
# Figures: <out>/gpu_check.json and the table <out>/gpu_check.txt (default out: runs/gpu_check/latest).
# docs/benchmarks.md ("GPU readiness check") says what each step measures and how to read the table.
set -uo pipefail
cd "$(dirname "$0")/.."

PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python

# Wheels for the GPU image's python3 (3.12; it already holds torch, triton, numpy, pandas, pytest, ...):
# the engine's and the workbench's other imports, at the versions the project is tested with.
DEVICE_PYTHON_VERSION=${DEVICE_PYTHON_VERSION:-3.12}
DEVICE_WHEELS=(
  gguf==0.19.0 msgspec==0.23.0 pyzmq==27.3.0 hydra-core==1.3.8 omegaconf==2.3.1
  pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  typing_extensions==4.16.0
)

fetch_wheels() {
  mkdir -p .whl
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$DEVICE_PYTHON_VERSION" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl "${DEVICE_WHEELS[@]}" || return 1
  # omegaconf's parser runtime ships as a source archive only: build its (pure Python) wheel here.
  "$PY" -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3 || return 1
  echo "[gpu_check] wheels in .whl/ ($(du -sh .whl | cut -f1)); carry .whl to the GPU machine"
}

case "${1:-}" in
  --fetch-wheels)
    fetch_wheels
    exit $?
    ;;
esac

ARGS=("$@")
if [[ " ${ARGS[*]:-} " != *" --dry-run "* ]]; then
  if ! { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }; then
    echo "[gpu_check] no GPU found (nvidia-smi): dry run"
    ARGS+=(--dry-run)
  fi
fi
exec "$PY" benchmarks/gpu_check.py ${ARGS[@]+"${ARGS[@]}"}
