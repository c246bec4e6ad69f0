#!/usr/bin/env bash
# Checks the package the way the README tells a user to install it: a fresh clone, a fresh
# venv with nothing in it (torch is an optional extra), `pip install .` with no kvbridge
# variable set; then kvbridge used from outside the source tree (no PYTHONPATH, no
# KVBRIDGE_PLUGIN_PATH): the plugins must be found inside the installed package, and nothing
# it imports may be missing from its declared dependencies. Then the same clone is installed
# into venvs layered on the project's venv (.venv: torch from PyPI, as a user's "with torch")
# and on the engines' venv (.venv-engines: another torch), and used with their torch. Layers
# see the base venv's packages; what pip installs lands in the layer only (installing a
# several-GB torch into a third venv cost two minutes of every CI run).
#   CHECK_DIR   where the clone and the venvs go (default build-py/check; recreated)
# A working tree with uncommitted changes is checked with them: the clone gets the tracked and
# untracked (not ignored) files of the working tree copied over it, and says so.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
check="${CHECK_DIR:-$here/build-py/check}"
clean_env=(env -u PYTHONPATH -u KVBRIDGE_PLUGIN_PATH -u KVBRIDGE_BUILD_DIR -u KVBRIDGE_CUDA
           -u KVBRIDGE_BUILD_TYPE -u KVBRIDGE_SKIP_PREFLIGHT)

# The clone keeps its build-py/ between runs of this check (ccache and ninja make the rebuild
# cheap); everything else is made anew.
clone="$check/kvbridge"
if [[ -d "$clone/build-py" ]]; then mv "$clone/build-py" "$check/.kept-build-py"; fi
rm -rf "$clone" "$check/venv" "$check/torch-venv" "$check/engines-venv"
mkdir -p "$check"
git clone --quiet "$here" "$clone"
if [[ -d "$check/.kept-build-py" ]]; then mv "$check/.kept-build-py" "$clone/build-py"; fi
if [[ -n "$(git -C "$here" status --porcelain)" ]]; then
  echo "check_pip_install: the working tree has uncommitted changes; checking them too"
  (cd "$here" && git ls-files -z -c -o --exclude-standard | tar --null -T - -cf -) | tar -C "$clone" -xf -
fi

