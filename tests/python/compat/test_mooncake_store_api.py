"""One suite written against Mooncake's store API (``MooncakeDistributedStore``), run against
every implementation present in this interpreter:

* ``kvbridge``: kvbridge.compat.mooncake on an in-process kvbridge Master (always);
* ``mooncake``: the real wheel (``mooncake.store``) on its own ``mooncake_master`` over TCP
  with ``P2PHANDSHAKE`` metadata, when it imports here: scripts/test_mooncake_compat.sh runs
  this file again in .venv-mooncake (scripts/setup_mooncake_venv.sh) for that.

Where the two differ by design the test says which behaviour belongs to which
(docs/mooncake.md lists the differences). Where Mooncake's behaviour is a bug, reported
(docs/mooncake.md) or found by this suite, the test asserts kvbridge's behaviour and marks
Mooncake's run xfail with the reason.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import itertools
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pytest

from conftest import free_port, freeze, python_env, read_line

# Mooncake Store's error numbers (mooncake-store/include/types.h).
NO_AVAILABLE_HANDLE = -200
INVALID_PARAMS = -600
OBJECT_NOT_FOUND = -704
OBJECT_HAS_LEASE = -706
TRANSFER_FAIL = -800
RPC_FAIL = -900

SEGMENT_BYTES = 64 << 20
LOCAL_BUFFER_BYTES = 16 << 20
# The real master's read lease (default 10 s), shortened so objects read by one test do not
# stay pinned for long; still far longer than a get followed by a remove.
MOONCAKE_LEASE_MS = 2000


@dataclass
class Impl:
    """One implementation of Mooncake's store API plus a master it can use."""

    name: str
    store_cls: type
    config_cls: type
    master: str  # host:port
    closers: list = field(default_factory=list)

    def new_store(self, segment_bytes: int = SEGMENT_BYTES,
                  local_buffer_bytes: int = LOCAL_BUFFER_BYTES) -> Any:
        store = self.store_cls()
        rc = store.setup("127.0.0.1", "P2PHANDSHAKE", segment_bytes, local_buffer_bytes, "tcp",
                         "", self.master)
        assert rc == 0, f"{self.name}: setup returned {rc}"
        self.closers.append(store.close)
        return store

    def replicate(self, replica_num: int) -> Any:
        # Mooncake's pybind ReplicateConfig takes no constructor arguments; both take this.
        config = self.config_cls()
        config.replica_num = replica_num
        return config

    @property
    def is_mooncake(self) -> bool:
        return self.name == "mooncake"


def _start_kvbridge() -> tuple[Impl, Callable[[], None]]:
    import kvbridge
    from kvbridge.compat.mooncake import MooncakeDistributedStore, ReplicateConfig

    master = kvbridge.Master(master_listen="127.0.0.1:0")
    return Impl("kvbridge", MooncakeDistributedStore, ReplicateConfig, master.address), master.close


def _start_mooncake(log_dir: Path) -> tuple[Impl, Callable[[], None]]:
    try:
        import mooncake
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig
    except ImportError as e:
        pytest.skip(f"the real Mooncake store does not import in this interpreter ({e}); "
                    "scripts/test_mooncake_compat.sh runs this suite in .venv-mooncake")
    binary = Path(mooncake.__file__).parent / "mooncake_master"
    if not os.access(binary, os.X_OK):
        pytest.skip(f"the Mooncake wheel has no runnable mooncake_master ({binary})")
    rpc_port, metrics_port = free_port(), free_port()
    log = log_dir / "mooncake_master.log"
    proc = subprocess.Popen(
        [str(binary), f"--rpc_port={rpc_port}", "--rpc_address=127.0.0.1",
         f"--metrics_port={metrics_port}", "--metrics_host=127.0.0.1",
         "--enable_metric_reporting=false", f"--default_kv_lease_ttl={MOONCAKE_LEASE_MS}"],
        stdout=log.open("wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 15
    while True:
        try:
            socket.create_connection(("127.0.0.1", rpc_port), timeout=0.2).close()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.skip(f"mooncake_master did not start: {log.read_text()[-1000:]}")
            time.sleep(0.05)

    def stop() -> None:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    return (Impl("mooncake", MooncakeDistributedStore, ReplicateConfig, f"127.0.0.1:{rpc_port}"),
            stop)


def _start(name: str, log_dir: Path) -> tuple[Impl, Callable[[], None]]:
    it, stop_master = _start_kvbridge() if name == "kvbridge" else _start_mooncake(log_dir)

    def stop() -> None:
        for close in reversed(it.closers):
            close()
        stop_master()

    return it, stop


@pytest.fixture(scope="module", params=["kvbridge", "mooncake"])
def impl(request, tmp_path_factory):
    it, stop = _start(request.param, tmp_path_factory.mktemp(request.param))
    yield it
    stop()


@pytest.fixture(scope="module")
def store(impl):
    """A client that also contributes a segment to the pool (Mooncake's embedded mode)."""
    return impl.new_store()


class Arena:
    """Registered memory handed out in pieces (raw addresses, as Mooncake takes them)."""

    def __init__(self, store: Any, size: int = 8 << 20):
        self._buf = ctypes.create_string_buffer(size)
        self.base = ctypes.addressof(self._buf)
        self.size = size
        self._next = 0
        assert store.register_buffer(self.base, size) == 0

    def alloc(self, n: int, fill: bytes | None = None) -> int:
        n_aligned = (n + 63) // 64 * 64
        assert self._next + n_aligned <= self.size, "arena exhausted"
        addr = self.base + self._next
        self._next += n_aligned
        if fill is not None:
            write(addr, fill)
        return addr


@pytest.fixture(scope="module")
def arena(store):
    return Arena(store)


def write(addr: int, data: bytes) -> None:
    ctypes.memmove(addr, data, len(data))


def read(addr: int, n: int) -> bytes:
    return ctypes.string_at(addr, n)


_ids = itertools.count()


@pytest.fixture
def key(request):
    """Fresh key names per test (the store is shared by the module)."""
    prefix = f"{request.node.name}-{next(_ids)}"
    return lambda suffix="": f"{prefix}/{suffix}"


def pattern(n: int, seed: int) -> bytes:
    return bytes((seed * 131 + i * 7) & 0xFF for i in range(n))


# -- setup and lifetime ----------------------------------------------------------------------
def test_setup_positional_and_dict_forms(impl, store, key):
    # Pure clients (the module's store holds the segment): a Mooncake segment holder takes
    # about 2 s to close.
    positional = impl.new_store(segment_bytes=0)
    by_dict = impl.store_cls()
    assert by_dict.setup({"local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE",
                          "global_segment_size": 0, "local_buffer_size": 16 << 20,
                          "protocol": "tcp", "master_server_addr": impl.master}) == 0
    impl.closers.append(by_dict.close)
    assert positional.put(key("a"), b"from positional") == 0
    assert by_dict.get(key("a")) == b"from positional"
    assert by_dict.put(key("b"), b"from dict") == 0
    assert positional.get(key("b")) == b"from dict"
    assert positional.health_check() == 0 and by_dict.health_check() == 0


def test_setup_without_a_master_fails(impl):
    if impl.is_mooncake:
        pytest.skip("Mooncake retries for about 90 s before setup returns -1")
    store = impl.store_cls()
    started = time.monotonic()
    assert store.setup("127.0.0.1", "P2PHANDSHAKE", 16 << 20, 0, "tcp", "",
                       f"127.0.0.1:{free_port()}") == -1
    assert time.monotonic() - started < 5
    assert store.setup("127.0.0.1", "P2PHANDSHAKE", 16 << 20, 0, "tcp", "",
                       "etcd://127.0.0.1:2379") == -1  # HA master addresses: not in kvbridge
    assert store.health_check() == 1


def test_setup_dict_takes_size_strings(impl, key):
    """Mooncake's dict form reads sizes as numbers with an optional unit of powers of 1024
    ("16MB", "16 MB", "1gb"); one it cannot read fails setup with INVALID_PARAMS."""
    store = impl.store_cls()
    config = {"local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE",
              "global_segment_size": "16MB", "local_buffer_size": "16 mb", "protocol": "tcp",
              "master_server_addr": impl.master}
    assert store.setup(config) == 0
    impl.closers.append(store.close)
    assert store.put_batch([key("a"), key("b")], [b"x" * 1000, b"y"]) == 0  # the local buffer
    assert store.get_batch([key("a"), key("b")]) == [b"x" * 1000, b"y"]
    for bad in ("16MiB", "-16MB", "16 XB", "1_000", "", True):
        assert impl.store_cls().setup(dict(config, global_segment_size=bad)) == INVALID_PARAMS


def test_size_strings_read_as_mooncake_reads_them():
    # The strings were checked against the real wheel's setup (0.3.13.post1).
    from kvbridge.compat._mooncake_store import _InvalidSize, _size

    sizes = {"16MB": 16 << 20, "16 MB": 16 << 20, "1gb": 1 << 30, "16M": 16 << 20,
             "16k": 16 << 10, "16 kb": 16 << 10, "1tb": 1 << 40, "16B": 16, "1024": 1024,
             "  16MB  ": 16 << 20, "1.5GB": 3 << 29, ".5GB": 1 << 29, "32\tMB": 32 << 20,
             "+32MB": 32 << 20, "0x2000000": 32 << 20, "040000000": 40000000, "3.2e7": 32000000,
             "33554432.7": 32 << 20, 16.5: 16, 7: 7}
    assert {v: _size({"k": v}, "k") for v in sizes} == sizes
    for bad in ("16MiB", "16 mib", "abc", "", "-16MB", "16XB", "32_000_000", "inf", True):
        with pytest.raises(_InvalidSize):
            _size({"k": bad}, "k")


_AFTER_CLOSE = """
import sys
from mooncake.store import MooncakeDistributedStore
store = MooncakeDistributedStore()
assert store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", sys.argv[1]) == 0
assert store.close() == 0
print(store.put("after-close", b"v"), flush=True)
"""


def test_health_check_and_close(impl, key):
    fresh = impl.store_cls()
    assert fresh.health_check() == 1  # not set up
    s = impl.new_store(segment_bytes=0)
    assert s.health_check() == 0
    assert s.put(key("k"), b"v") == 0
    assert s.close() == 0
    assert s.health_check() == 1
    assert s.close() == 0  # idempotent
    if impl.is_mooncake:
        # A call after close() crashes the real store's process, so it runs in a child.
        child = subprocess.run([sys.executable, "-c", _AFTER_CLOSE, impl.master],
                               env=python_env(), capture_output=True, timeout=60)
        if child.returncode < 0:
            pytest.xfail(f"Mooncake bug (found here): put() after close() kills the process "
                         f"with signal {-child.returncode}; kvbridge returns INVALID_PARAMS, "
                         "as Mooncake's RealClient does for a client not set up")
        assert child.stdout.split() == [b"-600"]
        return
    assert s.put(key("k2"), b"v") == INVALID_PARAMS
    assert s.is_exist(key("k")) == INVALID_PARAMS
    assert s.get(key("k")) == b""
    assert s.batch_get_into([key("k")], [1 << 20], [8]) == [INVALID_PARAMS]
    assert fresh.put(key("k3"), b"v") == INVALID_PARAMS


def _http_get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_client_http_server_serves_prometheus_metrics(impl, store, key):
    """setup(..., enable_client_http_server=True, client_http_port=P): the client's metrics
    in Prometheus text on P's /metrics. The names are each implementation's own (kvbridge's:
    docs/client-metrics.md)."""
    if not impl.is_mooncake:
        pytest.importorskip("prometheus_client")  # kvbridge.metrics serves through it
    # A port out of range fails setup (Mooncake: INVALID_PARAMS; kvbridge: -1).
    bad = impl.store_cls()
    assert bad.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", impl.master,
                     enable_client_http_server=True, client_http_port=0) < 0
    impl.closers.append(bad.close)
    port = free_port()  # a pure client; the module's store holds the segment
    s = impl.store_cls()
    assert s.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", impl.master,
                   enable_client_http_server=True, client_http_port=port) == 0
    impl.closers.append(s.close)
    assert s.put(key("m"), b"v" * 10) == 0
    assert s.get(key("m")) == b"v" * 10
    assert s.get(key("absent")) == b""
    deadline = time.monotonic() + 10
    while True:  # Mooncake starts its server asynchronously
        try:
            status, text = _http_get(f"http://127.0.0.1:{port}/metrics")
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    assert status == 200
    assert "# TYPE" in text
    if not impl.is_mooncake:
        assert 'kvbridge_client_gets_total{result="hit"} 1.0' in text
        assert 'kvbridge_client_gets_total{result="miss"} 1.0' in text
        s.close()  # stops the endpoint
        with pytest.raises(OSError):
            _http_get(f"http://127.0.0.1:{port}/metrics", timeout=2)


