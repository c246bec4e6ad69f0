#!/usr/bin/env bash
# benchmarks/gpu_check.sh: the checks that need a GPU, in one go: the page-copy kernels, then
# device memory through the tcp transport (stage tcp-device) and through a CUDA-enabled UCX
# (stage ucx-device), then the Python suites' GPU tests (stage python-gpu).
#
# For a machine with an NVIDIA GPU, the CUDA toolkit, CMake and a C++ compiler and none of
# kvbridge's other dependencies: builds kernels/ as a CMake project of its own with
# -DKVBRIDGE_CUDA=ON, runs kvb_kernel_tests with KVBRIDGE_REQUIRE_GPU=1 (a CUDA test that
# would skip fails instead), then the kernel benchmark.
#
# Output: progress on stderr, then a summary table of every stage (result: passed, FAILED,
# skipped with the reason, or the kernel benchmark's headline against its goal, page_first pack
# >= 0.85 of a device-to-device copy); the last stdout line is one JSON object
# {"benchmark": "gpu_check", "status", "stages": [{"stage", "result", "detail"}...], "kernels":
# the kernel benchmark's JSON}.
#
# googletest: an installed package if CMake finds one, else the sources in
# $KVBRIDGE_GTEST_SOURCE_DIR, build-gpu-deps/googletest (git-ignored) or /usr/src/googletest.
# A machine with none gets them from one that has them: `mkdir -p build-gpu-deps && cp -r
# /usr/src/googletest build-gpu-deps/` there, and bring build-gpu-deps along. Without
# googletest only the benchmark runs and the script exits 3.
#
# The main project is then configured and built once, in $MAIN_BUILD_DIR, for the three stages
# below (only what they need: the tcp and, with a CUDA-enabled UCX, ucx plugins and tests/gpu;
# with a usable Python also the CUDA kernels and the Python extension). Unlike kernels/ it needs
# what the main project needs besides the toolkit: OpenSSL's headers (libssl-dev), gRPC and
# protobuf, and an installed googletest package (find_package(GTest) in tests/CMakeLists.txt).
#
# Stage tcp-device: CUDA regions through the tcp transport's pinned staging
# (plugins/transport_tcp/README.md, "Device memory"): the TcpDeviceData.* tests of
# kvb_gpu_fake_tests with KVBTEST_REAL_CUDA=1 (real device memory, the driver the engine loads)
# and KVBRIDGE_REQUIRE_GPU=$REQUIRE_GPU. The other tests of that binary need the fake driver and
# are not run here. TCP_DEVICE=0 skips the stage.
#
# Stage ucx-device: device memory through the ucx transport on a CUDA-enabled UCX (cuda_copy,
# cuda_ipc; docs/transports/ucx.md "Device memory"). Needs such a UCX: $UCX_ROOT (a directory
# with include/ and lib/), else the libucx package of `python3` (PyPI's libucx-cu13); without
# either the stage is skipped with a printed reason. The main project is then built against it
# (-DKVBRIDGE_UCX_ROOT) and TcpDeviceData.DeviceMemoryGoesDirectOverUcxWhereItCanElseStagedOverTcp
# runs on real device memory with KVBTEST_REQUIRE_UCX_CUDA=1: the ucx instance must report CUDA
# memory and carry the device ops. UCX_DEVICE=0 skips it.
#
# Stage python-gpu: the Python suites' GPU tests on real CUDA tensors: the torch ops
# (tests/python/test_ops.py), CUDA tensors between two engines and through the store
# (test_engine.py, test_store.py), and the vLLM connector's in-place device KV
# (test_vllm_device_kv.py::test_device_kv_on_a_real_gpu), with KVBRIDGE_REQUIRE_GPU=$REQUIRE_GPU.
# Needs $PYTHON (default python3) with torch (CUDA), pytest and pybind11; without them the stage
# is skipped with a printed reason. PYTHON_GPU=0 skips it.
#
# Stages nccl and verbs: what exists of those transports (below). Stage verbs-staging: the verbs
# transport's host staging of CUDA memory (docs/transports/verbs.md "Host staging") on the fake
# fabric with real device memory and the real driver's copies: kvb_verbs_staging_tests with
# KVBTEST_REAL_CUDA=1 (the tests that need the fake driver's knobs skip).
#
# Until a stage has passed on a GPU machine, the paths it covers are unverified.
#
# KIT=<file>: for a GPU machine that cannot build the main project (no gRPC, protobuf, OpenSSL
# headers or googletest, no network): the file benchmarks/gpu_kit.sh wrote on a machine that
# can (this repository's build tree, its shared libraries, PyPI's CUDA-enabled UCX). It is
# unpacked into the repository root, the kit's build-tree path is linked to this copy when it
# does not exist here, and every stage runs the kit's binaries instead of building: only the
# Python extension is compiled here, for $PYTHON, from csrc/bindings against the kit's
# libraries, CUDA runtime and pybind11 headers (needs a C++20 compiler, c++ or g++ or $CXX, and
# Python.h). No nvcc, CUDA toolkit, CMake or googletest is needed then.
#
# Environment: KIT, BUILD_DIR (default build-gpu, the kernels/ project), MAIN_BUILD_DIR (default
# build-gpu-main), UCX_ROOT, PYTHON, CUDA_ARCHS
# (default: the GPU's compute capability from nvidia-smi, else "80;90"), JOBS (default: all
# cores), BENCH_FLAGS (default --quick), REQUIRE_GPU (default 1; 0 lets the CUDA tests skip, for
# a dry run without a GPU), TCP_DEVICE (default 1), UCX_DEVICE (default 1), PYTHON_GPU (default 1).
# Exit status: 0 all passed, 1 a test failed, 2 a build failed, 3 no googletest.
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${BUILD_DIR:-$here/build-gpu}"
jobs="${JOBS:-$(nproc)}"
bench_flags="${BENCH_FLAGS:---quick}"
log() { echo "gpu_check: $*" >&2; }
# The summary: one "stage|result|detail" per stage (printed as a table at the end, and as the
# "stages" of the last stdout line).
stages=()
record() { stages+=("$1|$2|$3"); }
# Runs a gtest binary (its output to stderr) and records the stage: FAILED, passed, or, when
# tests skipped (no GPU with REQUIRE_GPU=0), "passed" with how many skipped. Returns its status.
gtest_stage() {
  local stage="$1" what="$2" log_file rc skipped
  shift 2
  log_file="$(mktemp)"
  "$@" 2>&1 | tee "$log_file" >&2
  rc=${PIPESTATUS[0]}
  skipped="$(grep -cE '^\[  SKIPPED \] [A-Za-z].* \([0-9]+ ms\)$' "$log_file" || true)"
  rm -f "$log_file"
  if [[ $rc != 0 ]]; then
    record "$stage" FAILED "$what"
  elif [[ $skipped != 0 ]]; then
    record "$stage" passed "$what; $skipped test(s) skipped (REQUIRE_GPU=${REQUIRE_GPU:-1})"
  else
    record "$stage" passed "$what"
  fi
  return "$rc"
}

