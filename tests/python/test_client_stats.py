"""A store client's statistics (StoreClient.stats()) and their Prometheus endpoint
(kvbridge.metrics), against an embedded cluster: a real master and storage nodes in this
process (docs/python.md "Client statistics and metrics", docs/client-metrics.md)."""

from __future__ import annotations

import importlib.util
import math
import socket
import sys
import time
import urllib.request

import pytest

import kvbridge
from kvbridge import errors

PAGE = 4096


def _pages(n: int) -> list[bytearray]:
    return [bytearray([i % 251]) * PAGE for i in range(n)]


def _op(s: dict, op: str) -> dict:
    return s["ops"][op]


def _check_latency(o: dict) -> None:
    """The histogram of one op is consistent: cumulative, ending at +inf with every call."""
    counts = [n for _, n in o["seconds_buckets"]]
    assert counts == sorted(counts)
    assert math.isinf(o["seconds_buckets"][-1][0]) and counts[-1] == o["calls"]
    assert (o["seconds_sum"] > 0) == (o["calls"] > 0)


def test_counts_follow_puts_gets_misses_and_removes(cluster):
    store = cluster.client()
    s = store.stats()
    assert s["get_hits"] == s["get_misses"] == s["puts_stored"] == s["removes"] == 0
    assert s["hit_rate"] == 0.0
    assert all(o["calls"] == 0 and o["errors"] == {} for o in s["ops"].values())

    pages = _pages(8)
    for p in pages:
        store.register_buffer(p)
    keys = [f"stats/{i}" for i in range(8)]
    assert all(st.ok for st in store.batch_put_from(keys, pages))  # one call, 8 keys
    store.put("stats/single", b"x" * 100)  # one more call through the staging area
    assert all(st.ok for st in store.batch_put_from(keys[:3], pages[:3]))  # stored already
    s = store.stats()
    assert s["puts_stored"] == 9 and s["puts_existing"] == 3
    assert s["bytes_written"] == 8 * PAGE + 100
    assert _op(s, "put")["calls"] == 3 and _op(s, "put")["keys"] == 12

    # 8 hits and 2 misses in one batch, one hit and one miss alone.
    out = _pages(10)
    for p in out:
        store.register_buffer(p)
    got = store.batch_get_into(keys + ["stats/absent1", "stats/absent2"], out)
    assert [r.ok for r in got] == [True] * 8 + [False] * 2
    assert store.get("stats/single") == b"x" * 100
    with pytest.raises(errors.NotFoundError):
        store.get("stats/absent3")
    s = store.stats()
    assert s["get_hits"] == 9 and s["get_misses"] == 3
    assert s["get_hits_dram"] == 9 and s["get_hits_ssd"] == 0
    assert s["bytes_read"] == 8 * PAGE + 100
    assert s["hit_rate"] == pytest.approx(9 / 12)
    assert _op(s, "get")["calls"] == 3 and _op(s, "get")["keys"] == 12
    assert _op(s, "get")["errors"] == {}  # misses are not errors

    assert store.batch_exists(keys[:4] + ["stats/absent1"]) == [True] * 4 + [False]
    assert store.remove("stats/0") and not store.remove("stats/absent1")
    assert [st.ok for st in store.batch_remove(keys[1:4])] == [True] * 3
    s = store.stats()
    assert _op(s, "exists")["calls"] == 1 and _op(s, "exists")["keys"] == 5
    assert s["removes"] == 4
    assert _op(s, "remove")["calls"] == 3 and _op(s, "remove")["keys"] == 5
    assert _op(s, "remove")["errors"] == {"NOT_FOUND": 1}
    for o in s["ops"].values():
        _check_latency(o)

    store.reset_stats()
    s = store.stats()
    assert s["get_hits"] == s["puts_stored"] == s["bytes_read"] == 0
    assert all(o["calls"] == 0 and o["seconds_sum"] == 0 for o in s["ops"].values())


def test_failed_keys_count_as_errors_by_code(cluster):
    store = cluster.client()
    registered, unregistered = bytearray(PAGE), bytearray(PAGE)
    store.register_buffer(registered)
    st = store.batch_put_from(["err/a", "err/b"], [registered, unregistered])
    assert st[0].ok and st[1].name == "NOT_REGISTERED"
    small = bytearray(16)
    store.register_buffer(small)
    got = store.batch_get_into(["err/a"], [small])  # buffers smaller than the object
    assert got[0].status.name == "INVALID_ARGUMENT"
    with pytest.raises(errors.InvalidArgumentError, match="staging area"):
        store.put("err/huge", bytes((64 << 20) + 1))  # refused before it reaches the master
    s = store.stats()
    assert _op(s, "put")["errors"] == {"NOT_REGISTERED": 1, "INVALID_ARGUMENT": 1}
    assert _op(s, "put")["calls"] == 2 and s["puts_stored"] == 1
    assert _op(s, "get")["errors"] == {"INVALID_ARGUMENT": 1}
    assert s["get_hits"] == s["get_misses"] == 0 and s["hit_rate"] == 0.0


