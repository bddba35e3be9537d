#!/usr/bin/env bash
# Set up (or reuse) the pinned environment and run every check: lint, types, import layers, CPU tests,
# XLA tests on 1 device and on 4 virtual devices (separate processes: the device count and SPMD
# mode are fixed per process). Usage: bash scripts/test.sh [extra pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
ENV_DIR="$(bash scripts/env.sh)"
PY="$ENV_DIR/bin/python"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export OMP_WAIT_POLICY=PASSIVE  # spinning OpenMP threads stall a busy 2-core machine

echo "== ruff"; "$ENV_DIR/bin/ruff" check torch_tpu_embedding tests examples benchmarks scripts
echo "== mypy (strict, package)"; "$ENV_DIR/bin/mypy" torch_tpu_embedding
echo "== import layers (import-linter contracts in pyproject.toml)"; "$ENV_DIR/bin/lint-imports" --no-cache --no-logo
echo "== import graph (no cycle, imports inside functions only of torch_xla modules)"
"$PY" scripts/import_graph.py
status=0
echo "== CPU tests"
"$PY" -m pytest -q -p no:cacheprovider tests --ignore=tests/xla --ignore=tests/xla_spmd "$@" || status=$?
echo "== XLA tests, 1 device (PJRT_DEVICE=CPU)"
PJRT_DEVICE=CPU "$PY" -m pytest -q -p no:cacheprovider tests/xla "$@" || status=$?
echo "== XLA SPMD tests, 4 devices (PJRT_DEVICE=CPU CPU_NUM_DEVICES=4)"
PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 "$PY" -m pytest -q -p no:cacheprovider tests/xla_spmd "$@" || status=$?
exit $status
