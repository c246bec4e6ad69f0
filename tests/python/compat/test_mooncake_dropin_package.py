"""The Mooncake drop-in package (dropin/mooncake, distribution ``kvbridge-mooncake-dropin``):
it installs with pip, ``import mooncake`` is then kvbridge's compat layer, and the stock import
lines of SGLang and vLLM (``from mooncake.engine import TransferEngine``, ``from mooncake.store
import MooncakeDistributedStore, ReplicateConfig, MooncakeHostMemAllocator``) move bytes on
kvbridge. The engines themselves on it: tests/engines/test_dropin_*.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, python_env

DROPIN = REPO / "dropin" / "mooncake"


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The drop-in installed by pip (no network, no dependencies) into a fresh target dir."""
    target = tmp_path_factory.mktemp("dropin-site")
    build = tmp_path_factory.mktemp("dropin-build")
    env = dict(os.environ, PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    # The source tree stays clean: setuptools builds in a copy (no build/ or egg-info left).
    subprocess.run(["cp", "-r", str(DROPIN), str(build / "src")], check=True)
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                           "--no-build-isolation", "--target", str(target), str(build / "src")],
                          env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0 and "No module named pip" in proc.stderr:
        pytest.skip("pip is not available in this interpreter")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return target


def _run(code: str, site: Path, with_kvbridge: bool = True, timeout: float = 120):
    env = python_env() if with_kvbridge else dict(os.environ)
    paths = [str(site)] + ([env["PYTHONPATH"]] if with_kvbridge and env.get("PYTHONPATH") else [])
    env["PYTHONPATH"] = os.pathsep.join(paths)  # without kvbridge: the drop-in's dir only
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd="/")


def test_installs_as_its_own_distribution_and_names_itself(installed):
    dist = [p.name for p in installed.iterdir() if p.name.endswith(".dist-info")]
    assert len(dist) == 1 and dist[0].startswith("kvbridge_mooncake_dropin-"), dist
    assert sorted(p.name for p in (installed / "mooncake").glob("*.py")) == [
        "__init__.py", "engine.py", "store.py"]
    readme = (DROPIN / "README.md").read_text()
    assert "REPLACES the real Mooncake" in readme
    out = _run("import importlib.metadata as m, mooncake; "
               "print(m.version('kvbridge-mooncake-dropin'), mooncake.IMPLEMENTATION, "
               "mooncake.__file__)", installed)
    assert out.returncode == 0, out.stderr
    version, impl, path = out.stdout.split()
    assert version == "0.1.0" and impl == "kvbridge" and path.startswith(str(installed))


_STOCK_IMPORTS = r"""
import ctypes, sys
from mooncake.engine import TransferEngine
from mooncake.store import MooncakeDistributedStore, ReplicateConfig, MooncakeHostMemAllocator
import kvbridge
import kvbridge.compat.mooncake as compat
assert TransferEngine is compat.TransferEngine
assert MooncakeDistributedStore is compat.MooncakeDistributedStore
assert ReplicateConfig is compat.ReplicateConfig

# The transfer engine as SGLang's and vLLM's PD paths drive it (P pushes into D).
d, p = TransferEngine(), TransferEngine()
assert d.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
assert p.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "") == 0  # rdma: tcp, with a warning
dst, src = ctypes.create_string_buffer(1 << 16), ctypes.create_string_buffer(b"kv" * (1 << 15))
assert d.batch_register_memory([ctypes.addressof(dst)], [1 << 16]) == 0
assert p.batch_register_memory([ctypes.addressof(src)], [1 << 16]) == 0
session = f"127.0.0.1:{d.get_rpc_port()}"
assert p.send_probe(session) == 0
assert p.batch_transfer_sync_write(session, [ctypes.addressof(src)], [ctypes.addressof(dst)],
                                   [1 << 16]) == 0
assert dst.raw == src.raw[:1 << 16]
# Both engines live in this process: the bytes moved by a memory copy, not over tcp
# (docs/transfer-engine.md "Peers in the same process").
assert p.get_engine().peer_health(d.get_engine().node_id)["local_copy_ops"] >= 1
assert p.get_engine().transport_stats("tcp")["bytes_written"] == 0

# The store as SGLang's HiCache backend drives it, on a kvbridge master.
master = kvbridge.Master(master_listen="127.0.0.1:0")
store = MooncakeDistributedStore()
assert store.setup("127.0.0.1", "P2PHANDSHAKE", 32 << 20, 16 << 20, "tcp", "", master.address,
                   None) == 0
assert store.put("warmup", bytes(4096)) == 0 and store.is_exist("warmup") == 1
alloc = MooncakeHostMemAllocator()
page = alloc.alloc(8192)
ctypes.memmove(page, b"x" * 8192, 8192)
assert store.register_buffer(page, 8192) == 0
cfg = ReplicateConfig()
assert not hasattr(cfg, "session_ids")  # SGLang probes it
cfg.group_ids = ["g"]
assert store.batch_put_from_multi_buffers(["k"], [[page, page + 4096]], [[4096, 4096]], cfg) == [0]
assert store.batch_is_exist(["k", "absent"]) == [1, 0]
store.close()
master.close()
print("ok")
"""


def test_stock_import_lines_move_bytes_on_kvbridge(installed):
    out = _run(_STOCK_IMPORTS, installed)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_without_kvbridge_the_import_error_says_what_this_package_is(installed):
    out = _run("import mooncake", installed, with_kvbridge=False)
    if out.returncode == 0:
        pytest.skip("kvbridge is installed in this interpreter itself")
    assert "kvbridge-mooncake-dropin" in out.stderr and "ImportError" in out.stderr
