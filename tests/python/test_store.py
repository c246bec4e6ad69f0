"""The Python store API against an embedded cluster (real master, nodes, TCP transport)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import kvbridge
from kvbridge import errors

from conftest import need_cuda, python_env


def test_put_get_roundtrip_tensor_and_bytes(cluster):
    store = cluster.client()
    page = torch.randn(2, 16, 8, 64)  # (K/V, page_size, heads, head_dim)
    store.put("req1/page0", page)
    out = torch.empty_like(page)
    assert store.get_into("req1/page0", out) == page.numel() * 4
    assert torch.equal(out, page)
    store.put(b"raw-key", b"hello kvbridge")
    assert store.get(b"raw-key") == b"hello kvbridge"
    ba = bytearray(64)
    assert store.get_into("raw-key", ba) == 14 and bytes(ba[:14]) == b"hello kvbridge"


def test_missing_key_and_small_buffer_raise_named_errors(cluster):
    store = cluster.client()
    with pytest.raises(errors.NotFoundError) as e:
        store.get_into("absent", bytearray(16))
    assert e.value.code == errors.StatusCode.NOT_FOUND and e.value.name == "NOT_FOUND"
    assert isinstance(e.value, KeyError)  # Python's own type mixed in
    store.put("big", b"x" * 100)
    small = bytearray(b"\x07" * 10)
    with pytest.raises(errors.InvalidArgumentError, match="100 bytes"):
        store.get_into("big", small)
    assert small == bytearray(b"\x07" * 10)  # untouched


def test_sizes_come_from_the_master(cluster):
    store = cluster.client()
    store.put("sized", b"x" * 1234)
    assert store.get_size("sized") == 1234
    r = store.batch_get_size(["sized", "absent"])
    assert r[0].ok and r[0].size == 1234
    assert r[1].status.name == "NOT_FOUND"
    with pytest.raises(errors.NotFoundError):
        store.get_size("absent")


def test_exists_remove(cluster):
    store = cluster.client()
    store.put("k", b"v")
    assert store.exists("k") and not store.exists("nope")
    assert store.batch_exists(["k", "nope"]) == [True, False]
    assert store.batch_exists(("k", b"nope")) == [True, False]  # not a list: checked per key
    with pytest.raises(errors.InvalidArgumentError, match=r"keys\[1\]: expected str or bytes"):
        store.batch_exists(["k", 5])
    assert store.remove("k") is True
    assert store.remove("k") is False
    assert not store.exists("k")


def test_existing_key_is_success_without_rewrite(cluster):
    store = cluster.client()
    store.put("same", b"first")
    store.put("same", b"second")
    assert store.get("same") == b"first"


def test_upsert_replaces_existing_keys_in_every_form(cluster):
    store, src, dst = _registered_pair(cluster)
    a, b = src.data_ptr(), dst.data_ptr()
    store.put("up", b"first")
    store.upsert("up", b"second, longer")
    assert store.get("up") == b"second, longer"
    store.upsert("up-absent", bytearray(b"put"))  # an absent key is put
    assert store.get("up-absent") == b"put"
    st = store.batch_upsert_from(["up", "up-absent"], [(a, 4096), [(a + 4096, 64), (a, 64)]])
    assert all(s.ok for s in st), st
    got = store.batch_get_into(["up", "up-absent"], [(b, 4096), (b + 4096, 128)])
    assert [r.size for r in got] == [4096, 128]
    assert torch.equal(dst[:1024], src[:1024])
    assert store.batch_upsert_from_ptrs(["up", "up-ptr"], [a + 8192, a], [256, 64]) == {}
    raw = src.numpy().tobytes()
    assert store.get("up") == raw[8192:8192 + 256]
    assert store.get("up-ptr") == raw[:64]
    # A key twice in one upsert is refused natively and named through the general path.
    failed = store.batch_upsert_from_ptrs(["twice", "twice"], [a, a + 64], [64, 64])
    assert sorted(failed) == [0, 1] and failed[0].name == "INVALID_ARGUMENT"
    # The registered-memory single-key form.
    store.upsert("up", src[:16])
    assert store.get("up") == src[:16].numpy().tobytes()


def test_concurrent_upserts_of_one_key_take_turns(cluster):
    store = cluster.client()
    errors_seen: list = []

    def work(t: int) -> None:
        try:
            for _ in range(5):
                store.upsert("contended", bytes([65 + t]) * 4096)
        except errors.KvbError as e:
            errors_seen.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors_seen
    value = store.get("contended")
    assert len(value) == 4096 and value == value[:1] * 4096


def test_batch_zero_copy_with_multi_buffers_and_partial_failures(cluster):
    store = cluster.client()
    src = torch.arange(64 * 1024, dtype=torch.int32)  # 256 KiB
    dst = torch.zeros(64 * 1024, dtype=torch.int32)
    store.register_buffer(src)
    store.register_buffer(dst)
    k, v = src[:1024], src[1024:2048]
    statuses = store.batch_put_from(["kv0", "kv1"], [[k, v], src[4096:8192]])
    assert all(s.ok for s in statuses), statuses
    results = store.batch_get_into(["kv0", "missing", "kv1"],
                                   [[dst[:1024], dst[1024:2048]], dst[2048:3072], dst[4096:8192]])
    assert [r.ok for r in results] == [True, False, True]
    assert results[0].size == 8192 and results[2].size == 16384
    assert results[1].status.name == "NOT_FOUND"
    with pytest.raises(errors.NotFoundError):
        results[1].raise_if_error()
    assert torch.equal(dst[:2048], src[:2048]) and torch.equal(dst[4096:8192], src[4096:8192])
    # Unregistered memory in a batch is a per-key NOT_REGISTERED, others still succeed.
    loose = torch.ones(256, dtype=torch.int32)
    st = store.batch_put_from(["loose", "kv2"], [loose, src[8192:9216]])
    assert st[0].name == "NOT_REGISTERED" and st[1].ok
    assert [s.name for s in store.batch_remove(["kv0", "never"])] == ["OK", "NOT_FOUND"]
    store.unregister_buffer(src)
    with pytest.raises(errors.NotFoundError):
        store.unregister_buffer(src)


def _registered_pair(cluster):
    """A client with a 64 KiB source and a 64 KiB destination tensor registered."""
    store = cluster.client()
    src = torch.arange(16 * 1024, dtype=torch.int32)
    dst = torch.zeros(16 * 1024, dtype=torch.int32)
    store.register_buffer(src)
    store.register_buffer(dst)
    return store, src, dst


def test_pointer_batches_one_after_another_on_one_thread(cluster):
    """The native reader reuses its thread's key strings and buffer lists from batch to batch:
    each batch must see its own keys and buffers only, whatever came before it (more keys,
    longer keys, K|V lists, a batch the reader gave up on halfway, one past the size it keeps)."""
    store = cluster.client()
    n_big = 5000  # more keys than a thread's reused batch keeps (4096)
    src = torch.randint(0, 1 << 30, (n_big * 16,), dtype=torch.int32)  # 64 B per key
    dst = torch.zeros_like(src)
    store.register_buffer(src)
    store.register_buffer(dst)
    a, b = src.data_ptr(), dst.data_ptr()

    def check(keys, offsets):
        dst.zero_()
        sizes, failed = store.batch_get_into_ptrs(keys, [b + o for o in offsets], [64] * len(keys))
        assert failed == {} and sizes == [64] * len(keys)
        for o in offsets:
            assert torch.equal(dst[o // 4:o // 4 + 16], src[o // 4:o // 4 + 16]), o

    long_keys = [f"scratch-a-much-longer-key-than-the-next-batch-uses-{i:04d}" for i in range(300)]
    assert store.batch_put_from_ptrs(long_keys, [a + 64 * i for i in range(300)], [64] * 300) == {}
    check(long_keys, [64 * i for i in range(300)])
    # Fewer, shorter keys, read from other offsets: no key or buffer of the last batch remains.
    short = [f"s{i}" for i in range(3)]
    assert store.batch_put_from_ptrs(short, [a + 64 * (400 + i) for i in range(3)], [64] * 3) == {}
    check(short, [64 * (400 + i) for i in range(3)])
    # K|V lists (two buffers per key), then single buffers again.
    kv = [f"kv{i}" for i in range(4)]
    addrs = [[a + 64 * (500 + 2 * i), a + 64 * (501 + 2 * i)] for i in range(4)]
    assert store.batch_put_from_ptrs(kv, addrs, [[32, 32]] * 4) == {}
    sizes, failed = store.batch_get_into_ptrs(kv, [[b + 64 * (500 + 2 * i), b + 64 * (501 + 2 * i)]
                                                   for i in range(4)], [[32, 32]] * 4)
    assert failed == {} and sizes == [64] * 4
    for i in range(4):
        for j in (500 + 2 * i, 501 + 2 * i):
            assert torch.equal(dst[16 * j:16 * j + 8], src[16 * j:16 * j + 8])
    check(short[:2], [64 * 400, 64 * 401])
    # A batch the native reader gives up on at its third key (a bool address) goes the checked
    # way and is refused; the next batch is whole.
    assert store._try_get_into_ptrs(long_keys[:3], [b, b + 64, True], [64] * 3, False) is None
    check(long_keys[10:12], [640, 704])
    # Past the kept size, then small again.
    big = [f"big{i}" for i in range(n_big)]
    assert store.batch_put_from_ptrs(big, [a + 64 * i for i in range(n_big)], [64] * n_big) == {}
    check(big, [64 * i for i in range(n_big)])
    check(short, [64 * (400 + i) for i in range(3)])


def test_batch_raw_address_pairs_and_bad_pairs_named(cluster):
    store, src, dst = _registered_pair(cluster)
    a, b = src.data_ptr(), dst.data_ptr()
    # (address, length) pairs alone and in lists (K|V), as the Mooncake layer passes them.
    st = store.batch_put_from(["raw0", "raw1"], [(a, 4096), [(a + 4096, 1024), (a + 8192, 1024)]])
    assert all(s.ok for s in st), st
    got = store.batch_get_into(["raw0", "raw1"], [(b, 4096), [(b + 4096, 1024), (b + 8192, 1024)]])
    assert [r.size for r in got] == [4096, 2048]
    assert torch.equal(dst[:1024], src[:1024]) and torch.equal(dst[1024:1280], src[1024:1280])
    assert torch.equal(dst[2048:2304], src[2048:2304])
    # A pair that is not a valid range is named with its position, never sent.
    with pytest.raises(errors.InvalidArgumentError, match=r"buffers\[1\]\[0\].*not a valid range"):
        store.batch_get_into(["raw0", "raw1"], [(b, 4096), [(0, 1024)]])
    with pytest.raises(errors.InvalidArgumentError, match=r"buffers\[0\].*not a valid range"):
        store.batch_put_from(["neg"], [(a, -1)])


def test_pointer_list_batches_and_their_bad_inputs(cluster):
    np = pytest.importorskip("numpy")
    store, src, dst = _registered_pair(cluster)
    a, b = src.data_ptr(), dst.data_ptr()
    keys = [f"ptr{i}" for i in range(8)]
    assert store.batch_put_from_ptrs(keys, [a + 4096 * i for i in range(8)], [4096] * 8) == {}
    # Failures only, by index; the others are read.
    sizes, failed = store.batch_get_into_ptrs(
        keys[:2] + ["absent", keys[2]], [b, b + 4096, b + 8192, b + 12288], [4096, 4096, 64, 100])
    assert sizes == [4096, 4096, 0, 0]
    assert {i: st.name for i, st in failed.items()} == {2: "NOT_FOUND", 3: "INVALID_ARGUMENT"}
    assert torch.equal(dst[:2048], src[:2048])
    # Unregistered memory fails that key alone.
    loose = torch.ones(1024, dtype=torch.int32)
    failed = store.batch_put_from_ptrs(["loose", "ptr-ok"], [loose.data_ptr(), a], [4096, 64])
    assert list(failed) == [0] and failed[0].name == "NOT_REGISTERED"
    assert store.exists("ptr-ok") and not store.exists("loose")
    # Lists of plain ints are read natively; anything else falls back (None).
    assert store._try_get_into_ptrs(keys[:1], [b], [4096], False) is not None
    assert store._try_get_into_ptrs(tuple(keys[:1]), [b], [4096], False) is None
    assert store._try_get_into_ptrs(keys[:1], [[b]], [[4096]], False) is None
    assert store._try_get_into_ptrs(keys[:1], [[b, b + 64]], [[64, 64]], True) is not None
    assert store._try_get_into_ptrs(keys[:1], [[b, b + 64]], [[64]], True) is None
    assert store._try_put_from_ptrs(["k1", "k1"], [a, a], [64, 64], False) is None
    # What the native reader does not take goes through the general path: tuples and numpy
    # integers work; a key twice in a put, bools, a zero address or different list lengths
    # are named.
    sizes, failed = store.batch_get_into_ptrs(tuple(keys[3:5]), (np.int64(b), b + 4096),
                                              [np.uint32(4096), 4096])
    assert sizes == [4096, 4096] and failed == {}
    assert torch.equal(dst[:2048], src[3 * 1024:5 * 1024])
    failed = store.batch_put_from_ptrs(["twice", "twice"], [a, a + 64], [64, 64])
    assert {st.name for st in failed.values()} == {"INVALID_ARGUMENT"} and len(failed) == 2
    assert "appears 2 times" in failed[0].message
    with pytest.raises(errors.InvalidArgumentError,
                       match=r"addresses\[1\]: expected int, got bool"):
        store.batch_get_into_ptrs(keys[:2], [b, True], [64, 64])
    with pytest.raises(errors.InvalidArgumentError, match=r"lengths\[0\]: expected int, got str"):
        store.batch_put_from_ptrs(["s"], [a], ["64"])
    with pytest.raises(errors.InvalidArgumentError, match=r"buffers\[0\].*not a valid range"):
        store.batch_get_into_ptrs(keys[:1], [0], [64])
    with pytest.raises(errors.InvalidArgumentError, match="2 keys but 1 addresses and 2 lengths"):
        store.batch_get_into_ptrs(keys[:2], [b], [64, 64])
    with pytest.raises(errors.InvalidArgumentError, match=r"keys\[1\]"):
        store.batch_put_from_ptrs(["k", 7], [a, a], [64, 64])
    assert not store.exists("k")
    # Several buffers per key (K and V): one object, read back into two buffers in order.
    assert store.batch_put_from_ptrs(["kv0", "kv1"], [[a, a + 8192], [a + 4096, a + 100]],
                                     [[1024, 1024], [512, 12]]) == {}
    assert store.get_size("kv0") == 2048 and store.get_size("kv1") == 524
    dst.zero_()
    sizes, failed = store.batch_get_into_ptrs(["kv0", "kv1"], [[b, b + 1024], [b + 2048, b + 3072]],
                                              [[1024, 1024], [512, 512]])
    assert sizes == [2048, 524] and failed == {}
    assert torch.equal(dst[:256], src[:256]) and torch.equal(dst[256:512], src[2048:2304])
    assert torch.equal(dst[512:640], src[1024:1152])
    assert torch.equal(dst[768:771], src[25:28])
    # Lists of different lengths for one key, or a list against an int, are named.
    with pytest.raises(errors.InvalidArgumentError,
                       match=r"addresses\[0\] and lengths\[0\]: expected two lists"):
        store.batch_get_into_ptrs(["kv0"], [[b, b + 64]], [[64]])
    with pytest.raises(errors.InvalidArgumentError,
                       match=r"addresses\[1\] and lengths\[1\]: expected two lists"):
        store.batch_get_into_ptrs(["kv0", "kv1"], [[b], [b]], [[64], 64])
    with pytest.raises(errors.InvalidArgumentError, match=r"lengths\[0\]\[1\]: expected int"):
        store.batch_put_from_ptrs(["kv9"], [[a, a]], [[64, 6.4]])


def test_registered_buffer_get_into_is_zero_copy_path(cluster):
    store = cluster.client()
    buf = torch.zeros(1 << 16, dtype=torch.uint8)
    store.register_buffer(buf)
    buf[:100] = 9
    store.put("reg", buf[:100])  # registered: the zero-copy path
    assert store.get_into("reg", buf[1000:1100]) == 100
    assert bool((buf[1000:1100] == 9).all())
    with pytest.raises(errors.AlreadyExistsError):
        store.register_buffer(buf[10:20])


def test_bad_inputs_name_what_was_wrong(cluster):
    store = cluster.client()
    with pytest.raises(errors.InvalidArgumentError, match="keys\\[1\\]"):
        store.batch_exists(["ok", 5])
    with pytest.raises(errors.InvalidArgumentError, match="2 keys but 1 buffers"):
        store.batch_put_from(["a", "b"], [b"x"])
    with pytest.raises(errors.InvalidArgumentError, match="not contiguous"):
        store.put("t", torch.zeros(4, 4).t())
    with pytest.raises(errors.InvalidArgumentError, match="expected a torch.Tensor"):
        store.put("t", 12345)
    with pytest.raises(errors.InvalidArgumentError):
        store.put("", b"empty key")
    with pytest.raises(errors.InvalidArgumentError, match="get_into"):
        store.get_into("t", b"read-only bytes")


def test_options_are_keywords_and_typos_are_refused():
    with pytest.raises(TypeError, match="replica_nmu"):
        kvbridge.Cluster(nodes=1, replica_nmu=2)
    with pytest.raises(errors.InvalidArgumentError, match="node_ttl_ms"):
        kvbridge.Cluster(nodes=1, node_ttl_ms=-5)
    with pytest.raises(errors.InvalidArgumentError, match="replica_num"):
        kvbridge.Cluster(nodes=1, replica_num=2)
    with kvbridge.Cluster(nodes=1, dram_bytes_per_node=16 << 20, tcp_lanes_per_peer=2,
                          deadline_ms=4000) as c:
        c.client().put("x", b"y")
        # hedged-read options reach the client; a delay with no bandwidth to scale it is named
        for opts in ({"hedge_after_ms": 0}, {"hedge_after_ms": 5, "hedge_bandwidth_mbps": 200}):
            with kvbridge.StoreClient(master=c.master_address, **opts) as client:
                assert client.get("x") == b"y"
        with pytest.raises(errors.InvalidArgumentError, match="hedge_bandwidth_mbps"):
            kvbridge.StoreClient(master=c.master_address, hedge_bandwidth_mbps=0)
        with pytest.raises(errors.InvalidArgumentError, match="hedge_after_ms"):
            kvbridge.StoreClient(master=c.master_address, hedge_after_ms=-1)


def test_pins_keep_objects_through_a_store_filled_past_its_capacity():
    """Hard- and soft-pinned objects outlive a fill of many times the store's memory; the
    unpinned ones put before them are evicted (docs/store.md "Eviction")."""
    with kvbridge.Cluster(nodes=1, dram_bytes_per_node=8 << 20) as c:
        value = b"p" * 65536
        hard = kvbridge.StoreClient(master=c.master_address, hard_pin=True)
        soft = kvbridge.StoreClient(master=c.master_address, soft_pin="enable",
                                    soft_pin_ttl_ms=600000)
        plain = c.client()
        try:
            for i in range(8):
                plain.put(f"old{i}", value)
            for i in range(16):
                hard.put(f"hard{i}", value)
                soft.put(f"soft{i}", value)
            for i in range(400):  # 25 MiB through an 8 MiB pool
                plain.put(f"fill{i}", value)
            keys = [f"hard{i}" for i in range(16)] + [f"soft{i}" for i in range(16)]
            assert all(plain.batch_exists(keys)), "a pinned object was evicted"
            assert not any(plain.batch_exists([f"old{i}" for i in range(8)]))
            assert plain.get("soft3") == value and plain.get("hard3") == value
        finally:
            hard.close()
            soft.close()


def test_pin_options_are_checked():
    """A bad soft_pin, or a TTL without soft_pin="enable", is refused naming the option."""
    with pytest.raises(errors.InvalidArgumentError, match="soft_pin"):
        kvbridge.StoreClient(master="127.0.0.1:1", soft_pin="sometimes")
    with pytest.raises(errors.InvalidArgumentError, match="soft_pin_ttl_ms"):
        kvbridge.StoreClient(master="127.0.0.1:1", soft_pin_ttl_ms=1000)
    with pytest.raises(errors.InvalidArgumentError, match="hard_pin"):
        kvbridge.StoreClient(master="127.0.0.1:1", hard_pin="yes")


def _wait_task(store, task_id, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while True:
        t = store.query_task(task_id)
        if t["state"] != "PROCESSING" or time.monotonic() > deadline:
            return t
        time.sleep(0.05)


def test_copy_and_move_objects_between_nodes():
    """copy_object adds a replica on the node named, move_object moves one; the tasks end
    SUCCESS and the bytes read back from the new places (docs/store.md "Copying and moving
    objects"); bad requests raise naming what is wrong."""
    with kvbridge.Cluster(nodes=3, dram_bytes_per_node=16 << 20) as c:
        store = c.client()
        value = bytes(range(256)) * 64
        store.put("k", value)
        nodes = sorted(p.node_id for p in c.node_ids())
        (first,) = [r.node_id for r in store.batch_replicas(["k"])[0].raise_if_error()]
        a, b = [n for n in nodes if n != first]
        t = _wait_task(store, store.copy_object("k", [a]))
        assert t["state"] == "SUCCESS" and not t["move"] and t["source"] == first, t
        assert t["key"] == b"k" and t["created_unix_ms"] <= t["updated_unix_ms"]
        held = {r.node_id for r in store.batch_replicas(["k"])[0].raise_if_error()}
        assert held == {first, a}
        t = _wait_task(store, store.move_object("k", first, b))
        assert t["state"] == "SUCCESS" and t["move"], t
        held = {r.node_id for r in store.batch_replicas(["k"])[0].raise_if_error()}
        assert held == {a, b}
        assert store.get("k") == value
        with pytest.raises(errors.NotFoundError):
            store.copy_object("absent", [a])
        with pytest.raises(errors.NotFoundError):
            store.move_object("k", first, a)  # first holds no replica now
        with pytest.raises(errors.InvalidArgumentError):
            store.move_object("k", a, a)
        with pytest.raises(errors.InvalidArgumentError):
            store.copy_object("k", a)  # one str, not a list
        with pytest.raises(errors.NotFoundError):
            store.query_task(987654321)


def test_torch_imports_after_a_cluster_started_first():
    """A process that starts kvbridge before importing torch can still import torch: the nccl
    plugin's probe loads the NCCL torch will use (the nvidia-nccl wheel of this Python), not the
    system's, even with the venv not activated (kvbridge/__init__.py)."""
    import importlib.util
    import os
    import subprocess
    import sys

    from conftest import python_env

    if importlib.util.find_spec("nvidia.nccl") is None:
        pytest.skip("this Python has no nvidia-nccl wheel: torch loads no NCCL of its own")
    env = python_env()
    env.pop("VIRTUAL_ENV", None)
    env.pop("KVBRIDGE_NCCL_LIBRARY", None)
    env["KVBRIDGE_LOG_LEVEL"] = "error"
    code = ("import kvbridge\n"
            "c = kvbridge.Cluster(nodes=1, dram_bytes_per_node=16 << 20)\n"
            "import torch\n"
            "c.close()\n"
            "print('imported', torch.__version__)\n")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and "imported" in r.stdout, r.stderr[-2000:]
    assert os.environ.get("KVBRIDGE_NCCL_LIBRARY", "").endswith("libnccl.so.2")


def test_replicas_survive_a_stopped_node():
    with kvbridge.Cluster(nodes=3, replica_num=2, dram_bytes_per_node=32 << 20) as c:
        store = c.client()
        for i in range(20):
            store.put(f"k{i}", bytes([i]) * 4096)
        # Where they are: two replicas each, on two distinct nodes of the cluster.
        nodes = {p.node_id: p.incarnation for p in c.node_ids()}
        reps = store.batch_replicas([f"k{i}" for i in range(20)] + ["absent"])
        for r in reps[:20]:
            assert r.ok and len({x.node_id for x in r.raise_if_error()}) == 2
            assert all(nodes[x.node_id] == x.incarnation and x.tier == "DRAM" and x.size == 4096
                       for x in r.replicas)
        assert reps[20].status.name == "NOT_FOUND" and reps[20].replicas == []
        with pytest.raises(errors.NotFoundError):
            reps[20].raise_if_error()
        c.stop_node(0)
        for i in range(20):
            assert store.get(f"k{i}") == bytes([i]) * 4096
        with pytest.raises(errors.UnavailableError, match="stopped"):
            c.node_object_count(0)
        st = c.status()
        assert st["objects"] == 20 and len(st["nodes"]) >= 2


def test_closed_objects_raise_unavailable():
    c = kvbridge.Cluster(nodes=1, dram_bytes_per_node=16 << 20)
    store = c.client()
    c.close()
    with pytest.raises(errors.UnavailableError, match="closed"):
        store.put("k", b"v")
    with pytest.raises(errors.UnavailableError):
        _ = c.master_address


POLL_ENGINE = r"""
import ctypes, sys
import kvbridge
store = kvbridge.StoreClient(master=sys.argv[1])
store.put("poll-engine", b"x")
assert store.get("poll-engine") == b"x"
libc = ctypes.CDLL(None)
libc.getenv.restype = ctypes.c_char_p
try:  # gRPC's own answer, from the libgrpc kvbridge's libraries loaded (not a public symbol)
    name = ctypes.CDLL("libgrpc.so.29")["_Z27grpc_get_poll_strategy_namev"]
    name.restype = ctypes.c_char_p
    engine = name().decode()
except (OSError, AttributeError):
    engine = "unknown"
print(libc.getenv(b"GRPC_POLL_STRATEGY").decode(), engine)
store.close()
"""


@pytest.mark.parametrize("preset", [None, "epoll1"])
def test_a_client_process_polls_its_own_calls_unless_told_otherwise(cluster, preset):
    """A process whose first gRPC user is a store client runs gRPC's "poll" engine (the caller
    reads its own reply; docs/performance.md, the embedded deployment); a
    GRPC_POLL_STRATEGY set by the user is kept."""
    import subprocess
    import sys

    env = python_env()
    env.pop("GRPC_POLL_STRATEGY", None)
    if preset:
        env["GRPC_POLL_STRATEGY"] = preset
    r = subprocess.run([sys.executable, "-c", POLL_ENGINE, cluster.master_address], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    var, engine = r.stdout.split()
    want = preset or "poll"
    assert var == want
    if engine == "unknown":
        pytest.skip(f"the variable is {var}; this libgrpc does not say which engine it runs")
    assert engine == want


def test_blocking_calls_release_the_gil(cluster):
    """A Python thread keeps running while another thread is inside batch calls."""
    store = cluster.client()
    buf = torch.zeros(4 << 20, dtype=torch.uint8)
    store.register_buffer(buf)
    keys = [f"gil{i}" for i in range(64)]
    views = [buf[i * 65536:(i + 1) * 65536] for i in range(64)]
    ticks = 0
    stop = threading.Event()

    def spin():
        nonlocal ticks
        while not stop.is_set():
            ticks += 1

    t = threading.Thread(target=spin)
    t.start()
    try:
        calls = 0
        before = ticks
        while calls < 20:
            store.batch_put_from(keys, views)
            store.batch_get_into(keys, views)
            calls += 1
        progressed = ticks - before
    finally:
        stop.set()
        t.join()
    assert progressed > 1000, f"the other thread only ran {progressed} loops"


def test_standalone_master_nodes_client_and_drain():
    with kvbridge.Master(master_listen="127.0.0.1:0", node_ttl_ms=2000) as master:
        nodes = [kvbridge.Node(master=master.address, node_dram_bytes=16 << 20,
                               node_id=f"py-node-{c}", drain_timeout_ms=10000) for c in "ab"]
        try:
            with kvbridge.StoreClient(master=master.address) as client:
                for i in range(6):
                    client.put(f"standalone{i}", bytes([i]) * 1000)
                assert sum(n.object_count for n in nodes) == 6
                assert nodes[0].id.node_id == "py-node-a"
                st = master.status()
                assert sorted(n["node_id"] for n in st["nodes"]) == ["py-node-a", "py-node-b"]
                nodes[0].drain()  # its objects move to node b
                assert nodes[1].object_count == 6
                nodes[0].close()
                for i in range(6):
                    assert client.get(f"standalone{i}") == bytes([i]) * 1000
        finally:
            for n in nodes:
                n.close()


def test_a_tokened_cluster_refuses_strangers_and_remove_all_needs_the_admin_token():
    """With a cluster token (docs/security.md) every control-plane call must prove it:
    a client or status query without it gets UnauthenticatedError; remove_all needs the
    admin token (PermissionDeniedError naming KVBRIDGE_ADMIN_TOKEN without it)."""
    with kvbridge.Cluster(nodes=2, dram_bytes_per_node=16 << 20, cluster_token="py-t0ken",
                          transports="tcp") as cluster:
        client = cluster.client()
        client.put("secret", b"s" * 1000)
        assert client.get("secret") == b"s" * 1000
        assert cluster.status()["objects"] == 1
        with pytest.raises(errors.UnauthenticatedError):
            kvbridge.cluster_status(cluster.master_address, cluster_token="")
        with kvbridge.StoreClient(master=cluster.master_address, transports="tcp",
                                  cluster_token="") as stranger:
            with pytest.raises(errors.UnauthenticatedError):
                stranger.get("secret")
        with pytest.raises(errors.PermissionDeniedError, match="KVBRIDGE_ADMIN_TOKEN"):
            client.remove_all()
        assert client.get("secret") == b"s" * 1000
        cluster.drain_node(1)  # a node drains itself with its own registration secret
        assert client.get("secret") == b"s" * 1000
    with kvbridge.Master(master_listen="127.0.0.1:0", cluster_token="py-t0ken",
                         admin_token="py-adm1n") as master:
        node = kvbridge.Node(master=master.address, node_dram_bytes=16 << 20, node_id="py-adm",
                             cluster_token="py-t0ken", transports="tcp")
        try:
            with kvbridge.StoreClient(master=master.address, cluster_token="py-t0ken",
                                      transports="tcp") as client:
                client.put("k", b"v" * 100)
                with pytest.raises(errors.PermissionDeniedError):
                    client.remove_all()
            with kvbridge.StoreClient(master=master.address, cluster_token="py-t0ken",
                                      admin_token="py-adm1n", transports="tcp") as admin:
                admin.remove_all()
            assert master.status()["objects"] == 0
        finally:
            node.close()


def test_failures_name_the_master_as_the_side_that_failed():
    """A call that fails at the master says so in ``origin`` (exceptions and batch statuses
    alike), not only in its message."""
    with kvbridge.Master(master_listen="127.0.0.1:0", node_ttl_ms=2000) as master:
        node = kvbridge.Node(master=master.address, node_dram_bytes=16 << 20, node_id="py-o")
        try:
            # (location_cache_entries=0: the client reads nothing without the master)
            with kvbridge.StoreClient(master=master.address, rpc_timeout_ms=500,
                                      location_cache_entries=0) as client:
                client.put("here", b"v" * 100)
                buf = torch.zeros(4096, dtype=torch.uint8)
                client.register_buffer(buf)
                master.close()
                with pytest.raises(errors.KvbError) as e:
                    client.get("here")
                assert e.value.origin == "master", e.value
                (r,) = client.batch_get_into(["here"], [buf])
                assert not r.ok and r.status.origin == "master", r.status
                with pytest.raises(errors.KvbError) as e:
                    r.raise_if_error()
                assert e.value.origin == "master"
        finally:
            node.close()


def test_remembered_objects_are_read_while_the_master_is_away():
    """With the master gone, what the client put is read from the node (docs/store.md "Reads
    while the master is away") and counted; a key it never saw fails naming the master."""
    with kvbridge.Master(master_listen="127.0.0.1:0", node_ttl_ms=2000) as master:
        node = kvbridge.Node(master=master.address, node_dram_bytes=16 << 20, node_id="py-away")
        try:
            with kvbridge.StoreClient(master=master.address, rpc_timeout_ms=500,
                                      master_wait_ms=200) as client:
                client.put("kept", b"k" * 3000)
                master.close()
                assert client.get("kept") == b"k" * 3000
                assert client.stats()["gets_without_master"] == 1
                with pytest.raises(errors.KvbError) as e:
                    client.get("never-put")
                assert e.value.origin == "master", e.value
        finally:
            node.close()


def test_reads_without_the_master_need_a_wait():
    """master_wait_ms=0 with the location cache on is refused, naming the option."""
    with pytest.raises(errors.InvalidArgumentError, match="master_wait_ms"):
        kvbridge.StoreClient(master="127.0.0.1:1", master_wait_ms=0)
    with pytest.raises(errors.InvalidArgumentError, match="location_cache_entries"):
        kvbridge.StoreClient(master="127.0.0.1:1", location_cache_entries=-1)


def test_error_names_match_the_native_codes():
    """kvbridge.errors names every status as the C++ library does (IO_ERROR, not IO)."""
    from kvbridge import _C

    assert {c.name: int(c) for c in errors.StatusCode} == dict(_C.STATUS_CODES)
    assert errors.StatusCode.IO == errors.StatusCode.IO_ERROR  # the old spelling still works
    e = errors.from_status(18, "IO_ERROR", "disk gone", "storage_node")
    assert isinstance(e, errors.IoError) and e.origin == "storage_node"
    assert errors.from_status(3, "NOT_FOUND", "x").origin == ""


def test_client_without_master_fails_fast_with_a_named_error():
    import time

    from conftest import free_port

    t = time.monotonic()
    with pytest.raises(errors.KvbError) as e:
        c = kvbridge.StoreClient(master=f"127.0.0.1:{free_port()}", rpc_timeout_ms=500)
        c.put("k", b"v")
    assert e.value.name in ("PEER_UNREACHABLE", "UNAVAILABLE", "DEADLINE_EXCEEDED")
    assert time.monotonic() - t < 5


def test_cuda_tensors(cluster):
    """Unregistered CUDA tensors go through host memory in put/get_into and are
    NOT_REGISTERED in the batch forms; registered ones go straight (tests/python/
    test_store_device.py has the same over the fake driver, for machines without a GPU)."""
    need_cuda(torch.cuda.is_available(), "no CUDA device on this machine")
    store = cluster.client()
    page = torch.randn(2, 16, 8, 64, device="cuda")
    store.put("cuda/page", page)
    out = torch.zeros_like(page)
    assert store.get_into("cuda/page", out) == page.numel() * 4
    assert torch.equal(out, page)
    assert store.batch_put_from(["x"], [page])[0].name == "NOT_REGISTERED"
    store.register_buffer(page)
    store.register_buffer(out)
    assert all(st.ok for st in store.batch_put_from(["x"], [page]))
    out.zero_()
    assert store.batch_get_into(["x"], [out])[0].size == page.numel() * 4
    assert torch.equal(out, page)
