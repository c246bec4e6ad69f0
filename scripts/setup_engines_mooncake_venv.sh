#!/usr/bin/env bash
# Creates the two overlay venvs of `benchmarks/run engines` (benchmarks/bench_engines.py), both
# git-ignored, both layered over the engines' venv (.venv-engines, scripts/setup_engines_venv.sh)
# by a .pth file, so that they see vLLM, torch and the rest without a second copy:
#
#   .venv-engines-mooncake  + the real Mooncake wheel (the pin of python/requirements-mooncake.txt,
#                             mooncake-transfer-engine-non-cuda), what vLLM's stock
#                             MooncakeConnector imports as `mooncake.engine`;
#   .venv-engines-dropin    + kvbridge's Mooncake drop-in (dropin/mooncake, a `mooncake` package
#                             re-exporting kvbridge.compat.mooncake), installed by pip from a copy.
#
# .venv-engines itself never gets a `mooncake` package. The real wheel's native modules link
# libibverbs.so.1 even for TCP; as root (or with sudo) the Debian package libibverbs1 is
# installed when it is missing. Idempotent: a venv whose stamp matches is only checked (no
# network). ENGINES_VENV, MOONCAKE_OVERLAY, DROPIN_OVERLAY override the locations.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
base="${ENGINES_VENV:-$here/.venv-engines}"
real="${MOONCAKE_OVERLAY:-$here/.venv-engines-mooncake}"
dropin="${DROPIN_OVERLAY:-$here/.venv-engines-dropin}"
reqs="$here/python/requirements-mooncake.txt"
build="${BUILD_DIR:-$here/build}"  # kvbridge's package: $build/python, on PYTHONPATH at run time

fail() {
  echo "setup_engines_mooncake_venv: $*" >&2
  exit 1
}

[[ -x "$base/bin/python" ]] ||
  fail "no engines' venv at $base (run scripts/setup_engines_venv.sh, or make test-engines)"
base_site="$("$base/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
wheel="$(grep -m1 '^mooncake-transfer-engine' "$reqs")"
[[ -n "$wheel" ]] || fail "no mooncake-transfer-engine pin in $reqs"

# A venv at $1 that sees every package of the engines' venv (its pip included) through a .pth.
overlay() {
  local venv="$1" site
  if [[ ! -x "$venv/bin/python" ]]; then
    echo "setup_engines_mooncake_venv: creating $venv over $base"
    "$base/bin/python" -m venv --without-pip "$venv" || { rm -rf "$venv"; fail "venv $venv failed"; }
  fi
  site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  echo "$base_site" > "$site/_kvbridge_engines_venv.pth"
}

pip_in() {
  local venv="$1"
  shift
  env -u PYTHONPATH PIP_DISABLE_PIP_VERSION_CHECK=1 "$venv/bin/python" -m pip install --quiet "$@"
}

# shellcheck source=scripts/mooncake_system_packages.sh
source "$here/scripts/mooncake_system_packages.sh"

check_real='import mooncake.engine, aiohttp, requests, msgpack
assert not hasattr(__import__("mooncake"), "IMPLEMENTATION"), "the drop-in, not Mooncake"'
check_dropin='import mooncake, mooncake.engine
assert mooncake.IMPLEMENTATION == "kvbridge", mooncake.__file__'

# -- the real wheel -------------------------------------------------------------------------------
stamp="$real/.kvbridge-requirements"
if [[ -x "$real/bin/python" && -f "$stamp" && "$(cat "$stamp")" == "$wheel $base_site" ]] &&
   env -u PYTHONPATH "$real/bin/python" -c "$check_real" 2>/dev/null; then
  echo "setup_engines_mooncake_venv: $real is up to date ($wheel)"
else
  overlay "$real"
  rm -f "$stamp"
  echo "setup_engines_mooncake_venv: installing $wheel into $real"
  # Its dependencies (aiohttp, requests, msgpack) that the engines' venv already has are taken
  # from there (pip sees them through the .pth); the others go into the overlay.
  pip_in "$real" "$wheel" ||
    fail "pip could not install $wheel (no PyPI access, or no wheel for this CPython/platform)"
  if ! env -u PYTHONPATH "$real/bin/python" -c "$check_real" 2>/dev/null; then
    mapfile -t pkgs < <(missing_system_packages "$real/bin/python")
    unknown=()
    for p in "${pkgs[@]}"; do [[ "$p" == \?* ]] && unknown+=("${p#\?}"); done
    [[ ${#unknown[@]} -eq 0 ]] ||
      fail "Mooncake's native modules need ${unknown[*]}, which no known Debian package provides"
    if [[ ${#pkgs[@]} -gt 0 ]]; then
      install_system_packages setup_engines_mooncake_venv "${pkgs[@]}" ||
        fail "Mooncake's native modules need the Debian package(s) ${pkgs[*]}; install them as root (apt-get install ${pkgs[*]}) and rerun"
    fi
    err="$(env -u PYTHONPATH "$real/bin/python" -c "$check_real" 2>&1 | tail -1)" ||
      fail "the Mooncake wheel installed but does not import: $err"
  fi
  echo "$wheel $base_site" > "$stamp"
fi

# -- the drop-in ----------------------------------------------------------------------------------
stamp="$dropin/.kvbridge-dropin"
want="$(cd "$here/dropin/mooncake" && find . -type f \( -name '*.py' -o -name '*.toml' \) -print0 |
        sort -z | xargs -0 sha256sum | sha256sum | cut -d' ' -f1) $base_site"
if [[ -x "$dropin/bin/python" && -f "$stamp" && "$(cat "$stamp")" == "$want" ]] &&
   env PYTHONPATH="$build/python" "$dropin/bin/python" -c "$check_dropin" 2>/dev/null; then
  echo "setup_engines_mooncake_venv: $dropin is up to date (dropin/mooncake)"
else
  overlay "$dropin"
  rm -f "$stamp"
  src="$(mktemp -d)"
  trap 'rm -rf "$src"' EXIT
  cp -r "$here/dropin/mooncake" "$src/mooncake-dropin"  # setuptools leaves nothing in the tree
  echo "setup_engines_mooncake_venv: installing dropin/mooncake into $dropin"
  if ! out="$(PIP_NO_INDEX=1 pip_in "$dropin" --no-deps --no-build-isolation --force-reinstall \
                "$src/mooncake-dropin" 2>&1)"; then
    echo "$out" >&2
    fail "pip could not install dropin/mooncake into $dropin"
  fi
  # kvbridge itself comes from the build tree (PYTHONPATH), as everywhere in the engines' runs.
  env PYTHONPATH="$build/python" "$dropin/bin/python" -c "$check_dropin" ||
    fail "the drop-in installed but 'import mooncake' does not find it (is the build there?)"
  echo "$want" > "$stamp"
fi
# .venv-engines stays free of mooncake.
if env -u PYTHONPATH "$base/bin/python" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("mooncake") is not None)'; then
  :
else
  fail "$base can import a 'mooncake' package; it must not (remove it from that venv)"
fi
