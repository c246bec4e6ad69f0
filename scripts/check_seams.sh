#!/usr/bin/env bash
# Fails (listing file:line) when code outside the plugin seam touches a plugin's ops table.
#
# Only the loader and the instance wrappers call plugin ops: csrc/core/plugin_loader.*,
# plugin_host.*, transport_instance.*, storage_instance.* (docs/transfer-engine.md, "Plugin host
# and instance wrappers"). Everything else goes through TransportInstance / StorageInstance.
# Not searched: plugins/ and examples/ (a plugin fills its own table). Allowed besides: tests
# of the raw ABI on purpose (tests/unit/test_plugin_loader.cc, tests/abi/) and the tcp plugin's
# own tests (tests/tcp/: they drive the plugin through its ABI, slot by slot), and the SDK's tests (tests/sdk/:
# they check the ops tables the SDK generates, slot by slot).
#
# Usage: scripts/check_seams.sh [repo root]   (CTest runs it as Seams.NoOpsTableOutsideWrappers)
set -euo pipefail

root="${1:-$(cd "$(dirname "$0")/.." && pwd)}"
cd "$root"

# ops->, ops_->, ops()->, Ops()->: a call through an ops table; transport_ops() / storage_ops(): taking
# one from the loader; descriptor->ops: reading the table pointer itself.
pattern='(\b[oO]ps_?(\(\))?->|\btransport_ops\(\)|\bstorage_ops\(\)|->ops\b)'

allowed='^(csrc/core/(plugin_loader|plugin_host|transport_instance|storage_instance)\.(h|cc)|tests/unit/test_plugin_loader\.cc|tests/abi/|tests/sdk/|tests/tcp/)'

hits=$(grep -rnE --include='*.h' --include='*.cc' --include='*.cpp' --include='*.c' \
         "$pattern" csrc tests benchmarks 2>/dev/null | grep -vE "$allowed" || true)
if [[ -n "$hits" ]]; then
  echo "check_seams: plugin ops tables used outside the wrappers" \
       "(use core::TransportInstance / core::StorageInstance, csrc/core/*_instance.h):" >&2
  echo "$hits" >&2
  exit 1
fi
echo "check_seams: OK (no ops-table access outside the wrappers)"
