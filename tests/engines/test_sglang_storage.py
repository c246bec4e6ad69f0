"""kvbridge.integrations.sglang against the real SGLang 0.5.23 storage layer, no engine.

Every backend is built the way SGLang's cache controller builds it: through
StorageBackendFactory.create_backend("dynamic", config, host_pool), then
register_mem_pool_host(host_pool) and on_host_pools_registered(), on SGLang's own host KV
pools (MHATokenToKVPoolHost, MLATokenToKVPoolHost; pin_memory=False, there is no CUDA here)
in the page_first, page_first_direct and layer_first layouts. The store is a kvbridge
cluster: in this process for the plain cases, real `kvbridge master` / `kvbridge node`
processes (tests/engines/harness.py) where one is killed or frozen.

Run: .venv-engines/bin/python -m pytest tests/engines/test_sglang_storage.py (docs/sglang.md).
"""

from __future__ import annotations

import hashlib
import json
import signal
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("sglang")
kvbridge = pytest.importorskip("kvbridge")

import harness  # noqa: E402  (tests/engines, put on sys.path by conftest)

BASE = {"backend_name": "kvbridge", "module_path": "kvbridge.integrations.sglang",
        "class_name": "KvbridgeHiCacheStorage", "interface_v1": 1}
PAGE = 4
LAYOUTS = ("page_first", "page_first_direct", "layer_first")


# -- SGLang objects ------------------------------------------------------------------------
def host_budget():
    """SGLang sizes host pools against the machine's free RAM minus a 10 GiB reserve (meant
    for GPU servers); on a shared 24 GB test box that can be negative. Its own scope books
    the few MiB these pools take against a fixed budget instead."""
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope

    return host_memory_budget_scope(2 << 30)


def make_host(layout: str, mla: bool = False, layers: int = 2, tokens: int = 256):
    """One of SGLang's host KV pools over a CPU device pool, filled with random values."""
    with host_budget():
        return _make_host(layout, mla, layers, tokens)


def _make_host(layout, mla, layers, tokens):
    if mla:
        from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
        from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

        dev = MLATokenToKVPool(tokens, PAGE, torch.float32, 16, 8, layers, "cpu", False)
        host = MLATokenToKVPoolHost(dev.get_device_pool_infos()[0].buffer_info, 2, 0, PAGE,
                                    layout, pin_memory=False, device_capacity_tokens=tokens,
                                    start_layer=0, end_layer=layers, target_layer_num=layers)
    else:
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
        from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

        dev = MHATokenToKVPool(tokens, PAGE, torch.float32, 2, 32, layers, "cpu", False)
        host = MHATokenToKVPoolHost(dev.get_device_pool_infos()[0].buffer_info, 2, 0, PAGE,
                                    layout, pin_memory=False, device_capacity_tokens=tokens,
                                    start_layer=0, end_layer=layers)
    host.kv_buffer.copy_(torch.randn(host.kv_buffer.shape))
    return host


def make_config(extra: dict, *, mla: bool = False, tp_rank: int = 0, tp_size: int = 1,
                pp_rank: int = 0, pp_size: int = 1, layout: str = "page_first",
                model: str = "test/tiny-llama"):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank,
                                pp_size=pp_size, attn_cp_rank=0, attn_cp_size=1,
                                is_mla_model=mla, enable_storage_metrics=True,
                                is_page_first_layout=layout == "page_first", model_name=model,
                                extra_config=dict(extra))