kit="${KIT:-}"
if [[ -n "$kit" ]]; then
  [[ -f "$kit" ]] || { log "KIT=$kit: no such file"; exit 2; }
  log "unpacking the kit $kit into $here"
  if command -v xz >/dev/null; then
    xz -dc "$kit" | tar -C "$here" -xf - || { log "the kit does not unpack"; exit 2; }
  else  # no xz: Python's lzma
    "${PYTHON:-python3}" -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' \
      "$kit" "$here" || { log "the kit does not unpack"; exit 2; }
  fi
  kit_root="$(cat "$here/build/gpu-kit-root.txt")"
  # The kit's binaries name their libraries and plugins by the path of the tree they were built
  # in: that path must lead here.
  if [[ "$(readlink -f "$kit_root" 2>/dev/null)" != "$(readlink -f "$here")" ]]; then
    if [[ -e "$kit_root" || -L "$kit_root" ]]; then
      log "the kit was built in $kit_root, which exists here and is not this copy"
      exit 2
    fi
    mkdir -p "$(dirname "$kit_root")" && ln -s "$here" "$kit_root" || exit 2
    log "linked $kit_root -> $here (the kit's build-tree path)"
  fi
  export LD_LIBRARY_PATH="$here/build/gpu-kit-lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export KVBRIDGE_PLUGIN_PATH="$here/build/plugins"
  build="$here/build"
fi
if ! command -v nvcc >/dev/null && [[ -x /usr/local/cuda/bin/nvcc ]]; then
  export PATH="/usr/local/cuda/bin:$PATH"
fi
if [[ -z "$kit" ]]; then
  command -v nvcc >/dev/null || { log "no nvcc on PATH or in /usr/local/cuda/bin"; exit 2; }
