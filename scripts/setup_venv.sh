#!/usr/bin/env bash
# Creates the project's Python venv (.venv at the repository root, git-ignored) with what the
# Python tests, the kernel benchmark and the demo's plot need (python/requirements-dev.txt:
# torch, pytest, pybind11, matplotlib, from PyPI). Idempotent: when the venv already satisfies
# the requirements file it only checks (no network). VENV=path overrides the location.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${VENV:-$here/.venv}"
py="$venv/bin/python"
reqs="$here/python/requirements-dev.txt"
stamp="$venv/.kvbridge-requirements"

if [[ -x "$py" && -f "$stamp" ]] && cmp -s "$stamp" "$reqs"; then
  echo "setup_venv: $venv is up to date with $(basename "$reqs")"
  exit 0
fi

# shellcheck source=scripts/need_space.sh
source "$here/scripts/need_space.sh"
need_space setup_venv "$venv" 8

if ! command -v python3 >/dev/null 2>&1; then
  echo "setup_venv: python3 is not installed (scripts/setup.sh installs it)" >&2
  exit 1
fi
if [[ ! -x "$py" ]]; then
  echo "setup_venv: creating $venv"
  if ! python3 -m venv "$venv"; then
    echo "setup_venv: 'python3 -m venv' failed (the python3-venv package is missing?)" >&2
    rm -rf "$venv"
    exit 1
  fi
fi
echo "setup_venv: installing $(basename "$reqs") into $venv (torch is a few GB the first time)"
"$py" -m pip install --disable-pip-version-check --quiet --upgrade pip
"$py" -m pip install --disable-pip-version-check --quiet -r "$reqs"
"$py" -c 'import torch, pytest, pybind11, prometheus_client; print("setup_venv: torch", torch.__version__, "pytest", pytest.__version__, "pybind11", pybind11.__version__)'
cp "$reqs" "$stamp"
