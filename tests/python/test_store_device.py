"""The store client with CUDA buffers from Python (docs/store.md "Device buffers"), on machines
without a GPU: each case runs in a child process whose CUDA driver (KVBRIDGE_CUDA_DRIVER) is
the fake of the build tree (tests/fakes/fake_cuda.cc, built as
<build>/tests/libkvbtest_fake_cuda.so), with guarded device memory, so any CPU access to it
(by kvbridge's Python or native side) kills the child. A CUDA torch tensor cannot be made
without a GPU; a test double with the attributes kvbridge._buffers reads of one stands in
(test_store.py::test_cuda_tensors runs the real thing where there is a GPU)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import kvbridge

from conftest import python_env

# <build>/python/kvbridge/__init__.py -> <build>/tests/libkvbtest_fake_cuda.so (not resolve():
# the build tree stages the package as symlinks into the source tree).
FAKE_CUDA = (Path(os.path.abspath(kvbridge.__file__)).parents[2] / "tests" /
             "libkvbtest_fake_cuda.so")

# Shared by the children: the fake driver's controls and a stand-in for a CUDA tensor.
PRELUDE = r'''
import ctypes, os, sys
import kvbridge
from kvbridge import errors

class _Device:
    type = "cuda"
    def __init__(self, index):
        self.index = index

class CudaTensorDouble:
    """The attributes kvbridge._buffers reads of a contiguous CUDA uint8 torch.Tensor."""
    is_cuda = True
    def __init__(self, address, n, device):
        self.address, self.n, self.device = address, n, _Device(device)
        self.shape = (n,)
    def data_ptr(self): return self.address
    def numel(self): return self.n
    def element_size(self): return 1
    def is_contiguous(self): return True

# kvbridge._buffers takes an object of a class from a torch module for a tensor.
CudaTensorDouble.__module__ = "torch.test_double"
'''

FAKE_PRELUDE = PRELUDE + r'''
fake = ctypes.CDLL(os.environ["KVBRIDGE_CUDA_DRIVER"])
fake.kvbtest_fake_cuda_alloc.restype = ctypes.c_void_p
fake.kvbtest_fake_cuda_alloc.argtypes = [ctypes.c_int, ctypes.c_size_t]
fake.kvbtest_fake_cuda_host_view.restype = ctypes.c_void_p
fake.kvbtest_fake_cuda_host_view.argtypes = [ctypes.c_void_p]
fake.kvbtest_fake_cuda_set_guarded.argtypes = [ctypes.c_int]
fake.kvbtest_fake_cuda_fail_next_copy_to_host.argtypes = [ctypes.c_int]

def device_alloc(device, n):
    """Guarded fake device memory: (address kvbridge sees, address the test reads)."""
    fake.kvbtest_fake_cuda_set_guarded(1)
    p = fake.kvbtest_fake_cuda_alloc(device, n)
    fake.kvbtest_fake_cuda_set_guarded(0)
    view = fake.kvbtest_fake_cuda_host_view(p)
    assert p and view and view != p
    return p, view
'''


def run_child(code: str, env_extra: dict) -> None:
    env = python_env()
    env.update(env_extra)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          timeout=120)
    out = proc.stdout.decode() + proc.stderr.decode()
    assert proc.returncode == 0, f"child exited {proc.returncode}:\n{out[-4000:]}"
    assert "CHILD OK" in proc.stdout.decode(), out[-4000:]


def needs_fake_driver() -> None:
    if not FAKE_CUDA.exists():
        pytest.skip(f"no fake CUDA driver at {FAKE_CUDA} (the build tree's tests/fakes; "
                    "an installed kvbridge has none)")


def test_registered_cuda_tensors_round_trip():
    needs_fake_driver()
    run_child(FAKE_PRELUDE + r'''
N = 1 << 20
src, src_view = device_alloc(0, N)
dst, dst_view = device_alloc(1, N)
payload = os.urandom(N)
ctypes.memmove(src_view, payload, N)
half = N // 2
with kvbridge.Cluster(nodes=2, dram_bytes_per_node=32 << 20) as cluster:
    store = cluster.client()
    store.register_buffer(CudaTensorDouble(src, N, 0))
    store.register_buffer(CudaTensorDouble(dst, N, 1))
    # batch_put_from / batch_get_into with tensors (one buffer, or a list: K and V).
    sts = store.batch_put_from(
        ["a", "b"], [CudaTensorDouble(src, half, 0),
                     [CudaTensorDouble(src + half, 100, 0),
                      CudaTensorDouble(src + half + 100, half - 100, 0)]])
    assert all(s.ok for s in sts), sts
    res = store.batch_get_into(["a", "b"], [CudaTensorDouble(dst + half, half, 1),
                                            CudaTensorDouble(dst, half, 1)])
    assert [r.size for r in res] == [half, half], res
    assert ctypes.string_at(dst_view + half, half) == payload[:half]
    assert ctypes.string_at(dst_view, half) == payload[half:]
    # Into host memory, and the single-key calls on registered device memory.
    assert store.get("b") == payload[half:]
    store.put("c", CudaTensorDouble(src + 4096, 4096, 0))
    assert store.get_into("c", CudaTensorDouble(dst + 65536, 4096, 1)) == 4096
    assert ctypes.string_at(dst_view + 65536, 4096) == payload[4096:8192]
    # The pointer lists (the Mooncake layer's path) take device addresses as they are.
    assert store.batch_put_from_ptrs(["d"], [src + 12345], [1000]) == {}
    sizes, failed = store.batch_get_into_ptrs(["d"], [dst + 200000], [1000])
    assert (sizes, failed) == ([1000], {}), (sizes, failed)
    assert ctypes.string_at(dst_view + 200000, 1000) == payload[12345:13345]
    # A failed checksum copy fails that key alone, with the CUDA error.
    fake.kvbtest_fake_cuda_fail_next_copy_to_host(700)
    sts = store.batch_put_from(["e", "f"], [CudaTensorDouble(src, 4096, 0),
                                            CudaTensorDouble(src + 4096, 4096, 0)])
    assert sts[0].name == "IO_ERROR" and "ILLEGAL_ADDRESS" in sts[0].message, sts[0]
    assert sts[1].ok, sts[1]
    assert store.batch_exists(["e", "f"]) == [False, True]
    # A device buffer not registered is that key's NOT_REGISTERED.
    other, _ = device_alloc(0, 4096)
    sts = store.batch_put_from(["g"], [CudaTensorDouble(other, 4096, 0)])
    assert sts[0].name == "NOT_REGISTERED", sts[0]
print("CHILD OK")
''', {"KVBRIDGE_CUDA_DRIVER": str(FAKE_CUDA)})


def test_cuda_tensor_without_a_driver_is_a_named_error():
    run_child(PRELUDE + r'''
with kvbridge.Cluster(nodes=1, dram_bytes_per_node=16 << 20) as cluster:
    store = cluster.client()
    host = bytearray(4096)
    address = kvbridge._C.buffer_address(host, True)[0]
    try:
        store.register_buffer(CudaTensorDouble(address, 4096, 0))
        raise AssertionError("registered a CUDA buffer without a driver")
    except errors.UnavailableError as e:
        assert "CUDA device buffer needs the CUDA driver" in str(e), e
        assert "/nonexistent/libcuda.so.1" in str(e), e
    store.register_buffer(host)  # host memory is unaffected
    store.put("k", b"v" * 10)
    assert store.get("k") == b"v" * 10
print("CHILD OK")
''', {"KVBRIDGE_CUDA_DRIVER": "/nonexistent/libcuda.so.1"})


def test_mooncake_api_registers_raw_gpu_pointers_as_device_memory():
    """The Mooncake-compatible API takes raw pointers to host or GPU memory alike (SGLang's and
    vLLM's Mooncake backends register GPU KV that way): kvbridge registers each as what it is
    (MemoryKind::kDetect), so a GPU pointer is moved as device memory (here through tcp's
    staging, every CPU access to it faulting) by the transfer engine and the store."""
    needs_fake_driver()
    run_child(FAKE_PRELUDE + r'''
from kvbridge.compat._mooncake_engine import TransferEngine
from kvbridge.compat._mooncake_store import MooncakeDistributedStore
N = 1 << 20
src, src_view = device_alloc(0, N)
dst, dst_view = device_alloc(1, N)
payload = os.urandom(N)
ctypes.memmove(src_view, payload, N)
host = ctypes.create_string_buffer(N)
server, client = TransferEngine(), TransferEngine()
assert server.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
assert client.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
assert server.register_memory(dst, N) == 0
assert server.register_memory(ctypes.addressof(host), N) == 0
assert client.register_memory(src, N) == 0
session = f"127.0.0.1:{server.get_rpc_port()}"
# GPU to GPU and GPU to host, one-sided writes from the client.
assert client.transfer_sync_write(session, src + 4096, dst + 8192, 65536) == 0
assert ctypes.string_at(dst_view + 8192, 65536) == payload[4096:4096 + 65536]
assert client.transfer_sync_write(session, src, ctypes.addressof(host), N) == 0
assert host.raw == payload
# The store: register_buffer of a GPU pointer, put_from it, get_into another GPU buffer.
master = kvbridge.Master(master_listen="127.0.0.1:0")
store = MooncakeDistributedStore()
assert store.setup("127.0.0.1", "P2PHANDSHAKE", 64 << 20, 16 << 20, "tcp", "",
                   master.address) == 0
other, other_view = device_alloc(1, N)
assert store.register_buffer(src, N) == 0
assert store.register_buffer(other, N) == 0
assert store.put_from("gpu-key", src + 100, 300000) == 0
assert store.get_into("gpu-key", other + 5, 300000) == 300000
assert ctypes.string_at(other_view + 5, 300000) == payload[100:300100]
store.close()
master.close()
print("CHILD OK")
''', {"KVBRIDGE_CUDA_DRIVER": str(FAKE_CUDA)})