def make_backend(extra: dict, host, **cfg):
    """What HiCacheController.attach_storage_backend does, in its order."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    backend = StorageBackendFactory.create_backend(
        "dynamic", make_config(extra, layout=host.layout, **cfg), host)
    backend.register_mem_pool_host(host)
    backend.on_host_pools_registered()
    return backend


def page_keys(n: int, tag: str = "") -> list[str]:
    """A chain of SHA-256 page hashes, as SGLang computes them (64 hex characters)."""
    out, prev = [], tag
    for i in range(n):
        prev = hashlib.sha256(f"{prev}|{i}".encode()).hexdigest()
        out.append(prev)
    return out


def slots(first_page: int, pages: int) -> "torch.Tensor":
    """Host token slots of `pages` pages from page `first_page` (what the controller passes)."""
    return torch.arange(first_page * PAGE, (first_page + pages) * PAGE, dtype=torch.int64)


def page(host, p: int) -> "torch.Tensor":
    return host.get_data_page(p * PAGE, flat=True).clone()


def clear_pages(host, first_page: int, pages: int) -> None:
    for p in range(first_page, first_page + pages):
        host.set_from_flat_data_page(p * PAGE, torch.zeros_like(page(host, p)))


# -- fixtures ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster():
    with kvbridge.Cluster(nodes=2, dram_bytes_per_node=64 << 20) as c:
        yield c


@pytest.fixture
def master(cluster):
    cluster.client().remove_all()
    return {**BASE, "master": cluster.master_address}


@pytest.fixture
def backends():
    made = []
    yield made
    for b in made:
        b.close()


# -- the zero-copy page interface ------------------------------------------------------------
CASES = [(layout, False, 2) for layout in LAYOUTS] + [(layout, True, 2) for layout in LAYOUTS] + [
    ("layer_first", False, 9),  # 18 buffers per page: two store objects per page
    ("layer_first", True, 20),  # MLA, 20 buffers per page: two objects
    ("page_head", False, 2),  # heterogeneous-TP layout (one object per page here too)
]


@pytest.mark.parametrize("layout,mla,layers", CASES,
                         ids=[f"{lay}-{'mla' if m else 'mha'}-L{n}" for lay, m, n in CASES])
def test_v1_round_trip_into_other_host_slots(master, backends, cluster, layout, mla, layers):
    host = make_host(layout, mla=mla, layers=layers)
    b = make_backend(master, host, mla=mla)
    backends.append(b)
    ptrs, sizes = host.get_page_buffer_meta(slots(0, 1))
    assert b._bufs_per_page == len(ptrs)  # taken from the pool, not assumed
    objects_per_page = -(-len(ptrs) // 16)
    keys = page_keys(6, layout)
    want = [page(host, 1 + i) for i in range(6)]

    assert b.batch_set_v1(keys, slots(1, 6)) == [True] * 6
    assert cluster.status()["objects"] == 6 * objects_per_page
    clear_pages(host, 20, 7)
    assert b.batch_get_v1(keys, slots(20, 6)) == [True] * 6
    for i in range(6):
        assert torch.equal(page(host, 20 + i), want[i]), f"page {i}"
    assert torch.count_nonzero(page(host, 26)) == 0  # the page after them is untouched

    s = b.stats()
    assert (s["get_hit_pages"], s["get_miss_pages"], s["set_ok_pages"]) == (6, 0, 6)
    assert s["get_bytes"] == 6 * sum(sizes) and s["set_bytes"] == 6 * sum(sizes)
    assert s["errors"] == 0
    # The store client's own counters, per object (a page is objects_per_page of them).
    assert s["store_client_get_hits"] == s["store_client_puts_stored"] == 6 * objects_per_page
    assert s["store_client_bytes_read"] == s["store_client_bytes_written"] == 6 * sum(sizes)
    assert s["store_client_get_misses"] == s["store_client_errors"] == 0
    assert s["store_client_hit_rate"] == 1.0 and s["store_client_get_calls"] == 1
    assert s["store_client_get_mean_seconds"] > 0 and s["store_client_put_mean_seconds"] > 0


def test_batch_exists_counts_the_leading_run(master, backends):
    host = make_host("page_first")
    b = make_backend(master, host)
    backends.append(b)
    keys = page_keys(8, "exists")
    assert b.batch_exists(keys) == 0
    assert b.batch_set_v1(keys[:5], slots(1, 5)) == [True] * 5
    assert b.batch_exists(keys) == 5
    assert b.batch_exists(keys[:3]) == 3
    assert b.batch_exists(keys[5:]) == 0
    assert b.batch_set_v1([keys[6]], slots(7, 1)) == [True]  # a hole at 5
    assert b.batch_exists(keys) == 5
    assert b.exists(keys[6]) and not b.exists(keys[5])
    assert b.batch_exists([]) == 0


def test_set_is_idempotent_and_never_rewrites(master, backends, cluster):
    host = make_host("page_first_direct")
    b = make_backend(master, host)
    backends.append(b)
    keys = page_keys(4, "idem")
    first = [page(host, 1 + i) for i in range(4)]
    assert b.batch_set_v1(keys, slots(1, 4)) == [True] * 4
    objects = cluster.status()["objects"]
    host.kv_buffer.add_(1.0)  # same keys, other bytes: the store keeps what it has
    assert b.batch_set_v1(keys, slots(1, 4)) == [True] * 4
    assert cluster.status()["objects"] == objects
    assert b.batch_get_v1(keys, slots(30, 4)) == [True] * 4
    for i in range(4):
        assert torch.equal(page(host, 30 + i), first[i])


def test_missing_pages_are_false_and_the_controller_keeps_the_leading_run(master, backends):
    host = make_host("layer_first", layers=9)  # two objects per page
    b = make_backend(master, host)
    backends.append(b)
    keys = page_keys(6, "partial")
    want = [page(host, 1 + i) for i in range(6)]
    assert b.batch_set_v1([keys[i] for i in (0, 1, 2, 4)], torch.cat(
        [slots(1 + i, 1) for i in (0, 1, 2, 4)])) == [True] * 4
    clear_pages(host, 40, 6)
    got = b.batch_get_v1(keys, slots(40, 6))
    assert got == [True, True, True, False, True, False]
    for i in (0, 1, 2, 4):
        assert torch.equal(page(host, 40 + i), want[i])
    # One object of a page gone: the whole page is a miss, for exists and for get.
    store = kvbridge.StoreClient(master=master["master"])
    try:
        assert store.remove(b.object_keys([keys[1]])[1])
    finally:
        store.close()
    assert b.batch_exists(keys) == 1
    assert b.batch_get_v1(keys[:3], slots(40, 3)) == [True, False, True]


def test_mha_tp_and_pp_ranks_use_distinct_keys(master, backends):
    keys = page_keys(3, "tp")
    made = {}
    for rank in ((0, 2, 0, 1), (1, 2, 0, 1), (0, 2, 1, 2)):
        host = make_host("page_first")
        b = make_backend(master, host, tp_rank=rank[0], tp_size=rank[1], pp_rank=rank[2],
                         pp_size=rank[3])
        backends.append(b)
        assert b.batch_set_v1(keys, slots(1, 3)) == [True] * 3
        made[rank] = (b, host, [page(host, 1 + i) for i in range(3)])
    all_keys = [k for b, _, _ in made.values() for k in b.object_keys(keys)]
    assert len(set(all_keys)) == len(all_keys) == 9
    for b, host, want in made.values():  # each rank reads its own shard back
        clear_pages(host, 50, 3)
        assert b.batch_get_v1(keys, slots(50, 3)) == [True] * 3
        for i in range(3):
            assert torch.equal(page(host, 50 + i), want[i])
    assert "/tp1of2/" in made[(1, 2, 0, 1)][0].object_keys(keys)[0]
    assert "/tp0of2-pp1of2/" in made[(0, 2, 1, 2)][0].object_keys(keys)[0]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_mla_pages_are_written_by_rank_0_and_read_by_every_rank(master, backends, cluster,
                                                                 layout):
    keys = page_keys(5, "mla" + layout)
    h0, h1 = make_host(layout, mla=True), make_host(layout, mla=True)
    b0 = make_backend(master, h0, mla=True, tp_rank=0, tp_size=2)
    b1 = make_backend(master, h1, mla=True, tp_rank=1, tp_size=2)
    backends += [b0, b1]
    assert b0.storage_config.is_storage_writer and not b1.storage_config.is_storage_writer
    assert b0.object_keys(keys) == b1.object_keys(keys)  # one copy for every rank
    # A non-writer writes nothing; it reports which pages the store has.
    assert b1.batch_set_v1(keys, slots(1, 5)) == [False] * 5
    assert cluster.status()["objects"] == 0
    want = [page(h0, 1 + i) for i in range(5)]
    assert b0.batch_set_v1(keys, slots(1, 5)) == [True] * 5
    assert b1.batch_exists(keys) == 5
    assert b1.batch_set_v1(keys, slots(1, 5)) == [True] * 5
    assert b1.batch_get_v1(keys, slots(60, 5)) == [True] * 5
    for i in range(5):
        assert torch.equal(page(h1, 60 + i), want[i])


# -- the generic interface -----------------------------------------------------------------
@pytest.mark.parametrize("layout,mla", [(lay, False) for lay in LAYOUTS] + [("layer_first", True)])
def test_generic_interface_round_trip(master, backends, layout, mla):
    """What the controller does without interface_v1: batch_set of get_data_page(...) tensors,
    batch_get into get_dummy_flat_data_page() tensors, then set_from_flat_data_page."""
    cfg = {k: v for k, v in master.items() if k != "interface_v1"}
    host = make_host(layout, mla=mla)
    b = make_backend(cfg, host, mla=mla)
    backends.append(b)
    keys = page_keys(4, "generic" + layout)
    want = [page(host, 1 + i) for i in range(4)]
    assert b.batch_exists(keys) == 0 and b.get(keys[0], host.get_dummy_flat_data_page()) is None
    assert b.batch_set(keys, [host.get_data_page((1 + i) * PAGE) for i in range(4)])
    assert b.batch_exists(keys) == 4 and b.exists(keys[3])
    got = b.batch_get(keys, [host.get_dummy_flat_data_page() for _ in keys])
    assert all(g is not None for g in got)
    for i, g in enumerate(got):
        host.set_from_flat_data_page((70 + i) * PAGE, g)
        assert torch.equal(page(host, 70 + i), want[i])
    raw = b.get(keys[0])  # no target: the bytes
    assert raw.dtype == torch.uint8 and torch.equal(raw.view(want[0].dtype), want[0])
    assert b.set(keys[0], want[0])  # again: fine, not rewritten
    assert b.clear() and b.batch_exists(keys) == 0


# -- settings --------------------------------------------------------------------------------
BAD = [
    ({"mastr": "127.0.0.1:1"}, "'mastr'"),
    ({"replica_num": "2"}, "replica_num"),
    ({"replica_num": 0}, "replica_num"),
    ({"replica_num": True}, "replica_num"),
    ({"master": "no-port"}, "master"),
    ({"embedded": {"nodez": 1}}, "'nodez'"),
    ({"embedded": {"dram_bytes_per_node": "lots"}}, "embedded.dram_bytes_per_node"),
    ({"embedded": 3}, "embedded"),
    ({"progress_timeout_ms": 1.5}, "progress_timeout_ms"),
    ({"log_stats_interval_s": -1}, "log_stats_interval_s"),
    ({"namespace": "a/b"}, "namespace"),
    ({"verify_checksums": "yes"}, "verify_checksums"),
]


@pytest.mark.parametrize("extra,named", BAD, ids=[n.strip("'") for _, n in BAD])
def test_bad_extra_config_is_a_named_error(cluster, extra, named):
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    cfg = {**BASE, **extra}
    if "master" not in cfg and "embedded" not in cfg:
        cfg["master"] = cluster.master_address
    with pytest.raises(ValueError) as e:
        StorageBackendFactory.create_backend("dynamic", make_config(cfg), None)
    assert named in str(e.value)
    if "unknown" in str(e.value):
        assert "accepted keys" in str(e.value)


def test_settings_defaults_and_contradictions(cluster, backends):
    from kvbridge.integrations.sglang import parse_settings

    s = parse_settings({**BASE, "master": "h:1", "prefetch_threshold": 8, "tp_lcm_size": 2,
                        "embedded": None})
    assert (s["replica_num"], s["namespace"], s["rpc_timeout_ms"]) == (1, "sglang", None)
    e = parse_settings({"embedded": {"dram_bytes_per_node": "512MiB"}})["embedded"]
    assert e == {"nodes": 1, "dram_bytes_per_node": 512 << 20, "ssd_dir": "",
                 "ssd_bytes_per_node": 1 << 30}
    with pytest.raises(ValueError, match="both 'master' and 'embedded'"):
        parse_settings({"master": "h:1", "embedded": True})
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    with pytest.raises(ValueError, match="needs 'master'"):
        StorageBackendFactory.create_backend("dynamic", make_config(BASE), None)
    with pytest.raises(ValueError, match="MLA"):
        StorageBackendFactory.create_backend(
            "dynamic", make_config({**BASE, "embedded": True}, mla=True, tp_size=2), None)


def test_embedded_cluster_round_trip_and_close(backends):
    host = make_host("page_first")
    b = make_backend({**BASE, "embedded": {"nodes": 1, "dram_bytes_per_node": "32MiB"}}, host)
    keys = page_keys(3, "embedded")
    want = [page(host, 1 + i) for i in range(3)]
    assert b.batch_set_v1(keys, slots(1, 3)) == [True] * 3
    assert b.batch_get_v1(keys, slots(80, 3)) == [True] * 3
    assert all(torch.equal(page(host, 80 + i), want[i]) for i in range(3))
    b.close()
    b.close()  # idempotent
    assert b.batch_get_v1(keys, slots(80, 3)) == [False] * 3
    assert b.batch_exists(keys) == 0 and b.batch_set_v1(keys, slots(1, 3)) == [False] * 3


def test_get_stats_is_what_sglang_collects(master, backends):
    from sglang.srt.observability.metrics_collector import StorageMetrics

    host = make_host("page_first")
    b = make_backend(master, host)
    backends.append(b)
    keys = page_keys(4, "stats")
    b.batch_set_v1(keys, slots(1, 4))
    b.batch_get_v1(keys + page_keys(1, "absent"), slots(10, 5))
    m = b.get_stats()
    assert isinstance(m, StorageMetrics)
    assert m.backup_pgs == [4] and m.prefetch_pgs == [4]
    assert len(m.prefetch_bandwidth) == 1 and m.prefetch_bandwidth[0] > 0
    assert m.kvbridge["get_miss_pages"] == 1 and m.kvbridge["get_hit_pages"] == 4
    hits, misses = m.kvbridge["store_client_get_hits"], m.kvbridge["store_client_get_misses"]
    assert hits == 4 * misses and m.kvbridge["store_client_hit_rate"] == pytest.approx(0.8)
    assert b.get_stats().prefetch_pgs == []  # drained, as SGLang's collector expects
    try:
        from sglang.srt.observability.metrics_collector import StorageMetricsCollector
        StorageMetricsCollector(labels={"storage_backend": "kvbridge"}).log_storage_metrics(m)
    except ImportError:  # prometheus_client missing: the isinstance check above is SGLang's
        pass


# -- failures --------------------------------------------------------------------------------
def test_sglang_failure_injector_never_yields_wrong_bytes(master, backends, monkeypatch):
    """SGLang's own HiCacheStorageFailureInjector (SGLANG_TEST_HICACHE_BACKEND_RANDOM_*) wraps
    the backend: calls fail at random, and what is reported read must be the right bytes."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageFailureInjector

    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", "0.4")
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY", "0.005")
    host = make_host("page_first_direct")
    b = make_backend(master, host)
    backends.append(b)
    assert isinstance(b, HiCacheStorageFailureInjector)
    keys = page_keys(24, "inject")
    want = [page(host, 1 + i) for i in range(24)]
    outcomes = {"set_failed": 0, "get_failed": 0, "get_ok": 0}
    for r in range(24):  # one page per round, each one set until it is stored
        for _ in range(50):
            if all(b.batch_set_v1([keys[r]], slots(1 + r, 1))):
                break
            outcomes["set_failed"] += 1
        else:
            pytest.fail(f"page {r} not stored in 50 tries")
    for r in range(40):
        n = 1 + r % 8
        first = (r * 5) % (24 - n)
        clear_pages(host, 100, n)
        got = b.batch_get_v1(keys[first:first + n], slots(100, n))
        if got == [False] * n:
            outcomes["get_failed"] += 1
            continue
        assert got == [True] * n
        outcomes["get_ok"] += 1
        for i in range(n):
            assert torch.equal(page(host, 100 + i), want[first + i])
        hit = b.batch_exists(keys)
        assert hit in (0, 24)  # the injector's failure is 0; otherwise all of them
    assert outcomes["set_failed"] > 0 and outcomes["get_failed"] > 0 and outcomes["get_ok"] > 0
    assert b._backend.stats()["errors"] == 0  # the injector fails calls, never the store


