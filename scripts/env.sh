#!/usr/bin/env bash
# Print the path of a virtualenv holding .ci/requirements.txt (and, without their dependencies,
# .ci/requirements-nodeps.txt), making it ready first if needed. One environment per clone:
#  * the clone's own .venv when it exists (README's first command makes it with torch, torch_xla and
#    the example extras): the pinned requirements are installed into it once, recorded by a marker
#    file keyed on the requirements, so the test command never builds a second multi-GB venv;
#  * otherwise (CI on a fresh clone, worktrees) a venv cached outside the clone, keyed on the pinned
#    requirements, built from nothing when missing.
# TTE_ENV_CACHE overrides the cache folder.
set -euo pipefail
cd "$(dirname "$0")/.."
key="$(cat .ci/requirements.txt .ci/requirements-nodeps.txt | sha256sum | cut -c1-16)"

install_pins() {  # $1: the venv
  "$1/bin/python" -m pip install -q -r .ci/requirements.txt >&2
  "$1/bin/python" -m pip install -q --no-deps -r .ci/requirements-nodeps.txt >&2
}

if [ -x .venv/bin/python ]; then
  dir="$PWD/.venv"
  if [ ! -f "$dir/.tte-pinned-$key" ]; then
    echo "installing the pinned test requirements into $dir (reused from README's first command)" >&2
    install_pins "$dir"
    rm -f "$dir"/.tte-pinned-*
    touch "$dir/.tte-pinned-$key"
  fi
  echo "$dir"
  exit 0
fi

dir="${TTE_ENV_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/torch_tpu_embedding}/venv-py3-$key"
if [ ! -f "$dir/.complete" ]; then
  echo "building $dir (torch 2.9.0 + torch_xla 2.9.0, a few minutes)" >&2
  rm -rf "$dir"
  python3 -m venv "$dir"
  "$dir/bin/python" -m pip install -q --upgrade pip >&2
  install_pins "$dir"
  touch "$dir/.complete"
fi
echo "$dir"
