"""A store client's statistics on a Prometheus ``/metrics`` endpoint (opt-in).

    import kvbridge, kvbridge.metrics
    store = kvbridge.StoreClient(master="10.0.0.1:50051", metrics_listen="0.0.0.0:9464")
    # or, for a client made without it:
    port = kvbridge.metrics.serve(store, "127.0.0.1:0")   # port 0 picks one; returns it

The values are read from :meth:`StoreClient.stats` at scrape time by a collector
(:class:`StoreCollector`): nothing is counted twice and a client that nobody scrapes pays only
its own counters. Names, labels and meanings: docs/client-metrics.md. Clients of one process
asked to serve the same ``HOST:PORT`` share that endpoint, which then shows their sums.

Needs the ``prometheus_client`` package (``pip install 'kvbridge[metrics]'``); ``import
kvbridge`` does not, and without it serving fails naming the package. For a registry of your
own, register ``StoreCollector(store)`` there instead of serving.
"""

from __future__ import annotations

import math
import threading
from typing import Any, Iterator

from kvbridge.errors import InvalidArgumentError, KvbError, UnavailableError

ENV = "KVBRIDGE_CLIENT_METRICS_LISTEN"
_PREFIX = "kvbridge_client"


def _prometheus() -> Any:
    try:
        import prometheus_client
    except ImportError as e:
        raise ImportError(
            "kvbridge client metrics need the prometheus_client package, which is not "
            "installed: pip install prometheus_client (or pip install 'kvbridge[metrics]')",
            name="prometheus_client") from e
    return prometheus_client


def parse_listen(listen: str, what: str = "metrics_listen") -> tuple[str, int]:
    """(host, port) of ``"HOST:PORT"`` (``"[::1]:9464"`` for IPv6; port 0 picks one);
    InvalidArgumentError naming the value otherwise."""
    host, sep, port = str(listen).rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise InvalidArgumentError(
            f"{what} {listen!r}: expected HOST:PORT (e.g. 127.0.0.1:9464; port 0 picks one)")
    return host, int(port)


def _sum_stats(all_stats: list[dict]) -> dict:
    """The sum of several clients' stats() (their buckets have the same bounds)."""
    out = all_stats[0]
    for s in all_stats[1:]:
        for k, v in s.items():
            if k in ("ops", "hit_rate"):
                continue
            out[k] += v
        for op, o in s["ops"].items():
            mine = out["ops"][op]
            for k in ("calls", "keys", "seconds_sum"):
                mine[k] += o[k]
            for code, n in o["errors"].items():
                mine["errors"][code] = mine["errors"].get(code, 0) + n
            mine["seconds_buckets"] = [(le, a + b) for (le, a), (_, b) in
                                       zip(mine["seconds_buckets"], o["seconds_buckets"])]
    asked = out["ops"]["get"]["keys"]
    out["hit_rate"] = out["get_hits"] / asked if asked else 0.0
    return out


