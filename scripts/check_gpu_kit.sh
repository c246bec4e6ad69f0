#!/usr/bin/env bash
# Checks that the GPU kit still works, on this machine without a GPU, so that it is ready the day
# a GPU machine is lent (benchmarks/gpu_kit.sh, benchmarks/gpu_check.sh "KIT="; part of
# `make test`): builds the kit from the build tree, then runs gpu_check.sh from it as a dry run
# (REQUIRE_GPU=0: the CUDA tests skip, everything else runs) in a mount namespace where the build
# tree and the PyPI UCX library directory are empty directories the kit is unpacked into. So
# every binary, library and plugin the stages load comes from the kit, as on the GPU machine
# (the Python extension is compiled from the kit there too). The kit's own check fails the build
# of a kit that would need a library this machine has and a GPU machine may lack.
#   BUILD_DIR  the build tree (default build); PYTHON  the interpreter with torch and pytest
#              for the python-gpu stage (default .venv/bin/python)
# Skips, saying why, without nvcc in the build or without the rights to make a mount
# namespace (root, unshare).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="$(cd "${BUILD_DIR:-$here/build}" && pwd)"
py="${PYTHON:-$here/.venv/bin/python}"
log() { echo "check_gpu_kit: $*" >&2; }

if ! grep -q '^CMAKE_CUDA_COMPILER:[A-Z]*=/' "$build/CMakeCache.txt" 2>/dev/null; then
  log "skipped: $build has no CUDA compiler (the kit packs the CUDA build)"
  exit 0
fi
if [[ $(id -u) != 0 ]] || ! unshare -m true 2>/dev/null; then
  log "skipped: cannot make a mount namespace here (needs root and unshare -m)"
  exit 0
fi

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
OUT="$work/kit" BUILD_DIR="$build" "$here/benchmarks/gpu_kit.sh"

# What the kit replaces: the build tree, and the UCX the PyPI plugin was built on (its RUNPATH).
mounts=("$build")
pypi_plugin="$(sed -n 's/^KVBRIDGE_UCX_PYPI_PLUGIN_DIR:INTERNAL=//p' "$build/CMakeCache.txt")"
if [[ -n "$pypi_plugin" ]]; then
  mounts+=("$(readelf -d "$pypi_plugin/libkvb_transport_ucx.so" |
    sed -n 's/.*RUNPATH.*\[\(.*\)\]/\1/p')")
fi
i=0
binds=""
for m in "${mounts[@]}"; do
  mkdir -p "$work/empty$i"
  binds+="mount --bind '$work/empty$i' '$m' && "
  i=$((i + 1))
done
log "dry run of gpu_check.sh from the kit (${mounts[*]} replaced by the kit)"
set +e
unshare -m bash -c "${binds} cd '$here' && KIT='$work/kit/kit.tar.xz' REQUIRE_GPU=0 \
  PYTHON='$py' JOBS=2 benchmarks/gpu_check.sh" >"$work/out.txt"
rc=$?
set -e
last="$(tail -n 1 "$work/out.txt")"
echo "$last"
if [[ $rc != 0 ]]; then
  log "FAILED: gpu_check.sh from the kit exited $rc (its summary is above)"
  exit 1
fi
# Every stage ran (passed, or the kernel benchmark's CPU-only "no-gpu"): none skipped or failed.
"$py" - "$last" <<'PY'
import json, sys
d = json.loads(sys.argv[1])
bad = [s for s in d["stages"] if s["result"] not in ("passed", "no-gpu")]
assert d["status"] == 0 and not bad, bad or d["status"]
missing = {"kernel-tests", "kernel-bench", "tcp-device", "python-gpu", "nccl"} - {
    s["stage"] for s in d["stages"]}
assert not missing, f"stages that did not run: {sorted(missing)}"
print("check_gpu_kit: every stage ran from the kit:",
      ", ".join(f'{s["stage"]} {s["result"]}' for s in d["stages"]))
PY