@pytest.fixture
def daemons(tmp_path):
    with harness.KvbridgeDaemons(tmp_path, nodes=1, dram_bytes="64M", node_ttl_ms=3000) as d:
        yield d


FAST = {"progress_timeout_ms": 1000, "rpc_timeout_ms": 1500, "transfer_deadline_ms": 3000}


def _timed(fn, *args):
    t0 = time.monotonic()
    out = fn(*args)
    return out, time.monotonic() - t0


def figure(name: str, **values) -> None:
    """One JSON line of measured figures (shown with pytest -s; docs/sglang.md quotes them)."""
    print(json.dumps({"figure": name, **{k: round(v, 4) if isinstance(v, float) else v
                                         for k, v in values.items()}}))


def test_killed_storage_node_costs_a_miss_within_a_bound(daemons, backends):
    host = make_host("page_first")
    b = make_backend({**BASE, "master": daemons.address, "replica_num": 1, **FAST}, host)
    backends.append(b)
    keys = page_keys(16, "killed")
    want = [page(host, 1 + i) for i in range(16)]
    assert b.batch_set_v1(keys, slots(1, 16)) == [True] * 16
    daemons.nodes[0].kill()  # SIGKILL, the whole process group
    got, took = _timed(b.batch_get_v1, keys, slots(100, 16))
    assert got == [False] * 16 and took < 3.0, (got, took)
    figure("killed_node_get_16_pages", seconds=took)
    # Until the master finds the node dead (its TTL) the pages still look present; a get of
    # them is a miss each time, never an exception.
    t_end = time.monotonic() + 6
    while b.batch_exists(keys) and time.monotonic() < t_end:
        got, took = _timed(b.batch_get_v1, keys[:4], slots(100, 4))
        assert got == [False] * 4 and took < 3.0
        time.sleep(0.3)
    assert b.batch_exists(keys) == 0
    got, took = _timed(b.batch_set_v1, keys, slots(1, 16))  # no node left
    assert got == [False] * 16 and took < 3.0
    figure("no_node_set_16_pages", seconds=took)
    assert b.stats()["errors"] > 0
    # A new node: writes and reads work again, with the right bytes.
    daemons.add_node("node-b", "64M")
    assert b.batch_set_v1(keys, slots(1, 16)) == [True] * 16
    clear_pages(host, 100, 16)
    assert b.batch_get_v1(keys, slots(100, 16)) == [True] * 16
    assert all(torch.equal(page(host, 100 + i), want[i]) for i in range(16))