fi
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv,noheader >&2 ||
    true
fi

archs="${CUDA_ARCHS:-}"
if [[ -z "$archs" ]] && command -v nvidia-smi >/dev/null; then
  archs="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n 1 |
    tr -d '. ')"
fi
archs="${archs:-80;90}"

gtest_src=""
for dir in "${KVBRIDGE_GTEST_SOURCE_DIR:-}" "$here/build-gpu-deps/googletest" \
  /usr/src/googletest; do
  if [[ -n "$dir" && -f "$dir/CMakeLists.txt" ]]; then
    gtest_src="$dir"
    break
  fi
done

generator="Unix Makefiles"
command -v ninja >/dev/null && generator="Ninja"
have_tests=0
if [[ -n "$kit" ]]; then
  [[ -x "$build/tests/kvb_kernel_tests" ]] && have_tests=1
else
log "configuring $build (CUDA architectures $archs, googletest ${gtest_src:-from an installed package if any})"
cmake -S "$here/kernels" -B "$build" -G "$generator" -DCMAKE_BUILD_TYPE=Release \
  -DKVBRIDGE_CUDA=ON "-DCMAKE_CUDA_ARCHITECTURES=$archs" \
  ${gtest_src:+"-DKVBRIDGE_GTEST_SOURCE_DIR=$gtest_src"} >&2 || { log "configure failed"; exit 2; }

targets=(kvb_bench_kernels)
if [[ -d "$build/tests/kernels" ]]; then  # configured only when googletest was found
  targets+=(kvb_kernel_tests)
  have_tests=1
fi
start=$(date +%s)
cmake --build "$build" -j "$jobs" --target "${targets[@]}" >&2 || { log "build failed"; exit 2; }
log "built ${targets[*]} in $(($(date +%s) - start)) s"
fi

status=0
if [[ $have_tests == 1 ]]; then
  log "running kvb_kernel_tests"
  if ! gtest_stage kernel-tests kvb_kernel_tests env KVBRIDGE_REQUIRE_GPU="${REQUIRE_GPU:-1}" \
    "$build/tests/kvb_kernel_tests"; then
    log "kvb_kernel_tests FAILED"
    status=1
  fi
else
  log "no googletest: kvb_kernel_tests not built (see the header of this script)"
  status=3
  record kernel-tests skipped "no googletest"
fi

log "running kvb_bench_kernels $bench_flags"
# shellcheck disable=SC2086
out="$("$build/benchmarks/kvb_bench_kernels" $bench_flags)" || { log "benchmark failed"; status=1; }
bench_line="$(echo "$out" | tail -n 1)"
# The headline: on a GPU, page_first pack over a device-to-device copy of the same bytes (goal
# 0.85); without one the benchmark's headline is the CPU engine's (its own goal), said as such.
field() { echo "$bench_line" | sed -n "s/.*\"headline\": *{[^}]*\"$1\": *\"\{0,1\}\([^,\"}]*\).*/\1/p"; }
if [[ -z "$bench_line" || "$bench_line" != "{"* ]]; then
  record kernel-bench FAILED "no JSON from kvb_bench_kernels"
else
  ratio="$(field ratio)"
  goal="$(field goal)"
  metric="$(field metric)"
  verdict="$(awk -v r="$ratio" -v g="$goal" \
    'BEGIN { print (r != "" && g != "" && r >= g) ? "met" : "missed" }')"
  gpu_reason="$(echo "$bench_line" |
    sed -n 's/.*"gpu": *{"available": *false, *"reason": *"\([^"]*\)".*/\1/p')"
  if [[ -n "$gpu_reason" ]]; then
    record kernel-bench no-gpu "$gpu_reason; CPU headline $metric = $ratio (goal $goal: $verdict)"
  else
    record kernel-bench measured "$metric = $ratio (goal >= $goal: $verdict)"
  fi
fi

# ---- the main project, once, for stages tcp-device, ucx-device and python-gpu ----------------
# Worst status wins: a failed test (1) or build (2) is never hidden by a later stage; 3 (no
# googletest for the kernel tests) yields to either.
merge() { if [[ $1 == 2 || ( $1 == 1 && $status != 2 ) || $status == 0 ]]; then status=$1; fi; }
want_tcp="${TCP_DEVICE:-1}"
want_ucx="${UCX_DEVICE:-1}"
want_py="${PYTHON_GPU:-1}"
ucx_root=""
# Where the ucx-device stage finds a ucx plugin built on a CUDA-enabled UCX.
ucx_plugins=""
if [[ $want_ucx == 1 && -n "$kit" ]]; then
  ucx_plugins="$here/build/plugins_ucx_pypi"
  if [[ ! -f "$ucx_plugins/libkvb_transport_ucx.so" ]]; then
    record ucx-device skipped "the kit has no ucx plugin on PyPI's UCX"
    want_ucx=0
  fi
