#!/usr/bin/env bash
# Creates the project's Python venv (.venv at the repository root, git-ignored) with what the
# demo's plot needs (matplotlib, from PyPI). Idempotent: when the venv already imports
# matplotlib it only checks (no network). VENV=path overrides the location.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${VENV:-$here/.venv}"
py="$venv/bin/python"

if [[ -x "$py" ]] && "$py" -c 'import matplotlib' >/dev/null 2>&1; then
  echo "setup_venv: $venv already has matplotlib"
  exit 0
fi

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
echo "setup_venv: installing matplotlib into $venv"
"$py" -m pip install --disable-pip-version-check --quiet matplotlib
"$py" -c 'import matplotlib; print("setup_venv: matplotlib", matplotlib.__version__)'