def test_frozen_storage_node_costs_a_miss_within_a_bound(daemons, backends):
    host = make_host("layer_first")
    b = make_backend({**BASE, "master": daemons.address, "replica_num": 1, **FAST}, host)
    backends.append(b)
    keys = page_keys(8, "frozen")
    want = [page(host, 1 + i) for i in range(8)]
    assert b.batch_set_v1(keys, slots(1, 8)) == [True] * 8
    node = daemons.nodes[0]
    node.signal_group(signal.SIGSTOP)
    try:
        clear_pages(host, 100, 8)
        got, took = _timed(b.batch_get_v1, keys, slots(100, 8))
        assert got == [False] * 8, got
        assert took < 1.0 + 1.5, took  # the progress timeout, plus slack for this machine
        figure("frozen_node_get_8_pages", seconds=took, progress_timeout_ms=1000)
        got, took = _timed(b.batch_set_v1, page_keys(2, "frozen-new"), slots(20, 2))
        assert got == [False] * 2 and took < 3.0 + 1.5, (got, took)
        figure("frozen_node_set_2_pages", seconds=took)
        # A client that never talked to the node: its handshake times out instead.
        fresh = make_backend({**BASE, "master": daemons.address, **FAST}, make_host("layer_first"))
        backends.append(fresh)
        got, took = _timed(fresh.batch_get_v1, keys, slots(100, 8))
        assert got == [False] * 8 and took < 1.0 + 1.5, (got, took)
        figure("frozen_node_get_8_pages_new_client", seconds=took)
    finally:
        node.signal_group(signal.SIGCONT)
    # Back within its TTL: nothing was lost, the pages read back right.
    t_end = time.monotonic() + 5
    while True:
        clear_pages(host, 100, 8)
        if b.batch_get_v1(keys, slots(100, 8)) == [True] * 8 or time.monotonic() > t_end:
            break
        time.sleep(0.2)
    assert all(torch.equal(page(host, 100 + i), want[i]) for i in range(8))


