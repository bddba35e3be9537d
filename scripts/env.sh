#!/usr/bin/env bash
# Print the path of a virtualenv holding .ci/requirements.txt (and, without their dependencies,
# .ci/requirements-nodeps.txt), building it if absent.
# Cached outside the clone, keyed on the pinned requirements; rebuilt from nothing when missing.
set -euo pipefail
cd "$(dirname "$0")/.."
key="$(cat .ci/requirements.txt .ci/requirements-nodeps.txt | sha256sum | cut -c1-16)"
dir="${TTE_ENV_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/torch_tpu_embedding}/venv-py3-$key"
if [ ! -f "$dir/.complete" ]; then
  echo "building $dir (torch 2.9.0 + torch_xla 2.9.0, a few minutes)" >&2
  rm -rf "$dir"
  python3 -m venv "$dir"
  "$dir/bin/python" -m pip install -q --upgrade pip >&2
  "$dir/bin/python" -m pip install -q -r .ci/requirements.txt >&2
  "$dir/bin/python" -m pip install -q --no-deps -r .ci/requirements-nodeps.txt >&2
  touch "$dir/.complete"
fi
echo "$dir"