def test_hits_by_tier(tmp_path):
    """Objects demoted to the SSD tier count as SSD hits, the others as DRAM hits."""
    try:
        cluster = kvbridge.Cluster(nodes=2, dram_bytes_per_node=8 << 20, ssd_dir=str(tmp_path),
                                   ssd_bytes_per_node=64 << 20, promote_after_reads=0,
                                   demote_high_watermark=0.3, demote_low_watermark=0.2)
    except errors.UnavailableError as e:
        if "ssd" in str(e):
            pytest.skip(f"the ssd storage plugin is not available: {e}")
        raise
    with cluster:
        store = cluster.client()
        n, size = 64, 128 * 1024
        pages = [bytearray([i]) * size for i in range(n)]
        for p in pages:
            store.register_buffer(p)
        keys = [f"tier/{i}" for i in range(n)]
        for first in range(0, n, 8):
            assert all(st.ok for st in store.batch_put_from(keys[first:first + 8],
                                                            pages[first:first + 8]))
            time.sleep(0.3)  # demotion keeps up at this pace
        # Demotion stops below its low watermark; wait until the tiers hold still.
        last, deadline = -1, time.monotonic() + 15
        while time.monotonic() < deadline:
            now = cluster.status()["ssd_replicas"]
            if now > 0 and now == last:
                break
            last = now
            time.sleep(0.5)
        # Demotion may still move a few meanwhile (nothing is promoted: promote_after_reads
        # 0), so the SSD hits lie between the SSD replicas before and after the get.
        def on_ssd() -> int:
            return [r.replicas[0].tier for r in store.batch_replicas(keys)].count("SSD")

        before = on_ssd()
        assert 0 < before < n
        store.reset_stats()
        out = [bytearray(size) for _ in range(n)]
        for p in out:
            store.register_buffer(p)
        assert all(r.ok for r in store.batch_get_into(keys, out))
        after = on_ssd()
        s = store.stats()
        assert s["get_hits"] == n and s["bytes_read"] == n * size
        assert before <= s["get_hits_ssd"] <= after
        assert s["get_hits_dram"] == n - s["get_hits_ssd"] > 0


# -- the Prometheus endpoint -----------------------------------------------------------------
needs_prometheus = pytest.mark.skipif(
    importlib.util.find_spec("prometheus_client") is None,
    reason="prometheus_client is not installed (scripts/setup_venv.sh installs it)")


