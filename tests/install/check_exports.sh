#!/usr/bin/env bash
# check_exports.sh <library|store|plugin> <file.so>...
#
# The CTest tests Exports.* (tests/install/CMakeLists.txt): fails when a shared object
# exports (nm -D --defined-only) a symbol outside its allow-list, and names each one.
#   library  libkvbridge.so: the public API (what kvbridge/*.h declares with KVBRIDGE_API) and
#            the KVBRIDGE_INTERNAL_API entry points of csrc/core/export_internal.h, listed
#            one by one below.
#   store    libkvbridge_store.so: what kvbridge/store.h declares with KVBRIDGE_API.
#   plugin   a plugin: kvb_plugin_query and nothing else.
# Both may also carry what the toolchain emits for the C++ standard library whatever the
# visibility settings: weak (W, V) or unique (u) instantiations of templates in namespace std
# or libstdc++'s __gnu_cxx, and the static locals of those (std is declared with default
# visibility, so -fvisibility=hidden does not reach them). Their mangled names start with
# _ZNSt, _ZSt, _ZTVNSt, _ZZNSt, _ZN9__gnu_cxx, ...
# Each file must also export what it exists for (TransferEngine::Create, kvb_plugin_query), so
# an empty or unreadable symbol table does not pass.
set -u
NM=${NM:-nm}
kind=$1
shift
[ $# -gt 0 ] || { echo "usage: $0 <library|store|plugin> <file.so>..." >&2; exit 2; }

# Demangled names (nm -C) that libkvbridge.so may export, as extended regexes.
library_allow=(
  # Public API: kvbridge/status.h, options.h, engine.h.
  '^kvbridge::Status::'
  '^kvbridge::StatusCodeName(\[abi:cxx11\])?\('
  '^kvbridge::StatusOriginName\('
  '^kvbridge::EngineOptions::'
  '^kvbridge::PeerId::'
  '^kvbridge::TransferEngine::'
  # KVBRIDGE_INTERNAL_API (csrc/core/export_internal.h): for libkvbridge_store.so and the
  # Python extension, which must share the library's single PluginHost cache.
  '^kvbridge::core::PluginHost::'
  '^kvbridge::core::StorageInstance::'
  '^kvbridge::core::RequestServer::'
  '^kvbridge::core::PluginRegistry::DefaultSearchPath\('
  '^kvbridge::core::(Encode|Decode)Descriptor(\[abi:cxx11\])?\('
  # For libkvbridge_store.so: the store client's checksums of CUDA buffers, and
  # MemoryKind::kDetect in its RegisterBuffer.
  '^kvbridge::core::DeviceBounce::'
  '^kvbridge::core::DetectMemoryKind\('
)
library_required='^kvbridge::TransferEngine::Create\('
# Demangled names libkvbridge_store.so may export: kvbridge/store.h.
store_allow=(
  '^kvbridge::(StoreOptions|NodeOptions|MasterOptions)::FromEnv\('
  '^kvbridge::(StoreClient|StorageNode|MasterServer|HaMaster|EmbeddedCluster)::'
  '^kvbridge::StoreOpName\('
  '^kvbridge::QueryClusterStatus\('
)
store_required='^kvbridge::StoreClient::'
plugin_allow=('^kvb_plugin_query$')
std_template='^_Z(T[VIS]|GV|Z)*(N[KVr]*)?(St|9__gnu_cxx)'
plugin_required='^kvb_plugin_query$'

case $kind in
  library) allow=("${library_allow[@]}"); required=$library_required ;;
  store) allow=("${store_allow[@]}"); required=$store_required ;;
  plugin) allow=("${plugin_allow[@]}"); required=$plugin_required ;;
  *) echo "$0: unknown kind '$kind' (library, store or plugin)" >&2; exit 2 ;;
esac

failed=0
for so in "$@"; do
  if [ ! -f "$so" ]; then
    echo "FAIL $so: no such file"
    failed=1
    continue
  fi
  # Same order in both listings (--no-sort), so line i of one is line i of the other.
  if ! mangled=$("$NM" -D --defined-only --no-sort "$so" 2>&1) ||
     ! demangled=$("$NM" -D --defined-only --no-sort -C "$so" 2>&1); then
    echo "FAIL $so: $NM failed: $mangled"
    failed=1
    continue
  fi
  stray=()
  found_required=0
  count=0
  while IFS=$'\t' read -r mline dline; do
    [ -n "$mline" ] || continue
    # "<address> <type> <name>"; the demangled name may hold spaces.
    type=$(awk '{print $2}' <<<"$mline")
    mname=$(awk '{print $3}' <<<"$mline")
    dname=${dline#* * }
    count=$((count + 1))
    [[ $dname =~ $required ]] && found_required=1
    if [[ $type =~ ^[WVu]$ && $mname =~ $std_template ]]; then
      continue  # a standard-library template instantiation
    fi
    ok=0
    for re in "${allow[@]}"; do
      if [[ $dname =~ $re ]]; then
        ok=1
        break
      fi
    done
    [ $ok = 1 ] || stray+=("$type $dname")
  done < <(paste <(printf '%s\n' "$mangled") <(printf '%s\n' "$demangled"))
  if [ ${#stray[@]} -gt 0 ]; then
    echo "FAIL $so exports ${#stray[@]} symbol(s) outside the $kind allow-list" \
         "(tests/install/check_exports.sh):"
    printf '  %s\n' "${stray[@]}"
    failed=1
  elif [ $found_required = 0 ]; then
    echo "FAIL $so: does not export '$required' (of $count exported symbols)"
    failed=1
  else
    echo "ok   $so: $count exported symbols, all allowed"
  fi
done
exit $failed
