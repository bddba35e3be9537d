#!/usr/bin/env bash
# Print the path of a virtualenv for one of the two pinned test environments, making it ready first if
# needed. Usage: bash scripts/env.sh [torch29|torch213]   (default torch29)
#
# torch29: .ci/requirements.txt (torch 2.9.0 + torch_xla 2.9.0, the tools, the example extras) and,
# without their dependencies, .ci/requirements-nodeps.txt. One environment per clone:
#  * the clone's own .venv when it exists (README's first command makes it with torch, torch_xla and
#    the example extras): the pinned requirements are installed into it once, recorded by a marker
#    file keyed on the requirements, so the test command never builds a second multi-GB venv;
#  * otherwise (CI on a fresh clone, worktrees) a venv cached outside the clone, keyed on the pinned
#    requirements, built from nothing when missing.
# torch213: .ci/requirements-torch213.txt (torch 2.13.0's CPU build, numpy, pytest, hypothesis; no
# torch_xla), always a venv cached outside the clone (.venv holds torch 2.9), keyed on that file and
# built from nothing when missing. The file is a complete lock: it is installed with --no-deps and
# checked with `pip check`, and a torch built with CUDA or any nvidia-* package fails the build
# (scripts/check_torch_cpu.py).
# TTE_ENV_CACHE overrides the cache folder.
set -euo pipefail
cd "$(dirname "$0")/.."
which_env="${1:-torch29}"
cache="${TTE_ENV_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/torch_tpu_embedding}"

build_torch213() {  # $1: the venv
  local req=.ci/requirements-torch213.txt
  # torch alone may come from PyTorch's CPU index (PyPI has no "+cpu" build); the rest only from the
  # default index, so an unreachable extra index costs one lookup, not one per package.
  "$1/bin/python" -m pip install -q --no-deps --only-binary :all: -r <(grep -v '^torch==' "$req") >&2
  "$1/bin/python" -m pip install -q --no-deps --only-binary :all: \
    --extra-index-url https://download.pytorch.org/whl/cpu "$(grep '^torch==' "$req")" >&2
  "$1/bin/python" -m pip check >&2
  "$1/bin/python" scripts/check_torch_cpu.py >&2
}

case "$which_env" in
  torch213)
    key="$(sha256sum .ci/requirements-torch213.txt | cut -c1-16)"
    dir="$cache/venv-torch213-py3-$key"
    if [ ! -f "$dir/.complete" ]; then
      echo "building $dir (torch 2.13.0 CPU, no torch_xla, a few minutes)" >&2
      rm -rf "$dir"
      python3 -m venv "$dir"
      "$dir/bin/python" -m pip install -q --upgrade pip >&2
      build_torch213 "$dir"
      touch "$dir/.complete"
    fi
    echo "$dir"
    exit 0
    ;;
  torch29) ;;
  *) echo "scripts/env.sh: the environment must be torch29 or torch213, got '$which_env'" >&2; exit 2 ;;
esac

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

dir="$cache/venv-py3-$key"
if [ ! -f "$dir/.complete" ]; then
  echo "building $dir (torch 2.9.0 + torch_xla 2.9.0, a few minutes)" >&2
  rm -rf "$dir"
  python3 -m venv "$dir"
  "$dir/bin/python" -m pip install -q --upgrade pip >&2
  install_pins "$dir"
  touch "$dir/.complete"
fi
echo "$dir"
