#!/usr/bin/env bash
# benchmarks/gpu_kit.sh: packs what benchmarks/gpu_check.sh runs out of this machine's build
# tree into one file, for a GPU machine that cannot build kvbridge itself: one with the CUDA
# driver, a C++ compiler and python3 with torch and pytest, but without gRPC, protobuf, OpenSSL
# headers or googletest, and with no network to install them (a borrowed GPU machine).
#
#   benchmarks/gpu_kit.sh            # here: builds what is missing, writes build-gpu-kit/kit.tar.xz
#   KIT=build-gpu-kit/kit.tar.xz benchmarks/gpu_check.sh   # there, from the repository root
#
# The kit holds, under their paths in this tree (build/...), stripped of debug information:
# the CUDA kernel tests and benchmark, kvb_gpu_fake_tests (its TcpDeviceData.* cases run on
# the real driver), kvb_nccl_tests, kvb_verbs_tests and kvb_verbs_staging_tests, libkvbridge,
# libkvbridge_store, the plugins (tcp, nccl, verbs, and ucx built on PyPI's CUDA-enabled UCX
# with that UCX's libraries, for the ucx-device stage), the staged Python package without its
# extension, the kernels' static library, the CUDA runtime they were compiled against and
# pybind11's headers (gpu_check compiles the extension there for that machine's Python), and
# every shared library these need beyond the C and C++ runtimes (gRPC, protobuf, abseil,
# OpenSSL, ...) in build/gpu-kit-lib. The binaries keep the absolute
# paths of this tree (rpaths, the test binaries' plugin directory): gpu_check links this tree's
# root to the copy's when that path does not exist there.
#
# Before it packs, the kit is checked: every shared library each packed program or plugin
# needs must resolve to the kit itself or to the C/C++ runtimes (ldd with the kit's library
# path); a library left to the system fails the script, naming it.
#
# Environment: BUILD_DIR (only the repository's build/, the `make build` tree; it must have the
# CUDA kernels: nvcc found and KVBRIDGE_CUDA not OFF; the PyPI UCX plugin is packed when it was
# built), OUT (default build-gpu-kit).
# Exit status: 0 written, 1 a check failed, 2 a build failed.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="$(cd "${BUILD_DIR:-$here/build}" && pwd)"
out="${OUT:-$here/build-gpu-kit}"
log() { echo "gpu_kit: $*" >&2; }
# gpu_check's KIT mode runs the kit from build/ of the repository: the kit is made from that tree.
if [[ "$build" != "$here/build" ]]; then
  log "BUILD_DIR must be the repository's build/ ($here/build), where gpu_check runs the kit from"
  exit 1
fi

if ! grep -q '^CMAKE_CUDA_COMPILER:[A-Z]*=/' "$build/CMakeCache.txt" 2>/dev/null ||
  grep -q '^KVBRIDGE_CUDA:STRING=OFF' "$build/CMakeCache.txt"; then
  log "$build has no CUDA kernels (configure with -DKVBRIDGE_CUDA=ON; nvcc is needed here)"
  exit 2
fi
ucx_dir="$(sed -n 's/^KVBRIDGE_UCX_PYPI_PLUGIN_DIR:INTERNAL=//p' "$build/CMakeCache.txt")"
targets=(kvb_kernel_tests kvb_bench_kernels kvb_gpu_fake_tests kvbtest_fake_cuda kvb_nccl_tests
  kvb_transport_tcp kvb_transport_nccl kvbridge_python kvbridge_kernels)
grep -q '^KVBRIDGE_HAVE_VERBS:INTERNAL=ON' "$build/CMakeCache.txt" &&
  targets+=(kvb_verbs_tests kvb_verbs_staging_tests kvb_transport_verbs)
[[ -n "$ucx_dir" ]] && targets+=(kvb_transport_ucx_pypi)
log "building ${targets[*]} in $build"
cmake --build "$build" --target "${targets[@]}" >&2 || { log "build failed"; exit 2; }

stage="$out/stage"
rm -rf "$stage"
mkdir -p "$stage"
rel() { echo "${1#"$here"/}"; }
is_elf() { [[ -f "$1" && ! "$1" =~ \.a$ ]] && readelf -h "$1" >/dev/null 2>&1; }
# Copies a file of this tree to the same path under the stage; ELF files lose their debug
# information.
pack() {
  local src="$1" dst
  dst="$stage/$(rel "$src")"
  mkdir -p "$(dirname "$dst")"
  cp -P "$src" "$dst"
  if [[ ! -L "$dst" ]] && is_elf "$dst"; then strip --strip-debug "$dst"; fi
}
programs=("$build/tests/kvb_kernel_tests" "$build/benchmarks/kvb_bench_kernels"
  "$build/tests/kvb_gpu_fake_tests" "$build/tests/kvb_nccl_tests")