elif [[ $want_ucx == 1 ]]; then
  ucx_root="${UCX_ROOT:-}"
  if [[ -z "$ucx_root" ]]; then
    ucx_root="$(python3 -c 'import libucx, os; print(os.path.dirname(libucx.__file__))' \
      2>/dev/null || true)"
  fi
  if [[ -z "$ucx_root" || ! -f "$ucx_root/include/ucp/api/ucp.h" ]]; then
    log "stage ucx-device: skipped: no CUDA-enabled UCX (set UCX_ROOT, or pip install" \
      "libucx-cu13 for python3)"
    record ucx-device skipped "no CUDA-enabled UCX (UCX_ROOT, or libucx-cu13 for python3)"
    want_ucx=0
  fi
fi
py="${PYTHON:-python3}"
if [[ $want_py == 1 ]]; then
  # pybind11 builds the extension in the main build; a kit brings its headers. A dry run
  # (REQUIRE_GPU=0) runs the stage without a GPU too: its tests skip, the build is exercised.
  need="import torch, pytest"
  [[ -z "$kit" ]] && need+=", pybind11"
  why="$(REQUIRE_GPU="${REQUIRE_GPU:-1}" "$py" -c "$need
import os
ok = torch.cuda.is_available() or os.environ['REQUIRE_GPU'] == '0'
print('' if ok else 'torch sees no CUDA device')" 2>&1 | tail -n 1)"
  if [[ -n "$why" ]]; then
    log "stage python-gpu: skipped: $py cannot run it ($why)"
    record python-gpu skipped "$py: $why"
    want_py=0
  fi
fi
main_build="${MAIN_BUILD_DIR:-$here/build-gpu-main}"
main_ok=0
# The Python extension for $py, compiled here against the kit's libraries (KIT mode).
build_extension() {
  local suffix inc flags cudalib tmp s cxx pids=() objs=() rc=0
  suffix="$("$py" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')"
  inc="$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
  [[ -f "$inc/Python.h" ]] || { log "no Python.h for $py in $inc"; return 1; }
  flags="$(sed -n 's/^CXXFLAGS=//p' "$main_build/gpu-kit-extension.txt")"
  cudalib="$main_build/gpu-kit-cuda"  # the CUDA runtime the kit's kernels were compiled against
  [[ -f "$cudalib/libcudart_static.a" ]] || { log "no libcudart_static.a in $cudalib"; return 1; }
  cxx="${CXX:-$(command -v c++ || command -v g++ || true)}"
  [[ -n "$cxx" ]] || { log "no C++ compiler (c++, g++ or \$CXX)"; return 1; }
  tmp="$(mktemp -d)"
  for s in $(sed -n 's/^SOURCES=//p' "$main_build/gpu-kit-extension.txt"); do
    # shellcheck disable=SC2086
    "$cxx" $flags -O2 -I"$here/csrc" -I"$here/csrc/include" -I"$here/kernels/include" \
      -isystem "$inc" -isystem "$main_build/gpu-kit-pybind11/include" \
      -c "$here/csrc/bindings/$s" -o "$tmp/$s.o" >&2 &
    pids+=($!)
    objs+=("$tmp/$s.o")
  done
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  if [[ $rc == 0 ]]; then
    rm -f "$main_build"/python/kvbridge/_C.*.so
    "$cxx" -shared -o "$main_build/python/kvbridge/_C$suffix" "${objs[@]}" \
      "-Wl,-rpath,$kit_root/build/csrc/store:$kit_root/build/csrc" \
      "$main_build/csrc/store/libkvbridge_store.so" "$main_build/kernels/libkvbridge_kernels.a" \
      "$main_build/csrc/libkvbridge.so" -L"$cudalib" -lcudadevrt -lcudart_static -lrt -lpthread \
      -ldl >&2 || rc=1
  fi
  rm -rf "$tmp"
  return $rc
}
if [[ -n "$kit" ]]; then
  main_build="$here/build"
  main_ok=1
  if [[ $want_py == 1 ]]; then
    start=$(date +%s)
    if build_extension; then
      log "python extension compiled for $py in $(($(date +%s) - start)) s"
    else
      log "stage python-gpu: the extension did not compile for $py"
      record python-gpu FAILED "extension build for $py"
      want_py=0
      merge 2
    fi
  fi
