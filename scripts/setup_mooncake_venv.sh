#!/usr/bin/env bash
# Creates the reference system's venv (.venv-mooncake at the repository root, git-ignored) with
# the real Mooncake wheel pinned in python/requirements-mooncake.txt, plus pytest and py-spy
# (benchmarks/run vs-mooncake --py-spy). The compat suite (scripts/test_mooncake_compat.sh) runs
# there with PYTHONPATH=build/python, so kvbridge and Mooncake are tested side by side in one
# interpreter.
#
# Mooncake is optional for the project: when it cannot be installed or imported here (no PyPI,
# a system library missing and no root to install it), this prints the reason and exits 1, and
# the tests that need it skip. The wheel's native libraries link libibverbs.so.1 even for TCP;
# as root (or with sudo) the Debian package libibverbs1 is installed when it is missing.
#
# Mooncake's tensor API (put_tensor, get_tensor, ...) imports torch. Rather than a second copy
# of torch (a few GB with its CUDA libraries), the project venv's torch is linked in:
# scripts/link_project_torch.py puts symlinks to torch and what it requires into
# $venv/project-torch and names that folder in a .pth file (appended to sys.path, so the venv's
# own packages still win). About 1 s and 120 KB; relinked when the project venv's torch
# changes. Without a project venv with torch (same interpreter) nothing is linked and the tensor
# tests skip Mooncake, naming why. PROJECT_VENV=path overrides the project venv (.venv).
#
# Idempotent: when the venv already satisfies the requirements file and imports, it only checks
# (no network). MOONCAKE_VENV=path overrides the location.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${MOONCAKE_VENV:-$here/.venv-mooncake}"
py="$venv/bin/python"
reqs="$here/python/requirements-mooncake.txt"
stamp="$venv/.kvbridge-requirements"
check_import='import mooncake.store, mooncake.engine'
project_py="${PROJECT_VENV:-$here/.venv}/bin/python"
torch_dir="$venv/project-torch"
torch_stamp="$torch_dir/.kvbridge-source"

fail() {
  echo "setup_mooncake_venv: $*" >&2
  exit 1
}

# shellcheck source=scripts/mooncake_system_packages.sh
source "$here/scripts/mooncake_system_packages.sh"

# Links the project venv's torch into $venv (header above), unless it is linked already.
link_project_torch() {
  local origin
  if [[ ! -x "$project_py" ]] ||
     ! origin="$("$project_py" -c 'import sys, importlib.util as u, importlib.metadata as m; print(sys.version_info[:2], u.find_spec("torch").origin, m.version("torch"))' 2>/dev/null)"; then
    echo "setup_mooncake_venv: no torch in $project_py to link; the tensor tests skip Mooncake"
    return 0
  fi
  if [[ "$origin" != "$("$py" -c 'import sys; print(sys.version_info[:2])') "* ]]; then
    echo "setup_mooncake_venv: $project_py is another Python version; torch not linked"
    return 0
  fi
  if [[ -f "$torch_stamp" && "$(cat "$torch_stamp")" == "$origin" ]]; then
    return 0
  fi
  local site
  site="$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  "$project_py" "$here/scripts/link_project_torch.py" "$torch_dir" "$site" >/dev/null ||
    fail "could not link the project venv's torch into $venv"
  echo "$origin" >"$torch_stamp"
  echo "setup_mooncake_venv: linked torch $(echo "$origin" | awk '{print $NF}') from $project_py"
}

if [[ -x "$py" && -f "$stamp" ]] && cmp -s "$stamp" "$reqs" && "$py" -c "$check_import" 2>/dev/null; then
  link_project_torch
  echo "setup_mooncake_venv: $venv is up to date with $(basename "$reqs")"
  exit 0
fi

command -v python3 >/dev/null 2>&1 || fail "python3 is not installed (scripts/setup.sh installs it)"
if [[ ! -x "$py" ]]; then
  echo "setup_mooncake_venv: creating $venv"
  existed=0
  [[ -e "$venv" ]] && existed=1
  if ! python3 -m venv "$venv"; then
    [[ $existed -eq 1 ]] || rm -rf "$venv"  # never a folder that was there before
    fail "'python3 -m venv' failed (the python3-venv package is missing?)"
  fi
fi
rm -f "$stamp"
echo "setup_mooncake_venv: installing $(basename "$reqs") into $venv"
"$py" -m pip install --disable-pip-version-check --quiet -r "$reqs" ||
  fail "pip could not install $(grep -m1 '^mooncake' "$reqs") (no PyPI access, or no wheel for $("$py" -c 'import sys, platform; print(f"CPython {sys.version_info[0]}.{sys.version_info[1]} on {platform.machine()}")'))"

if ! "$py" -c "$check_import" 2>/dev/null; then
  mapfile -t pkgs < <(missing_system_packages "$py")
  unknown=()
  for p in "${pkgs[@]}"; do [[ "$p" == \?* ]] && unknown+=("${p#\?}"); done
  if [[ ${#unknown[@]} -gt 0 ]]; then
    fail "Mooncake's native modules need ${unknown[*]}, which no known Debian package provides here"
  fi
  if [[ ${#pkgs[@]} -gt 0 ]]; then
    install_system_packages setup_mooncake_venv "${pkgs[@]}" ||
      fail "Mooncake's native modules need the Debian package(s) ${pkgs[*]}; install them as root (apt-get install ${pkgs[*]}) and rerun"
  fi
  err="$("$py" -c "$check_import" 2>&1 | tail -1)" ||
    fail "the Mooncake wheel installed but does not import: $err"
fi
link_project_torch
"$py" -c 'import importlib.metadata as m, pytest; print("setup_mooncake_venv: mooncake-transfer-engine-non-cuda", m.version("mooncake-transfer-engine-non-cuda"), "pytest", pytest.__version__)'
cp "$reqs" "$stamp"