[[ -x "$build/tests/kvb_verbs_tests" ]] && programs+=("$build/tests/kvb_verbs_tests")
[[ -x "$build/tests/kvb_verbs_staging_tests" ]] && programs+=("$build/tests/kvb_verbs_staging_tests")
# build/plugins' ucx (built on the system's UCX, without CUDA) stays behind: its libucp would
# land in the kit's library path, which comes before the PyPI plugin's RUNPATH.
for f in "${programs[@]}" "$build"/tests/libkvbtest_fake_cuda.so "$build"/csrc/libkvbridge.so* \
  "$build"/csrc/store/libkvbridge_store.so* "$build"/plugins/*.so \
  "$build/kernels/libkvbridge_kernels.a"; do
  [[ -e "$f" && "$f" != "$build/plugins/libkvb_transport_ucx.so" ]] && pack "$f"
done
if [[ -n "$ucx_dir" ]]; then
  for f in "$ucx_dir"/*.so; do pack "$f"; done
  # The UCX the plugin was built on (its RUNPATH names this directory): shared objects only.
  ucx_lib="$(readelf -d "$ucx_dir/libkvb_transport_ucx.so" | sed -n 's/.*RUNPATH.*\[\(.*\)\]/\1/p')"
  while IFS= read -r f; do pack "$f"; done < <(find "$ucx_lib" \( -name '*.so.*' -o -name '*.conf' \) \
    \( -type f -o -type l \))
fi
# The Python package as the build staged it (links to python/kvbridge, which travels with the
# repository), without its extension (built there for that Python) and without caches.
(cd "$build/python" && find kvbridge -name '__pycache__' -prune -o \( -type f -o -type l \) \
  ! -name '_C.*' -print) |
  while IFS= read -r f; do pack "$build/python/$f"; done
# The CUDA runtime the kernels were compiled against (static: the extension links it), so the
# extension built there needs no CUDA toolkit of the same version.
nvcc="$(sed -n 's/^CMAKE_CUDA_COMPILER:[A-Z]*=//p' "$build/CMakeCache.txt")"
mkdir -p "$stage/build/gpu-kit-cuda"
cp "$(dirname "$nvcc")/../lib64/libcudart_static.a" "$(dirname "$nvcc")/../lib64/libcudadevrt.a" \
  "$stage/build/gpu-kit-cuda/"
pybind_inc="$("$here/.venv/bin/python" -c 'import pybind11; print(pybind11.get_include())')"
mkdir -p "$stage/build/gpu-kit-pybind11"
cp -r "$pybind_inc" "$stage/build/gpu-kit-pybind11/"
# How the extension is compiled and linked here, for gpu_check to repeat there.
python3 - "$build" >"$stage/build/gpu-kit-extension.txt" <<'PY'
import json, sys
build = sys.argv[1]
flags = [a for e in json.load(open(f"{build}/compile_commands.json"))
         if e["file"].endswith("csrc/bindings/module.cc")
         for a in e["command"].split()[1:] if a.startswith(("-D", "-std=", "-f"))]
if not flags:
    sys.exit(f"gpu_kit: {build}/compile_commands.json has no csrc/bindings/module.cc")
print("CXXFLAGS=" + " ".join(flags))
print("SOURCES=module.cc engine_bindings.cc store_bindings.cc kernels_bindings.cc pd_bindings.cc")
PY

# Every shared library the packed ELF files need, beyond the C/C++ runtimes and the CUDA
# driver, goes to build/gpu-kit-lib.
libdir="$stage/build/gpu-kit-lib"
mkdir -p "$libdir"
runtime='^(linux-vdso|ld-linux|libc|libm|libdl|librt|libpthread|libstdc\+\+|libgcc_s|libcuda|libnvidia-ml)\.so'
# UCX's transport modules (lib/ucx/) are left out of the scan: UCX dlopens them once its own
# libraries are in the process, so their libucs/libuct come from the packed UCX whatever ldd
# says of them alone; the system's UCX must never enter the kit's library path.
elves=()
while IFS= read -r f; do
  is_elf "$f" && elves+=("$f")
done < <(find "$stage" -type f ! -name '*.a' ! -path '*/libucx/lib/ucx/*')
for f in "${elves[@]}"; do
  ldd "$f" 2>/dev/null | awk '/=> \//{print $1, $3}' | while read -r name path; do
    [[ "$name" =~ $runtime ]] && continue
    case "$path" in "$here"/*) continue ;; esac  # from this tree: packed above if needed
    [[ -e "$libdir/$name" ]] || cp -L "$path" "$libdir/$name"
  done
done
# The check: with the kit's libraries first and this tree's paths as packed, nothing but the
# runtimes may come from the system. (Here the tree is this one; gpu_check links it there.)
bad=0
for f in "${elves[@]}"; do
  while read -r name path; do
    [[ "$name" =~ $runtime ]] && continue
    case "$path" in
      "$stage"/*) ;;  # the kit's own (its libraries, $ORIGIN-relative UCX libraries)
      "$here"/*) [[ -e "$stage/$(rel "$path")" ]] || { log "$(rel "$f") needs $path, not packed"; bad=1; } ;;
      *) log "$(rel "$f") needs $name from the system ($path)"; bad=1 ;;
    esac
  done < <(LD_LIBRARY_PATH="$libdir" ldd "$f" 2>/dev/null | awk '/=> \//{print $1, $3}')
done
[[ $bad == 0 ]] || { log "the kit is incomplete (above)"; exit 1; }

echo "$here" >"$stage/build/gpu-kit-root.txt"
tar -C "$stage" -cf - . | xz -T0 -6 >"$out/kit.tar.xz"
rm -rf "$stage"
log "wrote $out/kit.tar.xz ($(du -h "$out/kit.tar.xz" | cut -f1)); on the GPU machine, from the" \
  "repository root: KIT=$(rel "$out")/kit.tar.xz benchmarks/gpu_check.sh"
