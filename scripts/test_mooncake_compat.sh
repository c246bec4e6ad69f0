#!/usr/bin/env bash
# Runs the Mooncake compatibility suites (tests/python/compat, written against Mooncake's
# Python API) twice:
#   1. with the project venv (.venv): kvbridge's compat classes only (the real Mooncake skips);
#   2. when scripts/setup_mooncake_venv.sh can make .venv-mooncake: in that venv, against
#      kvbridge's classes and the real Mooncake wheel side by side.
# Both use the kvbridge built at $BUILD_DIR (default build/, `make build`) through PYTHONPATH.
# Prints both results at the end; exits 1 when a run failed. Mooncake being unavailable here is
# not a failure: its run is reported as not run, with the reason. Extra arguments go to pytest;
# PYTHON (the project venv's interpreter) and MOONCAKE_VENV override the defaults.
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${BUILD_DIR:-$here/build}"
project_py="${PYTHON:-$here/.venv/bin/python}"
mooncake_py="${MOONCAKE_VENV:-$here/.venv-mooncake}/bin/python"
suite="tests/python/compat"

if [[ ! -d "$build/python/kvbridge" ]]; then
  echo "test_mooncake_compat: no kvbridge package in $build/python (run make build)" >&2
  exit 1
fi
if [[ ! -x "$project_py" ]]; then
  echo "test_mooncake_compat: $project_py missing (run scripts/setup_venv.sh)" >&2
  exit 1
fi
cd "$here"

# Runs pytest with interpreter $1 and a label $2; sets $summary to pytest's closing line.
run_suite() {
  local py="$1" label="$2" log rc
  log="$(mktemp)"
  echo "=== $label: $py -m pytest $suite"
  PYTHONPATH="$build/python${PYTHONPATH:+:$PYTHONPATH}" "$py" -m pytest "$suite" -q -rsx \
    "${@:3}" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  summary="$(grep -E '^(=+ )?[0-9]+ (passed|failed|skipped|error|xfailed)' "$log" | tail -1 |
             sed -E 's/^=+ //; s/ =+$//')"
  [[ -n "$summary" ]] || summary="pytest exited $rc without a summary"
  rm -f "$log"
  return "$rc"
}

status=0
run_suite "$project_py" "project venv (kvbridge only)" "$@" || status=1
project_summary="$summary"

if setup_out="$("$here/scripts/setup_mooncake_venv.sh" 2>&1)"; then
  echo "$setup_out"
  run_suite "$mooncake_py" ".venv-mooncake (kvbridge and the real Mooncake)" "$@" || status=1
  mooncake_summary="$summary"
else
  echo "$setup_out"
  mooncake_summary="not run: $(echo "$setup_out" | tail -1)"
fi

echo
echo "test_mooncake_compat: project venv (kvbridge only):          $project_summary"
echo "test_mooncake_compat: .venv-mooncake (kvbridge + Mooncake):   $mooncake_summary"
exit "$status"