def test_dead_master_costs_a_miss_within_a_bound(daemons, backends):
    """With the master killed, the pages this backend stored are still found and read from the
    nodes (docs/store.md "Reads while the master is away"); new pages and pages it never saw
    are misses; every call ends within the call deadline."""
    host = make_host("page_first")
    b = make_backend({**BASE, "master": daemons.address, **FAST}, host)
    backends.append(b)
    keys = page_keys(4, "master")
    assert b.batch_set_v1(keys, slots(1, 4)) == [True] * 4
    want = [page(host, 1 + i) for i in range(4)]
    never = page_keys(2, "never-stored")
    daemons.master.kill()
    clear_pages(host, 100, 4)
    for fn, args, expect in ((b.batch_exists, (keys,), 4),
                             (b.batch_get_v1, (keys, slots(100, 4)), [True] * 4),
                             (b.batch_set_v1, (page_keys(2, "m2"), slots(9, 2)), [False] * 2),
                             (b.exists, (keys[0],), True), (b.exists, (never[0],), False),
                             (b.batch_exists, (never,), 0),
                             # get() reads the page's flat object, which batch_set_v1 did not
                             # write: never stored in that form, so a miss
                             (b.get, (keys[0],), None)):
        got, took = _timed(fn, *args)
        assert got == expect and took < 1.5 + 1.5, (fn.__name__, got, took)
        figure(f"dead_master_{fn.__name__}", seconds=took, rpc_timeout_ms=1500)
    assert all(torch.equal(page(host, 100 + i), want[i]) for i in range(4))