elif [[ $want_tcp == 1 || $want_ucx == 1 || $want_py == 1 ]]; then
  cfg=(-DCMAKE_BUILD_TYPE=Release -DKVBRIDGE_BUILD_BENCHMARKS=OFF)
  targets=(kvb_gpu_fake_tests kvb_transport_tcp kvbtest_fake_cuda kvb_nccl_tests)
  if [[ $want_ucx == 1 ]]; then
    cfg+=(-DKVBRIDGE_UCX=ON "-DKVBRIDGE_UCX_ROOT=$ucx_root")
    targets+=(kvb_transport_ucx)
  fi
  if [[ $want_py == 1 ]]; then
    cfg+=(-DKVBRIDGE_CUDA=ON "-DCMAKE_CUDA_ARCHITECTURES=$archs" -DKVBRIDGE_BUILD_PYTHON=ON
      "-DPython_EXECUTABLE=$(command -v "$py")")
    targets=(all)  # the extension, the plugins, the staged package
  else
    cfg+=(-DKVBRIDGE_CUDA=OFF -DKVBRIDGE_BUILD_PYTHON=OFF)
  fi
  start=$(date +%s)
  log "main project: configuring $main_build (${cfg[*]})"
  if ! cmake -S "$here" -B "$main_build" -G "$generator" "${cfg[@]}" >&2; then
    log "main project: configure failed (needs libssl-dev, gRPC, protobuf and an installed" \
      "googletest)"
    merge 2
  elif ! {
    # The verbs parts exist only where libibverbs' headers were found.
    if [[ ${targets[0]} != all ]] &&
      grep -q '^KVBRIDGE_HAVE_VERBS:INTERNAL=ON' "$main_build/CMakeCache.txt"; then
      targets+=(kvb_verbs_tests kvb_verbs_staging_tests)
    fi
    cmake --build "$main_build" -j "$jobs" --target "${targets[@]}" >&2
  }; then
    log "main project: build failed"
    merge 2
  else
    main_ok=1
    log "main project: built ${targets[*]} in $(($(date +%s) - start)) s"
  fi
  for stage_on in "tcp-device:$want_tcp" "ucx-device:$want_ucx" "python-gpu:$want_py"; do
    [[ ${stage_on#*:} == 1 && $main_ok == 0 ]] && record "${stage_on%:*}" FAILED "main build"
  done
fi

# ---- stage tcp-device ------------------------------------------------------------------------
if [[ $want_tcp == 1 && $main_ok == 1 ]]; then
  log "stage tcp-device: running TcpDeviceData.* on the real driver"
  if ! gtest_stage tcp-device "TcpDeviceData.* on the real driver" env KVBTEST_REAL_CUDA=1 \
    KVBRIDGE_REQUIRE_GPU="${REQUIRE_GPU:-1}" "$main_build/tests/kvb_gpu_fake_tests" \
    --gtest_filter='TcpDeviceData.*-TcpDeviceData.DeviceMemoryGoesDirectOverUcx*'; then
    log "stage tcp-device: FAILED"
    merge 1
  fi
fi

# ---- stage ucx-device ------------------------------------------------------------------------
if [[ $want_ucx == 1 && $main_ok == 1 ]]; then
  log "stage ucx-device: running the tcp + ucx device test on the real driver"
  if ! gtest_stage ucx-device "tcp + ucx device test, KVBTEST_REQUIRE_UCX_CUDA=1" env \
    KVBTEST_REAL_CUDA=1 KVBTEST_REQUIRE_UCX_CUDA=1 KVBRIDGE_REQUIRE_GPU="${REQUIRE_GPU:-1}" \
    KVBRIDGE_PLUGIN_PATH="${ucx_plugins:-$main_build/plugins}${KVBRIDGE_PLUGIN_PATH:+:$KVBRIDGE_PLUGIN_PATH}" \
    "$main_build/tests/kvb_gpu_fake_tests" \
    --gtest_filter='TcpDeviceData.DeviceMemoryGoesDirectOverUcx*'; then
    log "stage ucx-device: FAILED"
    merge 1
  fi
fi

# ---- stage python-gpu ------------------------------------------------------------------------
if [[ $want_py == 1 && $main_ok == 1 ]]; then
  log "stage python-gpu: running the GPU tests of tests/python"
  if ! (cd "$here" && KVBRIDGE_REQUIRE_GPU="${REQUIRE_GPU:-1}" \
    PYTHONPATH="$main_build/python" "$py" -m pytest -q -rs tests/python/test_ops.py \
    tests/python/test_engine.py::test_cuda_tensors_move_between_engines \
    tests/python/test_store.py::test_cuda_tensors \
    tests/python/test_vllm_device_kv.py::test_device_kv_on_a_real_gpu >&2); then
    log "stage python-gpu: FAILED"
    merge 1
    record python-gpu FAILED "torch ops, engine, store, vLLM device KV"
  else
    record python-gpu passed "torch ops, engine, store, vLLM device KV"
  fi
fi

# ---- stages nccl and verbs: what exists of those transports --------------------------------
# nccl: the loader and probe (NCCL with a GPU: the probe must answer OK), the transport on its
# fake NCCL/CUDA, and the NcclGpu.* cases on the real NCCL and driver (KVBRIDGE_REQUIRE_GPU: they
# fail rather than skip without a usable GPU; the two-instance transfer needs two GPUs and
# skips on one, saying so). verbs: the plugin and its parts on the fake fabric, and device
# discovery (a machine with an RDMA NIC lists its devices; without one the cases that need it
# skip with the probe's reason).
# The NCCL of $PYTHON's nvidia-nccl-cu* wheel (torch's) is put on the library path, where the
# loader's "libnccl.so.2" finds it when no other is given.
nccl_dir="$("$py" -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' \
  2>/dev/null || true)"
[[ -n "$nccl_dir" && -f "$nccl_dir/libnccl.so.2" ]] || nccl_dir=""
if [[ $main_ok == 1 && -x "$main_build/tests/kvb_nccl_tests" ]]; then
  gtest_stage nccl "loader, probe, transport on fake NCCL, real-GPU cases" \
    env KVBRIDGE_REQUIRE_GPU="${REQUIRE_GPU:-1}" \
    LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}${nccl_dir:+:$nccl_dir}" \
    "$main_build/tests/kvb_nccl_tests" || merge 1
else
  record nccl skipped "not built (main build)"
fi
if [[ $main_ok == 1 && -x "$main_build/tests/kvb_verbs_tests" ]]; then
  gtest_stage verbs "discovery, rails, MR cache, the plugin on the fake fabric" \
    "$main_build/tests/kvb_verbs_tests" || merge 1
else
  record verbs skipped "not built (needs libibverbs-dev)"
fi
# verbs-staging: the verbs transport's host staging of CUDA memory (no GPUDirect path on the
# fake fabric) with the real driver's copies and real device memory: the tests that move and
# check bytes (KVBRIDGE_REQUIRE_GPU: fail rather than skip without a usable driver).
if [[ $main_ok == 1 && -x "$main_build/tests/kvb_verbs_staging_tests" ]]; then
  gtest_stage verbs-staging "host staging of device memory, real copies, fake fabric" \
    env KVBTEST_REAL_CUDA=1 KVBRIDGE_REQUIRE_GPU="${REQUIRE_GPU:-1}" \
    "$main_build/tests/kvb_verbs_staging_tests" || merge 1
else
  record verbs-staging skipped "not built (needs libibverbs-dev)"
fi

# ---- summary -----------------------------------------------------------------------------------
json_escape() { local v="${1//\\/\\\\}"; printf '%s' "${v//\"/\\\"}"; }
{
  echo "gpu_check summary (exit status $status):"
  printf '| %-13s | %-8s | %s\n' stage result detail
  printf '|---------------|----------|--------\n'
  for row in "${stages[@]}"; do
    IFS='|' read -r name result detail <<<"$row"
    printf '| %-13s | %-8s | %s\n' "$name" "$result" "$detail"
  done
} >&2
json='{"benchmark": "gpu_check", "status": '"$status"', "stages": ['
sep=""
for row in "${stages[@]}"; do
  IFS='|' read -r name result detail <<<"$row"
  json+="$sep"'{"stage": "'"$(json_escape "$name")"'", "result": "'"$(json_escape "$result")"'", '
  json+='"detail": "'"$(json_escape "$detail")"'"}'
  sep=", "
done
json+='], "kernels": '"${bench_line:-null}"'}'
echo "$json"
exit $status