def _host_allocator(impl: Impl) -> Any:
    if impl.is_mooncake:
        try:
            from mooncake.store import MooncakeHostMemAllocator
        except ImportError as e:
            pytest.skip(f"this Mooncake wheel has no MooncakeHostMemAllocator ({e})")
        return MooncakeHostMemAllocator()
    from kvbridge.compat.mooncake import MooncakeHostMemAllocator
    return MooncakeHostMemAllocator()


def test_host_mem_allocator(impl, store, key):
    # SGLang allocates its HiCache host pool with it (storage backend "mooncake"), wraps the
    # address in a tensor, then registers it with the store.
    alloc = _host_allocator(impl)
    size = 3 * 4096 + 100
    addr = alloc.alloc(size)
    assert addr != 0 and addr % 4096 == 0
    assert read(addr, size) == bytes(size)  # zeroed
    write(addr, pattern(size, 9))
    assert store.register_buffer(addr, size) == 0
    assert store.batch_put_from([key("a")], [addr], [size]) == [0]
    write(addr, bytes(size))
    assert store.batch_get_into([key("a")], [addr], [size]) == [size]
    assert read(addr, size) == pattern(size, 9)
    assert store.unregister_buffer(addr) == 0
    assert alloc.free(addr) == 0
    if not impl.is_mooncake:
        assert alloc.alloc(0) == 0
        assert alloc.free(addr) == -1  # freed already
        huge = type(alloc)(use_hugepage=True)  # falls back to normal pages when none are free
        a2 = huge.alloc(1 << 20)
        assert a2 != 0 and huge.free(a2) == 0


def test_setup_dummy_is_a_pure_client_of_the_master(impl, store, key):
    """SGLang's standalone_storage mode: setup_dummy(mem_pool_size, local_buffer_size,
    server_address). Mooncake's server_address is a mooncake_client daemon that owns the pool;
    kvbridge's is a kvbridge master, and the pool is the nodes registered with it (here the
    module's store, which contributes a segment)."""
    if impl.is_mooncake:
        pytest.skip("Mooncake's setup_dummy needs a mooncake_client daemon, which this suite "
                    "does not start")
    from kvbridge.compat.mooncake import MooncakeHostMemAllocator
    import kvbridge
    before = kvbridge.cluster_status(impl.master)
    dummy = impl.store_cls()
    assert dummy.setup_dummy(64 << 20, 16 << 20, impl.master) == 0
    impl.closers.append(dummy.close)
    def node_ids(status: dict) -> set:
        return {n["node_id"] for n in status["nodes"]}

    assert node_ids(kvbridge.cluster_status(impl.master)) == node_ids(before)  # no segment
    assert dummy.health_check() == 0
    alloc = MooncakeHostMemAllocator()
    size = 64 << 10
    addr = alloc.alloc(2 * size)
    write(addr, pattern(size, 3))
    assert dummy.register_buffer(addr, 2 * size) == 0
    assert dummy.batch_put_from([key("p")], [addr], [size]) == [0]
    assert store.get(key("p")) == pattern(size, 3)  # another client of the same pool
    assert dummy.batch_get_into([key("p")], [addr + size], [size]) == [size]
    assert read(addr + size, size) == pattern(size, 3)
    assert dummy.put(key("w"), b"warmup") == 0 and dummy.is_exist(key("w")) == 1
    assert dummy.unregister_buffer(addr) == 0 and dummy.close() == 0
    alloc.free(addr)
    # No master there: -1 quickly, as setup.
    assert impl.store_cls().setup_dummy(0, 0, f"127.0.0.1:{free_port()}") == -1
    assert impl.store_cls().setup_dummy(0, 0, "no-port") == -1
    with pytest.raises(TypeError):
        impl.store_cls().setup_dummy("64", 0, impl.master)


def test_master_gone(impl, key, tmp_path):
    own, stop = _start(impl.name, tmp_path)  # a master this test can stop
    try:
        s = own.new_store(segment_bytes=0)  # a pure client: nothing to unmount at close
        assert s.health_check() == 0
    finally:
        own.closers.clear()
        stop()
    assert s.is_exist(key("k")) == RPC_FAIL
    assert s.batch_get_replica_desc([key("k")]) == {}  # no answer: nothing listed
    started = time.monotonic()
    assert s.put(key("k"), b"v") == RPC_FAIL
    if not impl.is_mooncake:  # Mooncake retries for about 4 s (a get as long again)
        assert time.monotonic() - started < 1
        assert s.get(key("k")) == b""
    deadline = time.monotonic() + 1.5
    while s.health_check() != 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    health = s.health_check()
    assert s.close() == 0
    if impl.is_mooncake and health == 0:
        pytest.xfail("Mooncake bug (found here): health_check reports 0 (healthy) for seconds "
                     "after its master has stopped, while calls fail with RPC_FAIL")
    assert health == 2