def test_master_unreachable_at_start_is_not_an_error_and_costs_misses(backends):
    host = make_host("page_first")
    port = harness.free_port()  # nothing listens there
    b, took = _timed(make_backend, {**BASE, "master": f"127.0.0.1:{port}", **FAST}, host)
    backends.append(b)
    keys = page_keys(3, "nomaster")
    assert b.batch_exists(keys) == 0
    assert b.batch_set_v1(keys, slots(1, 3)) == [False] * 3
    assert b.batch_get_v1(keys, slots(5, 3)) == [False] * 3
    assert b.stats()["errors"] == 3 and "master" in b.stats()["last_error"]


def test_128_page_batches_of_a_realistic_page_size(daemons, backends):
    """SGLang's batch (128 pages) of 16-token pages of an 8-layer, 8-head, 128-dim bf16 model
    (512 KiB per page, K and V): both ways through a node process, bytes checked."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    page_tokens, n = 16, 128
    dev = MHATokenToKVPool(2048, page_tokens, torch.bfloat16, 8, 128, 8, "cpu", False)
    with host_budget():
        host = MHATokenToKVPoolHost(dev.get_device_pool_infos()[0].buffer_info, 2, 0,
                                    page_tokens, "page_first", pin_memory=False,
                                    device_capacity_tokens=2048, start_layer=0, end_layer=8)
    host.kv_buffer.copy_(torch.randn(host.kv_buffer.shape))
    daemons.add_node("node-big", "512M")
    b = make_backend({**BASE, "master": daemons.address}, host)
    backends.append(b)
    keys = page_keys(n, "big")
    src = torch.arange(page_tokens, (n + 1) * page_tokens)
    dst = torch.arange((n + 1) * page_tokens, (2 * n + 1) * page_tokens)  # the pool's end
    assert dst[-1] < host.size
    got, put_s = _timed(b.batch_set_v1, keys, src)
    assert got == [True] * n
    host.kv_buffer[:, (n + 1) * page_tokens:].zero_()
    got, get_s = _timed(b.batch_get_v1, keys, dst)
    assert got == [True] * n
    assert torch.equal(host.kv_buffer[:, src], host.kv_buffer[:, dst])
    _, exists_s = _timed(b.batch_exists, keys)
    mib = n * b.page_bytes / (1 << 20)
    figure("batch_128_pages", page_kib=b.page_bytes // 1024, mib=mib, put_s=put_s, get_s=get_s,
           exists_s=exists_s, put_gb_s=mib / 1024 / put_s, get_gb_s=mib / 1024 / get_s)