def _scrape(port: int) -> dict:
    """{(name, labels as a sorted tuple): value} of every sample on the endpoint."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def _busy_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    return s


@needs_prometheus
def test_scrape_equals_stats(cluster):
    import kvbridge.metrics

    store = cluster.client()
    port = kvbridge.metrics.serve(store, "127.0.0.1:0")
    assert port > 0
    page = bytearray(PAGE)
    store.register_buffer(page)
    assert store.batch_put_from(["m/1", "m/2"], [page, page])[0].ok
    assert store.get_into("m/1", page) == PAGE
    with pytest.raises(errors.NotFoundError):
        store.get("m/absent")
    store.remove("m/absent")
    got = _scrape(port)
    s = store.stats()
    c = "kvbridge_client_"
    assert got[(c + "gets_total", (("result", "hit"),))] == s["get_hits"] == 1
    assert got[(c + "gets_total", (("result", "miss"),))] == s["get_misses"] == 1
    assert got[(c + "get_hits_total", (("tier", "dram"),))] == s["get_hits_dram"]
    assert got[(c + "get_hits_total", (("tier", "ssd"),))] == s["get_hits_ssd"]
    assert got[(c + "puts_total", (("result", "stored"),))] == s["puts_stored"] == 2
    assert got[(c + "bytes_total", (("direction", "read"),))] == s["bytes_read"] == PAGE
    assert got[(c + "bytes_total", (("direction", "write"),))] == s["bytes_written"] == 2 * PAGE
    assert got[(c + "removes_total", ())] == s["removes"] == 0
    assert got[(c + "errors_total", (("code", "NOT_FOUND"), ("op", "remove")))] == 1
    for op, o in s["ops"].items():
        assert got[(c + "op_seconds_count", (("op", op),))] == o["calls"]
        assert got[(c + "op_seconds_sum", (("op", op),))] == pytest.approx(o["seconds_sum"])
        assert got[(c + "keys_total", (("op", op),))] == o["keys"]
        for le, n in o["seconds_buckets"]:
            bound = "+Inf" if math.isinf(le) else repr(float(le))
            assert got[(c + "op_seconds_bucket", (("le", bound), ("op", op)))] == n
    assert s["ops"]["get"]["calls"] == 2 and s["ops"]["put"]["calls"] == 1
    store.close()  # the cluster's client: stops the endpoint
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


@needs_prometheus
def test_metrics_listen_option_and_environment(cluster, monkeypatch):
    store = kvbridge.StoreClient(master=cluster.master_address, metrics_listen="127.0.0.1:0")
    try:
        assert store.metrics_port and (
            ("kvbridge_client_gets_total", (("result", "hit"),)) in _scrape(store.metrics_port))
    finally:
        store.close()
    monkeypatch.setenv("KVBRIDGE_CLIENT_METRICS_LISTEN", "127.0.0.1:0")
    with kvbridge.StoreClient(master=cluster.master_address) as store:
        assert store.metrics_port and _scrape(store.metrics_port)
    monkeypatch.setenv("KVBRIDGE_CLIENT_METRICS_LISTEN", "")
    with kvbridge.StoreClient(master=cluster.master_address) as store:
        assert store.metrics_port is None


@needs_prometheus
def test_clients_on_one_address_share_the_endpoint(cluster):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    a = kvbridge.StoreClient(master=cluster.master_address, metrics_listen=f"127.0.0.1:{port}")
    b = kvbridge.StoreClient(master=cluster.master_address, metrics_listen=f"127.0.0.1:{port}")
    try:
        assert a.metrics_port == b.metrics_port == port
        a.put("share/a", b"a")
        b.put("share/b", b"b")
        got = _scrape(port)
        assert got[("kvbridge_client_puts_total", (("result", "stored"),))] == 2
        a.close()
        got = _scrape(port)  # b alone now
        assert got[("kvbridge_client_puts_total", (("result", "stored"),))] == 1
    finally:
        a.close()
        b.close()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


@needs_prometheus
def test_collector_in_a_registry_of_ones_own(cluster):
    """StoreCollector for an application that serves its own registry; with two clients,
    their sums."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    import kvbridge.metrics

    a = cluster.client()
    with kvbridge.StoreClient(master=cluster.master_address) as b:
        registry = CollectorRegistry()
        registry.register(kvbridge.metrics.StoreCollector(a, b))
        a.put("own/a", b"a" * 10)
        b.put("own/b", b"b" * 20)
        assert b.get("own/a") == b"a" * 10
        samples = {(x.name, tuple(sorted(x.labels.items()))): x.value
                   for f in text_string_to_metric_families(generate_latest(registry).decode())
                   for x in f.samples}
        assert samples[("kvbridge_client_bytes_total", (("direction", "write"),))] == 30
        assert samples[("kvbridge_client_bytes_total", (("direction", "read"),))] == 10
        assert samples[("kvbridge_client_op_seconds_count", (("op", "put"),))] == 2
        merged = kvbridge.metrics._sum_stats([a.stats(), b.stats()])
        assert merged["hit_rate"] == 1.0 and merged["puts_stored"] == 2


@pytest.mark.parametrize("listen", ["nohost:notaport", "127.0.0.1", ":9464", "h:70000"])
def test_bad_metrics_listen_is_named(cluster, listen):
    with pytest.raises(errors.InvalidArgumentError, match=f"metrics_listen '{listen}'"):
        kvbridge.StoreClient(master=cluster.master_address, metrics_listen=listen)


def test_bad_environment_value_names_the_variable(cluster, monkeypatch):
    monkeypatch.setenv("KVBRIDGE_CLIENT_METRICS_LISTEN", "nohost:notaport")
    with pytest.raises(errors.InvalidArgumentError,
                       match="KVBRIDGE_CLIENT_METRICS_LISTEN 'nohost:notaport'"):
        kvbridge.StoreClient(master=cluster.master_address)


@needs_prometheus
def test_busy_port_is_a_clear_error(cluster):
    with _busy_port() as s:
        listen = f"127.0.0.1:{s.getsockname()[1]}"
        with pytest.raises(errors.UnavailableError,
                           match=f"metrics_listen '{listen}': cannot serve client metrics there"):
            kvbridge.StoreClient(master=cluster.master_address, metrics_listen=listen)


def test_without_prometheus_client_the_error_names_it(cluster, monkeypatch):
    import kvbridge.metrics

    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # as if not installed
    with pytest.raises(ImportError, match="prometheus_client"):
        kvbridge.metrics.serve(cluster.client(), "127.0.0.1:0")
    with pytest.raises(ImportError, match="pip install prometheus_client"):
        kvbridge.StoreClient(master=cluster.master_address, metrics_listen="127.0.0.1:0")
