#!/usr/bin/env bash
# Checks the package the way users install it: a fresh venv, torch from PyPI, `pip install .`,
# then kvbridge used from outside the source tree (no PYTHONPATH, no KVBRIDGE_PLUGIN_PATH):
# the plugins must be found inside the installed package.
#   KVBRIDGE_BUILD_DIR  reuse a CMake build tree (make test passes its own), else build-py/
#   CHECK_VENV          where the fresh venv goes (default build-py/check-venv; recreated)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${CHECK_VENV:-$here/build-py/check-venv}"
torch_req="$(grep -E '^torch' "$here/python/requirements-dev.txt")"

rm -rf "$venv"
mkdir -p "$(dirname "$venv")"
python3 -m venv "$venv"
echo "check_pip_install: fresh venv $venv; installing $torch_req from PyPI"
"$venv/bin/python" -m pip install --disable-pip-version-check --quiet "$torch_req"
echo "check_pip_install: pip install $here"
"$venv/bin/python" -m pip install --disable-pip-version-check --quiet "$here"

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cd "$work"
KVB_SOURCE_TREE="$here" env -u PYTHONPATH -u KVBRIDGE_PLUGIN_PATH "$venv/bin/python" - <<'PY'
import os, torch, kvbridge, kvbridge.ops as ops
pkg = os.path.dirname(kvbridge.__file__)
assert "site-packages" in pkg, pkg
plugins = sorted(os.listdir(os.path.join(pkg, "plugins")))
for so in ("libkvb_transport_tcp.so", "libkvb_storage_dram.so", "libkvb_storage_ssd.so"):
    assert so in plugins, plugins
with kvbridge.Cluster(nodes=2, dram_bytes_per_node=32 << 20, replica_num=2) as c:
    store = c.client()
    page = torch.randn(2, 16, 4, 64)
    store.put("installed/page", page)
    out = torch.empty_like(page)
    assert store.get_into("installed/page", out) == page.numel() * 4 and torch.equal(out, page)
# The loader searched the package's plugins directory, and not the tree it was built in.
try:
    kvbridge.TransferEngine(transports=["no-such-transport"])
    raise SystemExit("a missing transport was not refused")
except kvbridge.errors.UnavailableError as e:
    searched = str(e)
except kvbridge.KvbError as e:
    searched = str(e)
assert os.path.join(pkg, "plugins") in searched, searched
assert os.environ["KVB_SOURCE_TREE"] not in searched.replace(pkg, ""), searched
print("check_pip_install: import, plugins from", pkg, "and an embedded-cluster round trip: OK")
print("check_pip_install: kvbridge.ops loaded; CUDA kernels:", ops.cuda_available())
PY
env -u PYTHONPATH -u KVBRIDGE_PLUGIN_PATH "$venv/bin/kvbridge" bench --pages 64 --page-kib 16 --json
echo "check_pip_install: the kvbridge command works"