python3 -m venv "$check/venv"
echo "check_pip_install: fresh clone $clone, fresh venv (no torch)"
echo "check_pip_install: pip install . (in the clone, no kvbridge variables set)"
(cd "$clone" && "${clean_env[@]}" "$check/venv/bin/python" -m pip install --disable-pip-version-check --quiet .)

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cd "$work"
use_check() {  # $1: the venv's python; $2: "torch" where the venv has torch, else "no-torch"
  KVB_SOURCE_TREE="$clone" KVB_EXPECT="$2" "${clean_env[@]}" "$1" - <<'PY'
import importlib.util, os, kvbridge
import kvbridge.integrations
has_torch = importlib.util.find_spec("torch") is not None
assert has_torch == (os.environ["KVB_EXPECT"] == "torch"), (has_torch, os.environ["KVB_EXPECT"])
pkg = os.path.dirname(kvbridge.__file__)
assert "site-packages" in pkg, pkg
plugins = sorted(os.listdir(os.path.join(pkg, "plugins")))
for so in ("libkvb_transport_tcp.so", "libkvb_transport_nccl.so", "libkvb_storage_dram.so",
           "libkvb_storage_ssd.so"):
    assert so in plugins, plugins
# ucx is bundled where the build found libucx-dev (scripts/setup.sh installs it); verbs is not
# (docs/transports/verbs.md says why).
assert ("libkvb_transport_ucx.so" in plugins) == os.path.exists("/usr/include/ucp/api/ucp.h"), plugins
assert "libkvb_transport_verbs.so" not in plugins, plugins
with kvbridge.Cluster(nodes=2, dram_bytes_per_node=32 << 20, replica_num=2) as c:
    store = c.client()
    if has_torch:
        import torch
        page = torch.randn(2, 16, 4, 64)
        store.put("installed/page", page)
        out = torch.empty_like(page)
        assert store.get_into("installed/page", out) == page.numel() * 4 and torch.equal(out, page)
    else:
        page = os.urandom(32 << 10)
        store.put("installed/page", page)
        out = bytearray(len(page))
        assert store.get_into("installed/page", out) == len(page) and bytes(out) == page
# The loader searched the package's plugins directory, and not the tree it was built in.
try:
    kvbridge.TransferEngine(transports=["no-such-transport"])
    raise SystemExit("a missing transport was not refused")
except kvbridge.KvbError as e:
    searched = str(e)
assert os.path.join(pkg, "plugins") in searched, searched
assert os.environ["KVB_SOURCE_TREE"] not in searched.replace(pkg, ""), searched
# The bundled nccl plugin is opt-in and harmless without a GPU: an engine naming it starts
# (NCCL and a GPU here) or fails naming why nccl cannot run; default transports never need it.
try:
    kvbridge.TransferEngine(transports=["nccl"]).close()
    nccl = "usable"
except kvbridge.KvbError as e:
    assert "nccl" in str(e), str(e)
    nccl = "unavailable here"
# ucx (opt-in) runs from the package's plugins directory: one WRITE between two engines over it.
ucx = "not built"
if "libkvb_transport_ucx.so" in plugins:
    a = kvbridge.TransferEngine(transports=["ucx"], node_id="wheel-ucx-a")
    b = kvbridge.TransferEngine(transports=["ucx"], node_id="wheel-ucx-b")
    src, dst = bytearray(os.urandom(1 << 20)), bytearray(1 << 20)
    a.register(src)
    seg = b.register(dst)
    a.add_peer(b.descriptor())
    a.write(src, "wheel-ucx-b", seg, 0)
    assert dst == src, "a WRITE over the bundled ucx plugin did not land"
    a.close(); b.close()
    ucx = "ok"
if has_torch:
    import kvbridge.ops as ops
    flavour = "torch " + torch.__version__ + ", CUDA kernels: " + str(ops.cuda_available())
else:
    flavour = "no torch"
print("check_pip_install:", flavour, "- nccl plugin", nccl, "- ucx write", ucx,
      "- import, plugins from", pkg,
      "and an embedded-cluster round trip: OK")
PY
}
use_check "$check/venv/bin/python" no-torch
"${clean_env[@]}" "$check/venv/bin/kvbridge" bench --pages 64 --page-kib 16 --json
# master, node and status are the daemon program shipped in the wheel (kvbridge/bin/kvbridge):
# its flags, and a master and a node from the installed package alone.
"${clean_env[@]}" "$check/venv/bin/kvbridge" master --help | grep -q -- "--min-replicas"
"${clean_env[@]}" "$check/venv/bin/python" - "$check/venv/bin/kvbridge" <<'PY'
import json, signal, subprocess, sys
kvbridge = sys.argv[1]
def start(*args):
    p = subprocess.Popen([kvbridge, *args, "--metrics-listen", "off", "--json"],
                         stdout=subprocess.PIPE, text=True)
    ready = json.loads(p.stdout.readline())
    assert ready["event"] == "ready", ready
    return p, ready
master, ready = start("master", "--listen", "127.0.0.1:0")
node, _ = start("node", "--master", ready["address"], "--dram-bytes", "32M", "--node-id", "pip-node")
status = json.loads(subprocess.run([kvbridge, "status", "--master", ready["address"], "--json"],
                                   capture_output=True, text=True, check=True).stdout)
assert [n["node_id"] for n in status["nodes"]] == ["pip-node"], status
node.send_signal(signal.SIGTERM)  # drains, then stops
assert node.wait(60) == 0
master.send_signal(signal.SIGINT)
assert master.wait(30) == 0
print("check_pip_install: kvbridge master, node and status from the wheel's daemon: OK")
PY
echo "check_pip_install: the kvbridge command works"

check_layered() {  # $1: the base venv, $2: the layer's directory
  python3 -m venv "$2"
  base_site="$("$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  layer_site="$("$2/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  echo "$base_site" > "$layer_site/base-venv.pth"
  echo "check_pip_install: pip install . into a layer over $1"
  (cd "$clone" && "${clean_env[@]}" "$2/bin/python" -m pip install --disable-pip-version-check --quiet .)
  use_check "$2/bin/python" torch
}
# The project's venv: torch from PyPI (python/requirements-dev.txt), as `make setup` made it.
check_layered "$here/.venv" "$check/torch-venv"
engines="$here/.venv-engines"
if [[ -x "$engines/bin/python" ]]; then
  check_layered "$engines" "$check/engines-venv"  # torch 2.13, vLLM, SGLang
else
  echo "check_pip_install: $engines does not exist (scripts/setup_engines_venv.sh); the install into the engines' venv was not checked"
fi