class StoreCollector:
    """A prometheus_client collector of store clients' stats(), read at each scrape; with
    several clients, their sums. Clients that are closed are left out."""

    def __init__(self, *stores: Any):
        self._lock = threading.Lock()
        self._stores = list(stores)

    def add(self, store: Any) -> None:
        with self._lock:
            if store not in self._stores:
                self._stores.append(store)

    def remove(self, store: Any) -> bool:
        """Leaves `store` out; True when no client is left."""
        with self._lock:
            if store in self._stores:
                self._stores.remove(store)
            return not self._stores

    def _stats(self) -> list[dict]:
        with self._lock:
            stores = list(self._stores)
        out = []
        for s in stores:
            try:
                out.append(s.stats())
            except KvbError:  # closed meanwhile
                continue
        return out

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

        got = self._stats()
        if not got:
            return
        s = _sum_stats(got)

        def counter(name: str, doc: str, labels: tuple = ()) -> Any:
            return CounterMetricFamily(f"{_PREFIX}_{name}", doc, labels=list(labels))

        gets = counter("gets", "Keys gets asked for, by outcome: hit (read and verified), miss "
                       "(not in the store); failures are in errors_total", ("result",))
        gets.add_metric(["hit"], s["get_hits"])
        gets.add_metric(["miss"], s["get_misses"])
        yield gets
        hits = counter("get_hits", "Keys gets read, by the tier of the replica that served them",
                       ("tier",))
        hits.add_metric(["dram"], s["get_hits_dram"])
        hits.add_metric(["ssd"], s["get_hits_ssd"])
        yield hits
        puts = counter("puts", "Keys puts succeeded on, by outcome: stored (written), existing "
                       "(stored already, not rewritten)", ("result",))
        puts.add_metric(["stored"], s["puts_stored"])
        puts.add_metric(["existing"], s["puts_existing"])
        yield puts
        removes = counter("removes", "Keys removed")
        removes.add_metric([], s["removes"])
        yield removes
        away = counter("gets_without_master", "Keys gets read and verified without the master "
                       "(it was away: remembered replicas their nodes confirmed); also in "
                       "get_hits_total")
        away.add_metric([], s["gets_without_master"])
        yield away
        moved = counter("bytes", "Object bytes gets returned (read) and puts stored (write, once "
                        "per key whatever the replica count)", ("direction",))
        moved.add_metric(["read"], s["bytes_read"])
        moved.add_metric(["write"], s["bytes_written"])
        yield moved
        keys = counter("keys", "Keys the calls carried, by call", ("op",))
        errors = counter("errors", "Keys that failed, by call and status code (a get's NOT_FOUND "
                         "is a miss, not an error)", ("op", "code"))
        latency = HistogramMetricFamily(f"{_PREFIX}_op_seconds", "Wall time of the calls, by call "
                                        "(a batch is one call)", labels=["op"])
        for op, o in s["ops"].items():
            keys.add_metric([op], o["keys"])
            for code, n in sorted(o["errors"].items()):
                errors.add_metric([op, code], n)
            buckets = [("+Inf" if math.isinf(le) else repr(float(le)), n)
                       for le, n in o["seconds_buckets"]]
            latency.add_metric([op], buckets, o["seconds_sum"])
        yield keys
        yield errors
        yield latency


class _Server:
    def __init__(self, httpd: Any, thread: Any, collector: StoreCollector, key: tuple):
        self.httpd, self.thread, self.collector, self.key = httpd, thread, collector, key

    @property
    def port(self) -> int:
        return self.httpd.server_address[1]

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


_servers_lock = threading.Lock()
_servers: dict[tuple, _Server] = {}  # (host, port asked for) -> its server; port 0 never shared
_served: dict[int, _Server] = {}  # id(store) -> the server it is on


def serve(store: Any, listen: str, what: str = "metrics_listen") -> int:
    """Serves `store`'s stats on ``http://HOST:PORT/metrics`` from a thread of this process
    and returns the port (the one bound, for port 0). A ``HOST:PORT`` this process already
    serves adds `store` to that endpoint (the values are then the clients' sums). The server
    stops when its last client closes. InvalidArgumentError for a malformed `listen`,
    UnavailableError (naming it) when it cannot be listened on, ImportError without
    prometheus_client."""
    host, port = parse_listen(listen, what)
    prom = _prometheus()
    with _servers_lock:
        if id(store) in _served:
            raise InvalidArgumentError(f"{what} {listen!r}: this client is already served on "
                                       f"port {_served[id(store)].port}")
        key = (host, port)
        server = _servers.get(key) if port != 0 else None
        if server is None:
            collector = StoreCollector(store)
            registry = prom.CollectorRegistry(auto_describe=True)
            registry.register(collector)
            try:
                httpd, thread = prom.start_http_server(port, addr=host, registry=registry)
            except OSError as e:  # busy port, address not ours, unknown host
                raise UnavailableError(
                    f"{what} {listen!r}: cannot serve client metrics there: {e}") from None
            server = _Server(httpd, thread, collector, key)
            if port != 0:
                _servers[key] = server
        else:
            server.collector.add(store)
        _served[id(store)] = server
        if hasattr(store, "metrics_port"):  # a StoreClient: where it is served
            store.metrics_port = server.port
        return server.port


def stop(store: Any) -> None:
    """Takes `store` off the endpoint it is served on (StoreClient.close does it); the server
    stops with its last client. Nothing happens for a client not served."""
    with _servers_lock:
        server = _served.pop(id(store), None)
        if server is None or not server.collector.remove(store):
            return
        if _servers.get(server.key) is server:
            del _servers[server.key]
    server.close()


__all__ = ["serve", "stop", "StoreCollector", "parse_listen", "ENV"]