# -- plain values ----------------------------------------------------------------------------
def test_put_get_round_trip(store, key):
    assert store.put(key("bytes"), b"hello mooncake") == 0
    assert store.put(key("bytearray"), bytearray(b"\x00\x01\x02")) == 0
    assert store.put(key("memoryview"), memoryview(pattern(5000, 1))) == 0
    assert store.get(key("bytes")) == b"hello mooncake"
    assert store.get(key("bytearray")) == b"\x00\x01\x02"
    assert store.get(key("memoryview")) == pattern(5000, 1)
    assert store.get_size(key("memoryview")) == 5000
    assert store.put_parts(key("parts"), b"ab", b"cd", bytearray(b"ef")) == 0
    assert store.get(key("parts")) == b"abcdef"
    with pytest.raises(TypeError):
        store.put(key("text"), "not bytes")


def test_missing_keys(store, arena, key):
    missing = key("never-put")
    assert store.get(missing) == b""
    assert store.get_size(missing) == OBJECT_NOT_FOUND
    assert store.get_into(missing, arena.alloc(64), 64) == OBJECT_NOT_FOUND
    assert store.is_exist(missing) == 0
    assert store.batch_is_exist([missing]) == [0]
    assert store.remove(missing) == OBJECT_NOT_FOUND
    assert store.batch_get_into([missing], [arena.alloc(64)], [64]) == [OBJECT_NOT_FOUND]
    assert store.get_batch([missing]) == [b""]


def test_existing_key_succeeds_and_keeps_the_first_value(store, arena, key):
    k = key("k")
    assert store.put(k, b"first") == 0
    assert store.put(k, b"second, longer") == 0
    assert store.get(k) == b"first"
    assert store.put_from(k, arena.alloc(6, b"third!"), 6) == 0
    assert store.batch_put_from([k], [arena.alloc(6, b"fourth")], [6]) == [0]
    assert store.put_batch([k], [b"fifth"]) == 0
    assert store.get(k) == b"first" and store.get_size(k) == 5


def test_empty_values_and_keys_are_invalid(impl, store, arena, key):
    assert store.put(key("empty"), b"") == INVALID_PARAMS
    assert store.put("", b"value") == INVALID_PARAMS
    assert store.is_exist(key("empty")) == 0
    assert store.put(key("one"), b"1") == 0
    assert store.get_into(key("one"), arena.alloc(8), 0) == INVALID_PARAMS
    assert store.get_into(key("missing"), arena.alloc(8), 0) == OBJECT_NOT_FOUND
    rc = store.put_from(key("zero"), arena.alloc(8), 0)
    assert store.is_exist(key("zero")) == 0
    if impl.is_mooncake and rc == 0:
        pytest.xfail("Mooncake bug (found here): put_from of 0 bytes returns 0 and stores nothing")
    assert rc == INVALID_PARAMS


# -- sizes -----------------------------------------------------------------------------------
@pytest.mark.parametrize("size", [1, 4097, 1 << 20])
def test_sizes_and_buffer_bounds(store, arena, key, size):
    k = key("obj")
    data = pattern(size, size)
    assert store.put_from(k, arena.alloc(size, data), size) == 0
    assert store.get_size(k) == size
    exact = arena.alloc(size)
    assert store.get_into(k, exact, size) == size and read(exact, size) == data
    bigger = arena.alloc(size + 100)
    assert store.get_into(k, bigger, size + 100) == size and read(bigger, size) == data
    if size > 1:
        small = arena.alloc(size - 1, b"\x5a" * (size - 1))
        assert store.get_into(k, small, size - 1) == INVALID_PARAMS
        assert read(small, size - 1) == b"\x5a" * (size - 1)  # untouched


# -- batches ---------------------------------------------------------------------------------
def test_batch_round_trip(store, arena, key):
    keys = [key(str(i)) for i in range(32)]
    datas = [pattern(4096 + i, i) for i in range(32)]
    srcs = [arena.alloc(len(d), d) for d in datas]
    assert store.batch_put_from(keys, srcs, [len(d) for d in datas]) == [0] * 32
    dsts = [arena.alloc(len(d)) for d in datas]
    assert store.batch_get_into(keys, dsts, [len(d) for d in datas]) == [len(d) for d in datas]
    assert all(read(a, len(d)) == d for a, d in zip(dsts, datas))
    assert store.batch_is_exist(keys) == [1] * 32


def test_batch_partial_failures(store, arena, key):
    ok1, bad, ok2 = key("ok1"), key("zero-size"), key("ok2")
    src = arena.alloc(300, pattern(300, 3))
    # One bad entry fails alone.
    assert store.batch_put_from([ok1, bad, ok2], [src, src, src + 100], [100, 0, 200]) == \
        [0, INVALID_PARAMS, 0]
    assert store.batch_is_exist([ok1, bad, ok2]) == [1, 0, 1]
    # Reads: a missing key and a too-small buffer fail alone; the others are read.
    d1, d2, d3 = (arena.alloc(200) for _ in range(3))
    assert store.batch_get_into([ok1, key("missing"), ok2], [d1, d2, d3],
                                [100, 100, 199]) == [100, OBJECT_NOT_FOUND, INVALID_PARAMS]
    assert read(d1, 100) == pattern(300, 3)[:100]
    # Lists of different lengths fail every key.
    assert store.batch_put_from([key("x"), key("y")], [src], [10]) == [INVALID_PARAMS] * 2
    assert store.batch_get_into([ok1, ok2], [d1], [100]) == [INVALID_PARAMS] * 2
    assert store.batch_is_exist([key("x"), key("y")]) == [0, 0]


def test_batch_arguments_as_lists_or_tuples_give_the_same_results(store, arena, key):
    # kvbridge reads lists of plain ints natively and takes everything else through its
    # general path: both must answer alike, failures included.
    data = [pattern(1000 + i, i) for i in range(4)]
    srcs = [arena.alloc(len(d), d) for d in data]
    sizes = [len(d) for d in data]
    for kind in (list, tuple):
        keys = [key(f"{kind.__name__}{i}") for i in range(4)]
        assert store.batch_put_from(kind(keys), kind(srcs), kind(sizes)) == [0] * 4
        dsts = [arena.alloc(1100) for _ in range(5)]
        asked = keys[:3] + [key("missing"), keys[3]]
        got = store.batch_get_into(kind(asked), kind(dsts), kind([1100, 1100, 1001, 1100, 900]))
        assert got == [1000, 1001, INVALID_PARAMS, OBJECT_NOT_FOUND, INVALID_PARAMS], kind
        assert read(dsts[0], 1000) == data[0] and read(dsts[1], 1001) == data[1]


def test_multi_buffer_arguments_as_lists_or_tuples_give_the_same_results(store, arena, key):
    # As above, for the *_multi_buffers forms (K and V of a page as one object).
    k_data, v_data = pattern(700, 1), pattern(300, 2)
    k_src, v_src = arena.alloc(700, k_data), arena.alloc(300, v_data)
    for kind in (list, tuple):
        keys = [key(f"multi-{kind.__name__}{i}") for i in range(2)]
        ptrs = kind([kind([k_src, v_src]), kind([v_src, k_src])])
        sizes = kind([kind([700, 300]), kind([300, 700])])
        assert store.batch_put_from_multi_buffers(kind(keys), ptrs, sizes) == [0, 0]
        d = [arena.alloc(1000) for _ in range(4)]
        got = store.batch_get_into_multi_buffers(
            kind(keys + [key("missing")]), kind([kind([d[0], d[1]]), kind([d[2], d[3]]),
                                                 kind([d[0]])]),
            kind([kind([600, 400]), kind([300, 699]), kind([10])]))
        assert got == [1000, INVALID_PARAMS, OBJECT_NOT_FOUND], kind
        assert read(d[0], 600) + read(d[1], 400) == k_data + v_data


def test_a_key_twice_in_one_batch(impl, store, arena, key):
    k = key("k")
    first, second = arena.alloc(8, b"first..."), arena.alloc(8, b"second..")
    assert store.batch_put_from([k, k], [first, second], [8, 8]) == [0, 0]
    # kvbridge keeps the first (an existing key is never rewritten); Mooncake the last.
    assert store.get(k) == (b"second.." if impl.is_mooncake else b"first...")
    d1, d2 = arena.alloc(8, b"\0" * 8), arena.alloc(8, b"\0" * 8)
    got = store.batch_get_into([k, k], [d1, d2], [8, 8])
    assert got == [8, 8]
    if impl.is_mooncake and read(d1, 8) != read(d2, 8):
        pytest.xfail("Mooncake bug (found here): a key twice in one batch_get_into reports its "
                     "bytes read for both buffers but fills only the last")
    assert read(d1, 8) == read(d2, 8) == store.get(k)


