#!/usr/bin/env bash
# benchmarks/gpu_check.sh: the page-copy kernel checks that need a GPU, in one go.
#
# For a machine with an NVIDIA GPU, the CUDA toolkit, CMake and a C++ compiler and none of
# kvbridge's other dependencies: builds kernels/ as a CMake project of its own with
# -DKVBRIDGE_CUDA=ON, runs kvb_kernel_tests with KVBRIDGE_REQUIRE_GPU=1 (a CUDA test that
# would skip fails instead), then the kernel benchmark, whose JSON is the last stdout line.
#
# googletest: an installed package if CMake finds one, else the sources in
# $KVBRIDGE_GTEST_SOURCE_DIR, build-gpu-deps/googletest (git-ignored) or /usr/src/googletest.
# A machine with none gets them from one that has them: `mkdir -p build-gpu-deps && cp -r
# /usr/src/googletest build-gpu-deps/` there, and bring build-gpu-deps along. Without
# googletest only the benchmark runs and the script exits 3.
#
# Environment: BUILD_DIR (default build-gpu), CUDA_ARCHS (default: the GPU's compute
# capability from nvidia-smi, else "80;90"), JOBS (default: all cores), BENCH_FLAGS (default
# --quick), REQUIRE_GPU (default 1; 0 lets the CUDA tests skip, for a dry run without a GPU).
# Exit status: 0 all passed, 1 a test failed, 2 the build failed, 3 no googletest.
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${BUILD_DIR:-$here/build-gpu}"
jobs="${JOBS:-$(nproc)}"
bench_flags="${BENCH_FLAGS:---quick}"
log() { echo "gpu_check: $*" >&2; }

if ! command -v nvcc >/dev/null && [[ -x /usr/local/cuda/bin/nvcc ]]; then
  export PATH="/usr/local/cuda/bin:$PATH"
fi
command -v nvcc >/dev/null || { log "no nvcc on PATH or in /usr/local/cuda/bin"; exit 2; }
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
log "configuring $build (CUDA architectures $archs, googletest ${gtest_src:-from an installed package if any})"
cmake -S "$here/kernels" -B "$build" -G "$generator" -DCMAKE_BUILD_TYPE=Release \
  -DKVBRIDGE_CUDA=ON "-DCMAKE_CUDA_ARCHITECTURES=$archs" \
  ${gtest_src:+"-DKVBRIDGE_GTEST_SOURCE_DIR=$gtest_src"} >&2 || { log "configure failed"; exit 2; }

targets=(kvb_bench_kernels)
have_tests=0
if [[ -d "$build/tests/kernels" ]]; then  # configured only when googletest was found
  targets+=(kvb_kernel_tests)
  have_tests=1
fi
start=$(date +%s)
cmake --build "$build" -j "$jobs" --target "${targets[@]}" >&2 || { log "build failed"; exit 2; }
log "built ${targets[*]} in $(($(date +%s) - start)) s"

status=0
if [[ $have_tests == 1 ]]; then
  log "running kvb_kernel_tests"
  if ! KVBRIDGE_REQUIRE_GPU="${REQUIRE_GPU:-1}" "$build/tests/kvb_kernel_tests" >&2; then
    log "kvb_kernel_tests FAILED"
    status=1
  fi
else
  log "no googletest: kvb_kernel_tests not built (see the header of this script)"
  status=3
fi

log "running kvb_bench_kernels $bench_flags"
# shellcheck disable=SC2086
out="$("$build/benchmarks/kvb_bench_kernels" $bench_flags)" || { log "benchmark failed"; status=1; }
echo "$out" | tail -n 1
exit $status