def test_put_batch_and_get_batch(impl, store, key):
    keys = [key(str(i)) for i in range(10)]
    values = [pattern(100 * (i + 1), i) for i in range(10)]
    assert store.put_batch(keys, values) == 0
    assert store.get_batch(keys + [key("missing")]) == values + [b""]
    # Validation fails the whole call before anything is stored.
    assert store.put_batch([key("a"), key("b")], [b"1"]) == INVALID_PARAMS
    assert store.put_batch([key("c"), key("d")], [b"1", b""]) == INVALID_PARAMS
    assert store.batch_is_exist([key("a"), key("c"), key("d")]) == [0, 0, 0]
    # A value larger than the local buffer (16 MiB): Mooncake stages every value through that
    # buffer; kvbridge sends larger ones through its own staging copy.
    big = pattern(4096, 9) * (17 << 8)
    if impl.is_mooncake:
        assert store.put_batch([key("big")], [big]) == INVALID_PARAMS
    else:
        assert store.put_batch([key("big")], [big]) == 0
        assert store.get_batch([key("big")]) == [big]


def test_batches_from_several_threads(store, key):
    def work(t: int, errors: list) -> None:
        try:
            for round_ in range(5):
                keys = [key(f"{t}/{round_}/{i}") for i in range(8)]
                values = [pattern(3000 + 100 * i, t * 31 + round_) for i in range(8)]
                assert store.put_batch(keys, values) == 0
                assert store.get_batch(keys) == values
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    errors: list = []
    threads = [threading.Thread(target=work, args=(t, errors)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors[0]


def test_get_batch_of_no_keys(impl, store):
    # Mooncake answers one empty value for no keys; kvbridge an empty list.
    assert store.get_batch([]) == ([b""] if impl.is_mooncake else [])


def test_multi_buffer_forms(impl, store, arena, key):
    k_page, v_page = pattern(2048, 1), pattern(3072, 2)
    keys = [key("p0"), key("p1")]
    srcs = [[arena.alloc(2048, k_page), arena.alloc(3072, v_page)], [arena.alloc(512, b"x" * 512)]]
    assert store.batch_put_from_multi_buffers(keys, srcs, [[2048, 3072], [512]]) == [0, 0]
    assert store.get_size(keys[0]) == 5120
    assert store.get(keys[0]) == k_page + v_page
    dk, dv, d1 = arena.alloc(2048), arena.alloc(3072), arena.alloc(512)
    got = store.batch_get_into_multi_buffers(keys + [key("missing")],
                                             [[dk, dv], [d1], [arena.alloc(8)]],
                                             [[2048, 3072], [512], [8]])
    assert got == [5120, 512, OBJECT_NOT_FOUND]
    assert read(dk, 2048) == k_page and read(dv, 3072) == v_page and read(d1, 512) == b"x" * 512
    # Buffers holding fewer bytes than the object.
    assert store.batch_get_into_multi_buffers([keys[0]], [[dk, dv]], [[2048, 3071]]) == \
        [INVALID_PARAMS]
    # Buffers holding more bytes than the object: kvbridge fills them in order and returns the
    # object's size; Mooncake fails the key with TRANSFER_FAIL.
    e1, e2 = arena.alloc(2048), arena.alloc(4096)
    got = store.batch_get_into_multi_buffers([keys[0]], [[e1, e2]], [[2048, 4096]])
    if impl.is_mooncake:
        assert got == [TRANSFER_FAIL]
    else:
        assert got == [5120] and read(e1, 2048) == k_page and read(e2, 3072) == v_page
    # Mismatched list lengths fail every key.
    assert store.batch_put_from_multi_buffers(keys, [[dk]], [[8]]) == [INVALID_PARAMS] * 2


# -- buffers ---------------------------------------------------------------------------------
def test_register_and_unregister_buffer(store, key):
    mem = ctypes.create_string_buffer(1 << 16)
    base = ctypes.addressof(mem)
    assert store.register_buffer(base, 1 << 16) == 0
    assert store.register_buffer(base, 1 << 16) == INVALID_PARAMS  # twice
    assert store.register_buffer(base + 4096, 4096) == INVALID_PARAMS  # overlapping
    write(base, b"registered")
    assert store.batch_put_from([key("r")], [base], [10]) == [0]
    assert store.batch_get_into([key("r")], [base + 100], [10]) == [10]
    assert read(base + 100, 10) == b"registered"
    assert store.unregister_buffer(base) == 0
    assert store.unregister_buffer(base) == INVALID_PARAMS  # not registered any more
    assert store.register_buffer(base, 0) == INVALID_PARAMS


def test_unregistered_memory_works_through_a_copy(store, key):
    mem = ctypes.create_string_buffer(8192)
    base = ctypes.addressof(mem)
    write(base, pattern(1000, 5))
    assert store.put_from(key("a"), base, 1000) == 0
    assert store.batch_put_from([key("b")], [base], [1000]) == [0]
    assert store.get_into(key("a"), base + 2000, 1000) == 1000
    assert store.batch_get_into([key("b")], [base + 4000], [1000]) == [1000]
    assert read(base + 2000, 1000) == read(base + 4000, 1000) == pattern(1000, 5)


# -- reads into Python buffers and byte ranges ------------------------------------------------
def test_get_buffer_and_batch_get_buffer(store, key):
    data = pattern(10240, 3)
    assert store.put(key("a"), data) == 0 and store.put(key("b"), b"hello") == 0
    handles = store.batch_get_buffer([key("a"), key("missing"), key("b")])
    assert handles[1] is None and len(handles) == 3
    for h, want in ((handles[0], data), (handles[2], b"hello")):
        assert h.size() == len(want)
        assert ctypes.string_at(h.ptr(), h.size()) == want
        assert bytes(memoryview(h)) == want  # the buffer protocol
    assert store.batch_get_buffer([]) == []
    assert bytes(memoryview(store.get_buffer(key("b")))) == b"hello"
    assert store.get_buffer(key("missing")) is None


def test_get_into_ranges(impl, store, arena, key):
    data = pattern(10240, 4)
    assert store.put(key("a"), data) == 0 and store.put(key("b"), b"hello") == 0
    buf = arena.alloc(4096)
    got = store.get_into_ranges([buf], [[key("a"), key("b")]], [[[0, 100], [200]]],
                                [[[10, 20], [1]]], [[[5, 7], [3]]])
    assert got == [[[5, 7], [3]]]
    assert read(buf, 5) == data[10:15] and read(buf + 100, 7) == data[20:27]
    assert read(buf + 200, 3) == b"ell"
    # A range past the object's end, lists of different lengths, buffers and key lists of
    # different lengths: INVALID_PARAMS; a zero-length range copies nothing.
    assert store.get_into_ranges([buf], [[key("a")]], [[[0]]], [[[10230]]], [[[100]]]) == \
        [[[INVALID_PARAMS]]]
    assert store.get_into_ranges([buf], [[key("a")]], [[[0]]], [[[0]]], [[[0]]]) == [[[0]]]
    assert store.get_into_ranges([buf], [[key("a")]], [[[0, 1]]], [[[0]]], [[[1]]]) == \
        [[[INVALID_PARAMS] * 2]]
    assert store.get_into_ranges([buf], [[key("a")], [key("b")]], [[[0]], [[0]]],
                                 [[[0]], [[0]]], [[[1]], [[1]]]) == [[[INVALID_PARAMS]]]
    assert store.get_into_ranges([], [], [], [], []) == []
    # A missing key fails its own ranges only.
    other = arena.alloc(64)
    got = store.get_into_ranges([other], [[key("a"), key("missing")]], [[[0], [32]]],
                                [[[0], [0]]], [[[16], [4]]])
    assert got == [[[16], [OBJECT_NOT_FOUND]]] and read(other, 16) == data[:16]
    # Memory never registered: Mooncake refuses it with INVALID_PARAMS for every range of the
    # buffer; kvbridge copies into it, as its other reads into unregistered memory do.
    mem = ctypes.create_string_buffer(64)
    got = store.get_into_ranges([ctypes.addressof(mem)], [[key("a"), key("b")]], [[[0], [32]]],
                                [[[0], [0]]], [[[16], [5]]])
    if impl.is_mooncake:
        assert got == [[[INVALID_PARAMS], [INVALID_PARAMS]]] and mem.raw[:16] == bytes(16)
    else:
        assert got == [[[16], [5]]] and mem.raw[:16] == data[:16] and mem.raw[32:37] == b"hello"


def test_get_hostname_names_this_stores_segment(impl, key, tmp_path):
    """get_hostname() names this store's segment, as batch_replica_clear takes it: Mooncake's
    host:port, kvbridge's node id (which kvbridge's replica descriptors give as their
    transport_endpoint; Mooncake's give its transfer engine's address there)."""
    impl, stop = _start(impl.name, tmp_path)  # a cluster of its own: two segments
    try:
        holder, other = impl.new_store(), impl.new_store(segment_bytes=16 << 20)
        name = holder.get_hostname()
        assert isinstance(name, str) and name and other.get_hostname() not in ("", name)
        if impl.is_mooncake:
            assert name.startswith("127.0.0.1:")
        keys = [key(str(i)) for i in range(8)]
        assert holder.put_batch(keys, [b"v"] * 8) == 0
        endpoints = {}
        if not impl.is_mooncake:  # Mooncake's query leases the object: no clearing for 2 s
            endpoints = {k: holder.get_replica_desc(k)[0].get_memory_descriptor()
                         .buffer_descriptor.transport_endpoint for k in keys}
        # Clearing a segment clears the keys whose replica lies there, and only those.
        # (Asking Mooncake whether a key exists leases it too: nothing is asked in between.)
        here = holder.batch_replica_clear(keys, name)
        there = holder.batch_replica_clear(keys, other.get_hostname())
        assert sorted(here + there) == sorted(keys)
        assert holder.batch_is_exist(keys) == [0] * 8
        # A key with a replica on each segment: Mooncake drops the one on the named segment and
        # keeps the object; kvbridge's master drops replicas only as a whole, so it leaves the
        # key alone and does not list it.
        both = key("both")
        assert holder.put(both, b"w", impl.replicate(2)) == 0
        assert holder.batch_replica_clear([both], name) == ([both] if impl.is_mooncake else [])
        assert holder.get(both) == b"w"
        if not impl.is_mooncake:
            assert here == [k for k in keys if endpoints[k] == name]
            assert impl.store_cls().get_hostname() == ""  # not set up
    finally:
        stop()


def test_batch_replica_clear(impl, store, key):
    keys = [key("a"), key("b"), key("c")]
    assert store.put_batch(keys, [b"1", b"2", b"3"]) == 0
    assert store.get(keys[2]) == b"3"  # a read: Mooncake leases the object for 2 s here
    cleared = store.batch_replica_clear([keys[0], key("missing"), keys[1], keys[2]])
    if impl.is_mooncake:
        # Mooncake clears only objects whose read lease has expired.
        assert cleared == keys[:2]
        time.sleep(MOONCAKE_LEASE_MS / 1000 + 0.5)
        assert store.batch_replica_clear([keys[2]]) == [keys[2]]
    else:
        assert cleared == keys  # kvbridge clears at once, as its remove does
    assert store.batch_is_exist(keys) == [0, 0, 0]
    assert store.batch_replica_clear([]) == []
    assert store.put(key("d"), b"4") == 0
    assert store.batch_replica_clear([key("d")], "no-such-segment") == []
    assert store.is_exist(key("d")) == 1


# -- existence and removal -------------------------------------------------------------------
def test_is_exist_and_batch_is_exist(store, key):
    assert store.put(key("a"), b"1") == 0 and store.put(key("c"), b"3") == 0
    assert store.is_exist(key("a")) == 1
    assert store.is_exist(key("b")) == 0
    assert store.batch_is_exist([key("a"), key("b"), key("c")]) == [1, 0, 1]
    assert store.batch_is_exist((key("a"), key("b"))) == [1, 0]
    assert store.batch_is_exist([]) == []
    with pytest.raises(TypeError):
        store.batch_is_exist([key("a"), 5])


def test_remove(store, key):
    assert store.put(key("a"), b"1") == 0 and store.put(key("b"), b"2") == 0
    assert store.remove(key("a")) == 0  # never read: no read lease on it
    assert store.get(key("a")) == b""
    assert store.remove(key("a")) == OBJECT_NOT_FOUND
    assert store.batch_remove([key("b"), key("a")]) == [0, OBJECT_NOT_FOUND]
    assert store.put(key("a"), b"new") == 0  # a removed key can be written again
    assert store.get(key("a")) == b"new"


def test_remove_right_after_a_read(impl, store, key):
    assert store.put(key("a"), b"1") == 0
    assert store.get(key("a")) == b"1"
    if impl.is_mooncake:
        # A read grants a lease (here 2 s) during which Mooncake refuses removal.
        assert store.remove(key("a")) == OBJECT_HAS_LEASE
        assert store.remove(key("a"), True) == 0  # force
    else:
        # kvbridge removes at once; the space stays reserved until leased reads end.
        assert store.remove(key("a")) == 0
    assert store.is_exist(key("a")) == 0


# -- overwrites (upsert) -----------------------------------------------------------------------
def test_upsert_replaces_the_value_in_every_form(impl, store, arena, key):
    k = key("k")
    assert store.upsert(k, b"one") == 0  # an absent key is put
    assert store.get(k) == b"one"
    assert store.upsert(k, b"two, longer") == 0
    assert store.get(k) == b"two, longer" and store.get_size(k) == 11
    assert store.upsert_parts(k, b"p1", bytearray(b"p2")) == 0
    assert store.get(k) == b"p1p2"
    assert store.upsert_from(k, arena.alloc(8, b"from-buf"), 8) == 0
    assert store.get(k) == b"from-buf"
    a, b = key("a"), key("b")
    assert store.put(a, b"old a") == 0
    assert store.batch_upsert_from([a, b], [arena.alloc(5, b"new a"), arena.alloc(5, b"new b")],
                                   [5, 5]) == [0, 0]
    assert store.get_batch([a, b]) == [b"new a", b"new b"]
    assert store.upsert_batch([a, b, k], [b"A", b"BB", b"KKK"]) == 0
    assert store.get_batch([a, b, k]) == [b"A", b"BB", b"KKK"]
    assert store.upsert(a, b"A2", impl.replicate(1)) == 0
    assert store.get(a) == b"A2"
    # A plain put still leaves an existing key alone.
    assert store.put(a, b"put") == 0
    assert store.get(a) == b"A2"
    # Memory never registered goes through a copy, as with put_from.
    plain = ctypes.create_string_buffer(b"unregistered", 12)
    assert store.upsert_from(k, ctypes.addressof(plain), 12) == 0
    assert store.batch_upsert_from([b], [ctypes.addressof(plain)], [12]) == [0]
    assert store.get_batch([k, b]) == [b"unregistered"] * 2


def test_upsert_of_a_key_just_read(store, key):
    # A read lease does not stop an upsert (unlike remove in Mooncake): the reader keeps the
    # bytes it got, the next read gets the new ones.
    k = key("k")
    assert store.put(k, b"first") == 0
    assert store.get(k) == b"first"
    assert store.upsert(k, b"second") == 0
    assert store.get(k) == b"second"


def test_upsert_bad_inputs(impl, store, arena, key):
    k = key("k")
    assert store.put(k, b"kept") == 0
    assert store.upsert(k, b"") == INVALID_PARAMS
    assert store.upsert("", b"x") == INVALID_PARAMS
    assert store.upsert_batch([key("a"), key("b")], [b"1"]) == INVALID_PARAMS
    assert store.upsert_batch([key("a"), key("b")], [b"1", b""]) == INVALID_PARAMS
    assert store.batch_upsert_from([key("a"), key("b")], [arena.alloc(8)], [8, 8]) == \
        [INVALID_PARAMS] * 2
    assert store.batch_is_exist([key("a"), key("b")]) == [0, 0]
    assert store.get(k) == b"kept"
    with pytest.raises(TypeError):
        store.upsert(k, "not bytes")
    rc = store.upsert_from(key("zero"), arena.alloc(8), 0)
    assert store.is_exist(key("zero")) == 0
    if impl.is_mooncake and rc == 0:
        pytest.xfail("Mooncake bug (found here): upsert_from of 0 bytes returns 0 and stores "
                     "nothing, as put_from does")
    assert rc == INVALID_PARAMS


def test_upsert_a_key_twice_in_one_batch(impl, store, arena, key):
    k = key("k")
    first, second = arena.alloc(8, b"first..."), arena.alloc(8, b"second..")
    assert store.batch_upsert_from([k, k], [first, second], [8, 8]) == [0, 0]
    assert store.get(k) == b"second.."  # both: the last
    j = key("j")
    assert store.upsert_batch([j, j], [b"j1", b"j2"]) == 0
    # kvbridge keeps the last, as batch_upsert_from does in both; Mooncake's upsert_batch
    # keeps the first.
    assert store.get(j) == (b"j1" if impl.is_mooncake else b"j2")


def test_readers_see_the_old_value_or_the_new_never_a_mix(impl, store, key):
    k = key("k")
    values = [bytes([i]) * 65536 for i in range(1, 9)]
    assert store.put(k, values[0]) == 0
    stop = threading.Event()
    seen: list = []
    errors: list = []

    def reader() -> None:
        while not stop.is_set():
            got = store.get(k)
            if got not in values:
                errors.append(got[:16])
                return
            seen.append(got[0])

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        for v in values[1:]:
            assert store.upsert(k, v) == 0
            time.sleep(0.02)
    finally:
        stop.set()
        for t in threads:
            t.join()
    if impl.is_mooncake and errors and set(errors) == {b""}:
        pytest.xfail("Mooncake bug (found here): a get while the key is upserted returns b\"\" "
                     "(the key reads as absent until its new version is written)")
    assert not errors, f"a read returned bytes of no version: {errors}"
    assert store.get(k) == values[-1]
    assert len(set(seen)) > 1


def test_remove_all(store, key):
    keys = [key(str(i)) for i in range(5)]
    assert store.put_batch(keys, [b"v"] * 5) == 0
    removed = store.remove_all()
    assert removed >= 5  # objects of other tests may go too (those under a lease stay)
    assert store.batch_is_exist(keys) == [0] * 5
    assert store.remove_all() >= 0


# -- replication -----------------------------------------------------------------------------
def test_replicate_config(impl, store, key):
    assert store.put(key("one"), b"1", impl.replicate(1)) == 0
    assert store.get(key("one")) == b"1"
    assert store.put(key("zero"), b"0", impl.replicate(0)) == INVALID_PARAMS  # no replica
    assert store.is_exist(key("zero")) == 0
    if not impl.is_mooncake:
        from kvbridge.compat.mooncake import ReplicateConfig

        assert ReplicateConfig(replica_num=3).replica_num == 3  # kvbridge also takes keywords
    # Two replicas need two segments: a second store contributes one.
    other = impl.new_store(segment_bytes=16 << 20)
    assert store.put(key("two"), b"22", impl.replicate(2)) == 0
    assert other.get(key("two")) == b"22"
    assert store.put_batch([key("b1"), key("b2")], [b"x", b"yy"], impl.replicate(2)) == 0
    assert other.get_batch([key("b1"), key("b2")]) == [b"x", b"yy"]
    # More replicas than segments: Mooncake stores fewer and reports success; kvbridge
    # refuses (replicas go to distinct nodes) with NO_AVAILABLE_HANDLE.
    many = store.put(key("many"), b"3", impl.replicate(8))
    assert many == (0 if impl.is_mooncake else NO_AVAILABLE_HANDLE)


def test_pins_in_replicate_config(impl, store, key):
    """Puts with a hard pin, an enabled soft pin (with and without a TTL) and an upsert that
    preserves one succeed and read back; a TTL without SoftPinAction.ENABLE is refused, as in
    Mooncake. (That pinned objects outlive a fill: tests/python/test_store.py.)"""
    store_module = sys.modules[impl.store_cls.__module__]

    def config(**fields):
        c = impl.config_cls()
        for name, value in fields.items():
            setattr(c, name, value)
        return c

    enable = store_module.SoftPinAction.ENABLE
    assert store.put(key("hard"), b"h", config(with_hard_pin=True)) == 0
    assert store.put(key("soft"), b"s", config(soft_pin_action=enable)) == 0
    assert store.put(key("ttl"), b"t", config(soft_pin_action=enable, soft_pin_ttl_ms=60000)) == 0
    assert store.upsert(key("soft"), b"S", config()) == 0  # PRESERVE
    assert store.get_batch([key("hard"), key("soft"), key("ttl")]) == [b"h", b"S", b"t"]
    bad = config(soft_pin_action=store_module.SoftPinAction.DISABLE, soft_pin_ttl_ms=1000)
    assert store.put(key("bad"), b"b", bad) == INVALID_PARAMS
    assert store.is_exist(key("bad")) == 0


def test_copy_and_move_tasks(impl, store, key):
    """create_copy_task / create_move_task / query_task: a copy to another store's segment and
    a move back; bad requests are refused with Mooncake's codes."""
    store_module = sys.modules[impl.store_cls.__module__]
    assert store.put(key("c"), b"copy me" * 100) == 0
    other = impl.new_store(segment_bytes=16 << 20)  # after the put: it holds no replica
    target = other.get_hostname()
    # Where the replica is, as a segment name: kvbridge's transport_endpoint is the node id
    # (get_hostname); Mooncake's is its transfer engine's address, so the store's own name.
    (endpoint,) = [r.get_memory_descriptor().buffer_descriptor.transport_endpoint
                   for r in store.get_replica_desc(key("c"))]
    holder = store.get_hostname() if impl.is_mooncake else endpoint
    task, code = store.create_copy_task(key("c"), [target])
    assert code == 0 and isinstance(task, tuple) and len(task) == 2, (task, code)

    def wait(task_id):
        deadline = time.monotonic() + 20
        while True:
            resp, rc = store.query_task(task_id)
            assert rc == 0, rc
            if resp.status in (store_module.TaskStatus.SUCCESS, store_module.TaskStatus.FAILED):
                return resp
            if time.monotonic() > deadline:
                return resp
            time.sleep(0.1)

    resp = wait(task)
    if impl.is_mooncake and resp.status != store_module.TaskStatus.SUCCESS:
        pytest.skip(f"the wheel's copy task did not finish here ({resp.status.name}: its tasks "
                    "need a task-executing client this test does not run)")
    assert resp.status == store_module.TaskStatus.SUCCESS, resp.message
    assert resp.type == store_module.TaskType.REPLICA_COPY and resp.id == task
    assert len(store.get_replica_desc(key("c"))) == 2
    task, code = store.create_move_task(key("c"), target, holder)
    assert code == 0
    resp = wait(task)
    if not impl.is_mooncake:
        # The target holds a replica already: kvbridge only drops the source's.
        assert resp.status == store_module.TaskStatus.SUCCESS, resp.message
        assert resp.type == store_module.TaskType.REPLICA_MOVE
        assert [r.get_memory_descriptor().buffer_descriptor.transport_endpoint
                for r in store.get_replica_desc(key("c"))] == [holder]
    assert store.get(key("c")) == b"copy me" * 100
    # Refusals
    assert store.create_copy_task(key("absent"), [target])[1] == OBJECT_NOT_FOUND
    assert store.create_copy_task(key("c"), [])[1] != 0


def test_replicate_config_defaults_and_checks(impl):
    config = impl.config_cls()
    store_module = sys.modules[impl.store_cls.__module__]
    assert config.replica_num == 1 and config.nof_replica_num == 0
    assert config.dfs_replica_num == 0
    assert config.soft_pin_action == store_module.SoftPinAction.PRESERVE
    assert config.soft_pin_ttl_ms is None  # the master's default
    assert config.with_hard_pin is False and config.prefer_alloc_in_same_node is False
    assert config.preferred_segment == "" and config.preferred_segments == []
    assert config.preferred_nof_segments == [] and config.group_ids is None
    assert config.data_type == store_module.ObjectDataType.UNKNOWN
    assert not hasattr(config, "with_soft_pin") and not hasattr(config, "session_ids")
    assert str(config) == (
        "ReplicateConfig: { replica_num: 1, nof_replica_num: 0, dfs_replica_num: 0, "
        "soft_pin_action: PRESERVE, soft_pin_ttl_ms: default, with_hard_pin: 0, "
        "preferred_segments: [], preferred_nof_segments: [], prefer_alloc_in_same_node: 0, "
        "data_type: UNKNOWN }")
    config.soft_pin_action = store_module.SoftPinAction.ENABLE
    config.soft_pin_ttl_ms = (1 << 64) - 1
    config.soft_pin_ttl_ms = None
    config.soft_pin_ttl_ms = 5000
    config.with_hard_pin = 1
    config.group_ids = ["g"]
    config.preferred_segment = "seg"
    config.data_type = store_module.ObjectDataType.KVCACHE
    assert str(config) == (
        "ReplicateConfig: { replica_num: 1, nof_replica_num: 0, dfs_replica_num: 0, "
        "soft_pin_action: ENABLE, soft_pin_ttl_ms: 5000, with_hard_pin: 1, "
        "preferred_segments: [], preferred_segment (deprecated): seg, "
        "preferred_nof_segments: [], prefer_alloc_in_same_node: 0, data_type: KVCACHE, "
        "group_ids: [g] }")
    refused = [("soft_pin_ttl_ms", -1), ("soft_pin_ttl_ms", 1 << 64), ("soft_pin_ttl_ms", 1.5),
               ("soft_pin_ttl_ms", "5"), ("replica_num", -1), ("replica_num", None),
               ("replica_num", 2.0), ("soft_pin_action", 1), ("soft_pin_action", None),
               ("data_type", 1), ("group_ids", [1]), ("group_ids", "g"),
               ("preferred_segment", None), ("preferred_segments", "ab"),
               ("with_hard_pin", "yes"), ("nof_replica_num", -1)]
    for field_name, value in refused:
        with pytest.raises(TypeError):
            setattr(config, field_name, value)
    assert config.soft_pin_ttl_ms == 5000 and config.group_ids == ["g"]  # unchanged
    with pytest.raises(AttributeError):
        config.with_soft_pin = True  # not a field of Mooncake's


def test_replica_descriptors(impl, store, key):
    """get_replica_desc / batch_get_replica_desc, as vLLM's store connector reads them for tier
    logging: a list per key of memory replicas, absent keys left out."""
    other = impl.new_store(segment_bytes=16 << 20)  # a second segment for replica 2
    assert store.put(key("two"), b"x" * 5000, impl.replicate(2)) == 0
    assert store.put(key("one"), b"y" * 300, impl.replicate(1)) == 0
    descs = store.get_replica_desc(key("two"))
    assert isinstance(descs, list) and len(descs) == 2
    endpoints = set()
    for d in descs:
        assert d.is_memory_replica() and not d.is_disk_replica()
        assert not d.is_local_disk_replica()
        assert str(d.status) == "ReplicaStatus.COMPLETE" and int(d.status) == 3
        bd = d.get_memory_descriptor().buffer_descriptor
        assert bd.size == 5000 and isinstance(bd.buffer_address, int)
        endpoints.add(bd.transport_endpoint)
        with pytest.raises(RuntimeError, match="Expected DiskDescriptor"):
            d.get_disk_descriptor()
    assert len(endpoints) == 2, "two replicas on one holder"
    assert store.get_replica_desc(key("absent")) == []
    got = other.batch_get_replica_desc([key("one"), key("absent"), key("two"), key("one")])
    assert isinstance(got, dict) and sorted(got) == sorted([key("one"), key("two")])
    assert [len(got[key("one")]), len(got[key("two")])] == [1, 2]
    assert got[key("one")][0].get_memory_descriptor().buffer_descriptor.size == 300
    assert store.batch_get_replica_desc([]) == {}
    if impl.is_mooncake:
        # Mooncake's query grants a read lease, so the object cannot be removed for a while
        # (with frequent polling, leased objects also escape eviction).
        assert store.remove(key("one")) == OBJECT_HAS_LEASE
    else:
        # kvbridge's query reads nothing and takes no lease.
        assert store.remove(key("one")) == 0
        assert store.get_replica_desc(key("one")) == []


_HOLDER = """
import importlib, sys
module, master = sys.argv[1], sys.argv[2]
store = importlib.import_module(module).MooncakeDistributedStore()
rc = store.setup("127.0.0.1", "P2PHANDSHAKE", 16 << 20, 0, "tcp", "", master)
print("ready", rc, flush=True)
sys.stdin.read()
"""


@contextlib.contextmanager
def _two_holders_of_16_keys(impl: Impl, key: Callable, tmp_path: Path):
    """A master of its own, two holder processes (the only segments) and a pure client that
    put 16 keys of 4 KiB at replica_num 2: yields (impl, holders, client, arena, keys, srcs).
    Stops everything after, resuming a stopped holder first."""
    impl, stop = _start(impl.name, tmp_path)
    module = "mooncake.store" if impl.is_mooncake else "kvbridge.compat.mooncake"
    holders = [subprocess.Popen([sys.executable, "-c", _HOLDER, module, impl.master],
                                env=python_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL) for _ in range(2)]
    try:
        for h in holders:
            assert read_line(h).split() == [b"ready", b"0"]
        client = impl.new_store(segment_bytes=0)  # a pure client: no replica is local
        mem = Arena(client, 1 << 20)
        keys = [key(str(i)) for i in range(16)]
        srcs = [mem.alloc(4096, pattern(4096, i)) for i in range(16)]
        assert client.batch_put_from(keys, srcs, [4096] * 16, impl.replicate(2)) == [0] * 16
        yield impl, holders, client, mem, keys, srcs
    finally:
        for h in holders:
            if h.poll() is None:
                h.send_signal(signal.SIGCONT)
                h.kill()
            h.wait()
        stop()


def test_get_survives_a_killed_replica_holder(impl, key, tmp_path):
    """Seed 004 (vLLM scale-in with replica_num=3): with a second replica alive, reads of keys
    whose first replica sat on a killed process keep failing with TRANSFER_FAIL until the
    master expires that client (Mooncake has no replica fallback on Get). kvbridge tries the
    next replica."""
    with _two_holders_of_16_keys(impl, key, tmp_path) as (impl, holders, client, mem, keys, _):
        holders[0].send_signal(signal.SIGKILL)
        holders[0].wait()
        dsts = [mem.alloc(4096) for _ in range(16)]
        started = time.monotonic()
        got = client.batch_get_into(keys, dsts, [4096] * 16)
        elapsed = time.monotonic() - started
        if impl.is_mooncake and got != [4096] * 16:
            failed = sum(1 for r in got if r < 0)
            pytest.xfail(f"Mooncake bug (seed 004, no replica fallback on Get): {failed} of 16 "
                         f"keys failed ({sorted(set(r for r in got if r < 0))}) with a live "
                         "second replica")
        assert got == [4096] * 16
        assert all(read(d, 4096) == pattern(4096, i) for i, d in enumerate(dsts))
        assert elapsed < 5, f"reads around the dead holder took {elapsed:.1f} s"


def test_reads_and_writes_around_a_frozen_replica_holder(impl, key, tmp_path):
    """Seed 000 (SGLang HiCache degrading cluster-wide when one replica fails): a holder that
    stops answering without closing its connections (SIGSTOP: a hung process, a stalled
    host) holds every batch that touches it until Mooncake's 60 s transfer timeout. kvbridge's
    get finds the read from it late (hedged reads: 20 ms plus its bytes at 1 GB/s) and reads
    the second replica meanwhile, well before its progress timeout (2 s); a put whose other
    replica lands keeps it and succeeds."""
    with _two_holders_of_16_keys(impl, key, tmp_path) as (impl, holders, client, mem, keys,
                                                           srcs):
        dsts = [mem.alloc(4096) for _ in range(16)]
        new_keys = [key(f"new{i}") for i in range(16)]
        out: dict = {}

        def work() -> None:
            t = time.monotonic()
            out["get"] = client.batch_get_into(keys, dsts, [4096] * 16)
            out["get_s"] = time.monotonic() - t
            t = time.monotonic()
            out["put"] = client.batch_put_from(new_keys, srcs, [4096] * 16, impl.replicate(2))
            out["put_s"] = time.monotonic() - t

        freeze(holders[0].pid)
        worker = threading.Thread(target=work, daemon=True)
        worker.start()
        worker.join(10)
        hung = worker.is_alive()
        holders[0].send_signal(signal.SIGCONT)
        worker.join(120)  # once the holder runs again, anything still waiting finishes
        if impl.is_mooncake and (hung or out.get("get") != [4096] * 16):
            pytest.xfail(f"Mooncake bug (seed 000): with one holder frozen, the batch get "
                         f"{'was still blocked after 10 s' if hung else 'returned ' + str(out)}"
                         " (its transfers wait up to 60 s)")
        assert not hung, f"calls around a frozen holder still blocked after 10 s: {out}"
        print(f"frozen holder: get {out['get_s']:.3f} s, put {out['put_s']:.3f} s")
        assert out["get"] == [4096] * 16
        assert all(read(d, 4096) == pattern(4096, i) for i, d in enumerate(dsts))
        assert out["get_s"] < 1.0, f"the get took {out['get_s']:.2f} s (not hedged?)"
        assert out["put"] == [0] * 16, out["put"]
        assert out["put_s"] < 8, f"the put took {out['put_s']:.1f} s"
        assert client.batch_is_exist(new_keys) == [1] * 16


def test_error_numbers_follow_the_failed_side():
    """kvbridge's mapping to Mooncake's numbers: a peer failure is RPC_FAIL when the status's
    origin is the master (or the call only talks to the master), else TRANSFER_FAIL; the
    message text plays no part. (The end-to-end cases: test_master_gone and the killed-node
    tests above.)"""
    from kvbridge.compat._mooncake_store import mooncake_code

    assert mooncake_code("OK") == 0
    assert mooncake_code("PEER_UNREACHABLE", "storage_node") == TRANSFER_FAIL
    assert mooncake_code("PROGRESS_TIMEOUT", "") == TRANSFER_FAIL
    assert mooncake_code("PEER_UNREACHABLE", "master") == RPC_FAIL
    assert mooncake_code("DEADLINE_EXCEEDED", "", master_call=True) == RPC_FAIL
    assert mooncake_code("IO_ERROR", "storage_node") == TRANSFER_FAIL
    assert mooncake_code("NOT_FOUND", "master") == OBJECT_NOT_FOUND
    assert mooncake_code("NO_SPACE", "master") == NO_AVAILABLE_HANDLE


# -- the module's names ----------------------------------------------------------------------
# Every public name of mooncake.store in the wheel (0.3.13.post1); in .venv-mooncake the test
# below checks this list against the wheel itself.
MOONCAKE_STORE_NAMES = sorted("""
ACTIVATION BufferHandle BufferLease BufferLeaseView BufferPool COMPLETE Descriptor
DiskDescriptor EngramStore EngramStoreConfig FAILED GENERAL GRADIENT INITIALIZED KVCACHE
METADATA MemoryDescriptor MooncakeDistributedNoFRegister MooncakeDistributedStore
MooncakeHostMemAllocator OPTIMIZER_STATE ObjectDataType PENDING PROCESSING ParallelAxis
QueryTaskResponse REMOVED REPLICA_COPY REPLICA_MOVE ReadTarget RegisteredBufferLease
RegisteredBufferLeaseView RegisteredBufferPool ReplicaDescriptor ReplicaStatus ReplicateConfig
SAMPLE SUCCESS SoftPinAction TENSOR TaskStatus TaskType TensorParallelism UNDEFINED UNKNOWN
WEIGHT bind_to_numa_node get_alloc_func_addr get_free_func_addr""".split())
ENUMS = ["ReplicaStatus", "SoftPinAction", "TaskStatus", "TaskType", "ObjectDataType"]


def _public(module: Any) -> list:
    return sorted(n for n in dir(module) if not n.startswith("_"))


def _dropin_store_module() -> Any:
    """dropin/mooncake/mooncake/store.py, loaded under another name (it imports only
    kvbridge), so that it can sit next to the real wheel."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "kvbridge_dropin_mooncake_store",
        Path(__file__).resolve().parents[3] / "dropin" / "mooncake" / "mooncake" / "store.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_public_name_of_mooncake_store_is_exported():
    import kvbridge.compat.mooncake as compat

    dropin = _dropin_store_module()
    for module in (compat, dropin):
        missing = [n for n in MOONCAKE_STORE_NAMES if not hasattr(module, n)]
        assert not missing, f"{module.__name__} lacks {missing}"
        assert set(MOONCAKE_STORE_NAMES) <= set(module.__all__)
    for name in ENUMS:  # printed as pybind11 prints them
        assert all(str(m) == f"{name}.{m.name}" for m in getattr(compat, name))
    # Module-level enum values are the enums' members (TaskStatus's where two share a name).
    assert compat.FAILED is compat.TaskStatus.FAILED
    assert compat.COMPLETE is compat.ReplicaStatus.COMPLETE
    try:
        import mooncake.store as real
    except ImportError:
        return
    assert _public(real) == MOONCAKE_STORE_NAMES, "the wheel's names changed: update the list"
    for name in ENUMS:
        assert {n: int(m) for n, m in getattr(real, name).__members__.items()} == \
            {m.name: int(m) for m in getattr(compat, name)}
    for name in MOONCAKE_STORE_NAMES:
        value = getattr(real, name)
        if type(value).__name__ in ENUMS:  # a module-level enum value
            mine = getattr(compat, name)
            assert (type(mine).__name__, mine.name, int(mine)) == \
                (type(value).__name__, value.name, int(value)), name
    # Data holders: the same fields with the same defaults.
    for name in ("QueryTaskResponse", "ParallelAxis", "TensorParallelism", "ReadTarget",
                 "EngramStoreConfig"):
        theirs, mine = getattr(real, name)(), getattr(compat, name)()
        fields = _public(theirs)
        assert fields == _public(mine), name
        for f in fields:
            a, b = getattr(theirs, f), getattr(mine, f)
            assert (str(a), int(a)) == (str(b), int(b)) if isinstance(b, enum.Enum) else a == b, \
                f"{name}.{f}: {a!r} != {b!r}"


def test_names_kvbridge_cannot_honour_fail_with_a_named_error():
    import kvbridge.compat.mooncake as compat
    from kvbridge.errors import UnsupportedError

    calls = [lambda: compat.BufferPool(None), lambda: compat.RegisteredBufferPool(None),
             lambda: compat.BufferLease(), lambda: compat.BufferLeaseView(),
             lambda: compat.EngramStore(0, compat.EngramStoreConfig()),
             lambda: compat.MooncakeDistributedNoFRegister(),
             lambda: compat.bind_to_numa_node(0), compat.get_alloc_func_addr,
             compat.get_free_func_addr]
    for call in calls:
        with pytest.raises(compat.MooncakeNotSupportedError, match="docs/mooncake.md") as e:
            call()
        assert isinstance(e.value, UnsupportedError) and isinstance(e.value, NotImplementedError)


# -- the methods table in docs/mooncake.md ---------------------------------------------------
# Every public method of the wheel's MooncakeDistributedStore (0.3.13.post1); in .venv-mooncake
# the test checks this list against the wheel itself.
MOONCAKE_STORE_METHODS = sorted("""
alloc_from_mem_pool allocate_and_mount_segment batch_get_buffer batch_get_into
batch_get_into_multi_buffer_ranges batch_get_into_multi_buffers batch_get_replica_desc
batch_get_session_end batch_get_session_start batch_get_tensor batch_get_tensor_into
batch_get_tensor_into_cuda batch_get_tensor_with_parallelism
batch_get_tensor_with_parallelism_into batch_get_tensor_with_tp batch_get_tensor_with_tp_into
batch_is_exist batch_pub_tensor batch_pub_tensor_with_tp batch_put_from
batch_put_from_multi_buffer_ranges batch_put_from_multi_buffers batch_put_session_end
batch_put_session_revoke batch_put_session_start batch_put_tensor batch_put_tensor_from
batch_put_tensor_with_parallelism batch_put_tensor_with_parallelism_from
batch_put_tensor_with_tp batch_put_tensor_with_tp_from batch_remove batch_replica_clear
batch_upsert_from batch_upsert_pub_tensor batch_upsert_tensor batch_upsert_tensor_from
batch_upsert_tensor_with_parallelism batch_upsert_tensor_with_parallelism_from close
create_copy_task create_move_task get get_batch get_buffer get_hostname get_into
get_into_ranges get_offload_rpc_read_count get_replica_desc get_size get_tensor
get_tensor_into get_tensor_into_cuda get_tensor_with_parallelism
get_tensor_with_parallelism_into get_tensor_with_tp get_tensor_with_tp_into health_check
init_all is_exist load_tensor_from_safetensor mount_segment pub_tensor pub_tensor_with_tp put
put_batch put_from put_from_with_metadata put_parts put_tensor put_tensor_from
put_tensor_with_parallelism put_tensor_with_parallelism_from put_tensor_with_tp
put_tensor_with_tp_from query_task register_buffer remove remove_all remove_by_regex
save_tensor_to_safetensor setup setup_dummy unmount_and_free_segment
unmount_local_disk_segment unmount_segment unregister_buffer upsert upsert_batch upsert_from
upsert_parts upsert_pub_tensor upsert_tensor upsert_tensor_from upsert_tensor_with_parallelism
upsert_tensor_with_parallelism_from""".split())


def _docs_table(section: str) -> dict:
    """{method: status} from the table under ``section`` in docs/mooncake.md: every
    backquoted name in a row's first cell (``name(...)`` or ``name``) gets the row's status."""
    import re

    text = (Path(__file__).resolve().parents[3] / "docs" / "mooncake.md").read_text()
    body = text[text.index(section):]
    body = body[:body.index("\n#", len(section))]
    table = {}
    for line in body.splitlines():
        cells = [c.strip() for c in line.split("|")]
        if len(cells) < 4 or not cells[1].startswith(("`", "the ", "soft")):
            continue
        for name in re.findall(r"`([a-z_][a-z0-9_]*)[`(]", cells[1]):
            table[name] = cells[2]
    return table


def test_every_store_method_is_in_the_docs_table():
    from kvbridge.compat.mooncake import MooncakeDistributedStore

    table = _docs_table("### Methods (Mooncake 0.3.13.post1)")
    missing = [m for m in MOONCAKE_STORE_METHODS if m not in table]
    assert not missing, f"docs/mooncake.md's store table lacks {missing}"
    for method in MOONCAKE_STORE_METHODS:
        status = table[method]
        assert status in ("yes", "not yet", "no"), (method, status)
        # yes: present; not yet: absent (hasattr says so); no: present, raising the named error.
        assert hasattr(MooncakeDistributedStore, method) == (status != "not yet"), method
    try:
        from mooncake.store import MooncakeDistributedStore as Real
    except ImportError:
        return
    assert [m for m in _public(Real) if not m.startswith("_")] == MOONCAKE_STORE_METHODS, \
        "the wheel's methods changed: update the list and docs/mooncake.md"


def test_every_store_method_that_answers_is_called_in_this_suite():
    """The suite runs against both implementations, so a call made here is compared. The
    tensor family's calls are in test_mooncake_tensor_api.py, the sessions' and a few
    others' in test_mooncake_store_more.py, which run the same way."""
    import re

    from kvbridge.compat.mooncake import MooncakeDistributedStore

    here = Path(__file__)
    source = here.read_text() + "".join(
        here.with_name(name).read_text()
        for name in ("test_mooncake_tensor_api.py", "test_mooncake_store_more.py"))
    answered = [m for m in MOONCAKE_STORE_METHODS if hasattr(MooncakeDistributedStore, m)]
    uncalled = [m for m in answered if not re.search(rf"\.{m}\(", source)]
    assert not uncalled, f"no test calls {uncalled}"
