"""The KV-page store from Python: StoreClient, Node, Master, the embedded Cluster.

    import kvbridge, torch
    with kvbridge.Cluster(nodes=3) as cluster:          # master + 3 nodes in this process
        store = cluster.client()
        page = torch.randn(2, 16, 8, 128)              # (K/V, page_size, heads, head_dim)
        store.put("req7/layer0/page3", page)
        out = torch.empty_like(page)
        assert store.get_into("req7/layer0/page3", out) == page.numel() * 4

Keys are str (UTF-8) or bytes, 1..4096 bytes. Buffers are contiguous CPU or CUDA tensors,
buffer-protocol objects or (address, length) pairs (kvbridge._buffers). put/get_into work on
any memory (one staging copy); buffers registered with register_buffer() are moved zero-copy,
CUDA tensors included (their checksums are taken from a pinned host copy; docs/store.md
"Device buffers"), and the batch_* forms require them (NotRegisteredError per key otherwise).

Batch calls never raise for one key: they return one result per key, in order. Single-key
calls raise the key's KvbError (NotFoundError, NoSpaceError, ...). Blocking calls release
the GIL; every object here may be used from several threads.
"""

from __future__ import annotations

import bisect
import operator
import os
import sys
import threading
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

from kvbridge import _buffers, options
from kvbridge._native import _C
from kvbridge.engine import PeerId, raise_if_error
from kvbridge.errors import InvalidArgumentError

Key = Union[str, bytes]
_METRICS_ENV = "KVBRIDGE_CLIENT_METRICS_LISTEN"  # kvbridge.metrics.ENV, without importing it


def _key(k: Any, i: Optional[int] = None) -> Union[str, bytes]:
    if isinstance(k, (str, bytes)):
        return k
    where = "key" if i is None else f"keys[{i}]"
    raise InvalidArgumentError(f"{where}: expected str or bytes, got {type(k).__name__}")


def _raw_pair(b: Any) -> bool:
    """A valid (address, length) pair of plain ints (anything else takes the general path,
    which names what is wrong)."""
    return (type(b) is tuple and len(b) == 2 and type(b[0]) is int and type(b[1]) is int
            and b[0] > 0 and b[1] >= 0)


def _multi(addresses: Sequence[Any]) -> bool:
    """Whether a pointer-list call gives lists of buffers per key (judged by its first)."""
    return len(addresses) > 0 and type(addresses[0]) is list


def _ptr_pairs(keys: Sequence[Key], addresses: Sequence[Any], lengths: Sequence[Any]) -> list:
    """(address, length) pairs of plain ints for the general path, a list of them where an
    entry is a list; integer-like values (numpy integers) are taken, anything else is named
    with its position."""
    if len(addresses) != len(keys) or len(lengths) != len(keys):
        raise InvalidArgumentError(f"{len(keys)} keys but {len(addresses)} addresses and "
                                   f"{len(lengths)} lengths")

    def plain(v: Any, where: str) -> int:
        if not isinstance(v, bool):
            try:
                return operator.index(v)
            except TypeError:
                pass
        raise InvalidArgumentError(f"{where}: expected int, got {type(v).__name__}")

    out = []
    for i, (a, n) in enumerate(zip(addresses, lengths)):
        if isinstance(a, (list, tuple)) or isinstance(n, (list, tuple)):
            if not isinstance(a, (list, tuple)) or not isinstance(n, (list, tuple)) \
                    or len(a) != len(n):
                raise InvalidArgumentError(
                    f"addresses[{i}] and lengths[{i}]: expected two lists of one length")
            out.append([(plain(x, f"addresses[{i}][{j}]"), plain(y, f"lengths[{i}][{j}]"))
                        for j, (x, y) in enumerate(zip(a, n))])
        else:
            out.append((plain(a, f"addresses[{i}]"), plain(n, f"lengths[{i}]")))
    return out


class _KeyOutcome:
    """A per-key outcome: ``status`` and, when ``status.ok``, the value named by ``_value``."""

    _value = ""

    @property
    def ok(self) -> bool:
        return self.status.ok

    def raise_if_error(self) -> Any:
        """The value, or the status raised as its KvbError."""
        raise_if_error(self.status)
        return getattr(self, self._value)


@dataclass(frozen=True)
class GetResult(_KeyOutcome):
    """One key's outcome of batch_get_into: ``size`` bytes read when ``status.ok``."""

    status: Any  # kvbridge.Status
    size: int
    _value = "size"


@dataclass(frozen=True)
class Replica:
    """One complete replica of an object (StoreClient.batch_replicas)."""

    node_id: str
    incarnation: int
    tier: str  # "DRAM" (the node's pool) or "SSD" (its SSD tier)
    segment_id: int  # the node's segment, and the replica's offset in it
    offset: int
    size: int  # the object's bytes


@dataclass(frozen=True)
class ReplicasResult(_KeyOutcome):
    """One key's outcome of batch_replicas: its ``replicas`` when ``status.ok``."""

    status: Any  # kvbridge.Status
    replicas: list
    _value = "replicas"


class StoreClient:
    """A store client. Options are keywords mirroring KVBRIDGE_*: master ("host:port"),
    replica_num, rpc_timeout_ms, store_transfer_deadline_ms, hedge_after_ms,
    hedge_bandwidth_mbps, location_cache_entries, master_wait_ms (reads while the master is
    away), plus the engine's (TransferEngine). verify_checksums is accepted and
    ignored: every read is checked against the object's CRC-32C.

    ``metrics_listen="HOST:PORT"`` (else KVBRIDGE_CLIENT_METRICS_LISTEN; empty: off) serves
    the client's stats() on ``http://HOST:PORT/metrics`` for Prometheus (kvbridge.metrics,
    which needs the prometheus_client package); the port bound is ``metrics_port``."""

    def __init__(self, **kwargs: Any):
        handle = kwargs.pop("_handle", None)
        listen, what = kwargs.pop("metrics_listen", None), "metrics_listen"
        if listen is None:
            listen, what = os.environ.get(_METRICS_ENV, ""), _METRICS_ENV
        owned = handle is None
        if owned:
            opts = options.store_options(kwargs)
            options.check_consumed(kwargs, "StoreClient",
                                   options.STORE_FIELDS + options.ENGINE_FIELDS
                                   + ("metrics_listen",))
            handle = _C.StoreClient(opts)
        self._h = handle
        self._lock = threading.Lock()
        self._starts: list[int] = []  # registered buffers, sorted by address
        self._ends: dict[int, int] = {}
        self._keepalive: dict[int, Any] = {}
        self.metrics_port: Optional[int] = None  # where stats() is served (metrics_listen)
        if listen:
            from kvbridge import metrics

            try:
                self.metrics_port = metrics.serve(self, listen, what)
            except BaseException:
                if owned:
                    self._h.close()
                raise

    # -- registration ----------------------------------------------------------------------
    def register_buffer(self, buf: Any) -> None:
        """Registers memory for zero-copy puts and gets (overlap: AlreadyExistsError). A CUDA
        tensor is registered as device memory of its device: puts and gets move its bytes
        with no host copy of the caller's, and the store client takes their checksums from a
        pinned host copy of its own (docs/store.md "Device buffers"). Without a CUDA driver
        that is UnavailableError naming the driver."""
        r = _buffers.region(buf, writable=True, what="register_buffer")
        self._h.register_buffer(r.address, r.length, r.kind, r.device)
        with self._lock:
            bisect.insort(self._starts, r.address)
            self._ends[r.address] = r.address + r.length
            self._keepalive[r.address] = buf

    def unregister_buffer(self, buf: Any) -> None:
        """NotFoundError unless buf starts a registered buffer."""
        r = _buffers.region(buf, writable=False, what="unregister_buffer")
        self._h.unregister_buffer(r.address)
        with self._lock:
            self._starts.remove(r.address)
            self._ends.pop(r.address, None)
            self._keepalive.pop(r.address, None)

    def _registered(self, r: _buffers.Region) -> bool:
        with self._lock:
            i = bisect.bisect_right(self._starts, r.address) - 1
            return i >= 0 and r.address + r.length <= self._ends[self._starts[i]]

    # -- single keys -----------------------------------------------------------------------
    def put(self, key: Key, buf: Any) -> None:
        """Stores buf's bytes under key. An existing key succeeds without rewriting.
        A CUDA tensor outside the registered buffers is copied to host memory first (register
        it, or the pool it lies in, to skip that copy)."""
        self._put_one(key, buf, "put")

    def upsert(self, key: Key, buf: Any) -> None:
        """put that replaces an existing key: the new bytes replace the old for every reader
        at once when the put ends, and a reader that got the old version keeps reading it
        until its read lease ends (docs/store.md "Overwrites"). A failed upsert leaves the old
        version. Concurrent upserts of a key take turns (the last to start wins); one that
        waited past rpc_timeout_ms raises UnavailableError."""
        self._put_one(key, buf, "upsert")

    def _put_one(self, key: Key, buf: Any, what: str) -> None:
        key = _key(key)
        r = _buffers.region(buf, writable=False, what=what)
        if r.kind == _buffers.CUDA and not self._registered(r):
            buf = _buffers.host_bytes_of(buf)
            r = _buffers.region(buf, writable=False, what=what)
        if self._registered(r):
            batch = self._h.batch_upsert_from if what == "upsert" else self._h.batch_put_from
            raise_if_error(batch([key], [[(r.address, r.length)]])[0])
        elif what == "upsert":
            self._h.upsert(key, r.address, r.length)
        else:
            self._h.put(key, r.address, r.length)

    def get(self, key: Key) -> bytes:
        """The object's bytes (NotFoundError if absent)."""
        return self._h.get(_key(key))

    def get_into(self, key: Key, buf: Any) -> int:
        """Reads the object into buf; returns its size. NotFoundError if absent,
        InvalidArgumentError if buf is smaller than the object (buf is then untouched). A CUDA
        tensor outside the registered buffers is filled through host memory."""
        key = _key(key)
        r = _buffers.region(buf, writable=True, what="get_into")
        if r.kind == _buffers.CUDA and not self._registered(r):  # through host memory
            host = bytearray(r.length)
            n = self.get_into(key, host)
            _buffers.copy_host_to_tensor(host, n, buf)
            return n
        if self._registered(r):
            return GetResult(*self._h.batch_get_into([key], [[(r.address, r.length)]])[0]
                             ).raise_if_error()
        data = self._h.get(key)
        if len(data) > r.length:
            raise InvalidArgumentError(
                f"get_into: object {key!r} has {len(data)} bytes, the buffer only {r.length}")
        mv = memoryview(data)
        _C.memcopy(r.address, _C.buffer_address(mv, False)[0], len(data))
        return len(data)

    def exists(self, key: Key) -> bool:
        return self._h.batch_exists([_key(key)])[0]

    def remove(self, key: Key) -> bool:
        """True if removed, False if there was no such key."""
        status = self._h.batch_remove([_key(key)])[0]
        if status.ok:
            return True
        if status.name == "NOT_FOUND":
            return False
        raise_if_error(status)
        return False

    def remove_all(self) -> None:
        self._h.remove_all()

    def remove_by_regex(self, pattern: str) -> int:
        """Removes every object whose key the regular expression matches (ECMAScript syntax as
        C++'s std::regex reads it, matched anywhere in the key: ``"^req7/"`` for a prefix);
        returns how many. InvalidArgumentError for an empty or malformed pattern. Destructive
        like remove_all: with a cluster token it needs the admin token."""
        if not isinstance(pattern, str):
            raise TypeError(f"remove_by_regex: pattern must be a str, not {type(pattern).__name__}")
        return self._h.remove_by_regex(pattern)

    # -- copying and moving objects between storage nodes (docs/store.md) -----------------
    def copy_object(self, key: Key, to: Sequence[str]) -> int:
        """Copies the object to the storage nodes named (node ids) that hold no replica of it;
        returns the task id for query_task. Raises (NOT_FOUND, NO_SPACE, UNAVAILABLE, ...) if
        the master refuses it."""
        if isinstance(to, str):
            raise InvalidArgumentError("to: expected a list of node ids, got one str")
        return self._h.copy_object(_key(key), list(to))

    def move_object(self, key: Key, from_node: str, to_node: str) -> int:
        """Moves the object's replica from one storage node to another: copied, then dropped
        from the first. Returns the task id for query_task."""
        return self._h.move_object(_key(key), from_node, to_node)

    def query_task(self, task_id: int) -> dict:
        """A copy or move task: ``state`` ("PROCESSING", "SUCCESS", "FAILED"), ``message``
        (why it failed), ``key``, ``move``, ``source`` (the node copying),
        ``created_unix_ms``, ``updated_unix_ms``. NOT_FOUND for an unknown task."""
        return self._h.query_task(task_id)

    # -- batches ---------------------------------------------------------------------------
    def _batch_regions(self, keys: Sequence[Key], buffers: Sequence[Any], writable: bool,
                       what: str) -> tuple[list, list]:
        if len(keys) != len(buffers):
            raise InvalidArgumentError(f"{what}: {len(keys)} keys but {len(buffers)} buffers")
        ks = [k if type(k) is str else _key(k, i) for i, k in enumerate(keys)]
        bufs = []
        for i, b in enumerate(buffers):
            # Fast path for raw (address, length) pairs, alone or in a list: what the Mooncake
            # layer and integrations over pinned pools pass, 128 per batch.
            if _raw_pair(b):
                bufs.append([b])
                continue
            if type(b) is list and b and all(_raw_pair(x) for x in b):
                bufs.append(b)
                continue
            # CUDA tensors too: the native side checks every buffer is registered.
            rs = _buffers.regions(b, writable=writable, what=f"{what} buffers[{i}]")
            bufs.append([(r.address, r.length) for r in rs])
        return ks, bufs

    def batch_put_from(self, keys: Sequence[Key], buffers: Sequence[Any]) -> list:
        """Stores each key from its registered buffer(s); buffers[i] is one buffer or a list
        (K and V of a page, concatenated into one object). One kvbridge.Status per key."""
        ks, bufs = self._batch_regions(keys, buffers, False, "batch_put_from")
        return self._h.batch_put_from(ks, bufs)

    def batch_upsert_from(self, keys: Sequence[Key], buffers: Sequence[Any]) -> list:
        """batch_put_from that replaces existing keys, each as upsert does. One
        kvbridge.Status per key."""
        ks, bufs = self._batch_regions(keys, buffers, False, "batch_upsert_from")
        return self._h.batch_upsert_from(ks, bufs)

    def batch_get_into(self, keys: Sequence[Key], buffers: Sequence[Any]) -> list[GetResult]:
        """Reads each key into its registered buffer(s), filled in order. One GetResult
        (status, size) per key: NOT_FOUND, INVALID_ARGUMENT (buffers too small), ..."""
        ks, bufs = self._batch_regions(keys, buffers, True, "batch_get_into")
        return [GetResult(s, n) for s, n in self._h.batch_get_into(ks, bufs)]

    # Pointer lists (Mooncake's batch_put_from / batch_get_into arguments and their
    # *_multi_buffers forms): registered buffers as parallel lists. They are read natively,
    # with no Python object per key; anything the fast reader does not take (other types, a
    # zero address or length, a repeated key in a put) goes through the calls above, which
    # name what is wrong.
    def batch_put_from_ptrs(self, keys: Sequence[Key], addresses: Sequence[Any],
                            lengths: Sequence[Any]) -> dict:
        """batch_put_from for keys[i] stored from ``lengths[i]`` bytes at ``addresses[i]``
        (registered memory); addresses[i] and lengths[i] may also be lists of one length
        (several buffers, concatenated into one object: K and V of a page). Returns the
        failed keys only: {index: kvbridge.Status}, empty when every key was stored."""
        failed = self._try_put_from_ptrs(keys, addresses, lengths, _multi(addresses))
        if failed is not None:
            return failed
        statuses = self.batch_put_from(keys, _ptr_pairs(keys, addresses, lengths))
        return {i: st for i, st in enumerate(statuses) if not st.ok}

    def batch_upsert_from_ptrs(self, keys: Sequence[Key], addresses: Sequence[Any],
                               lengths: Sequence[Any]) -> dict:
        """batch_put_from_ptrs that replaces existing keys, each as upsert does. Returns the
        failed keys only: {index: kvbridge.Status}."""
        failed = self._try_upsert_from_ptrs(keys, addresses, lengths, _multi(addresses))
        if failed is not None:
            return failed
        statuses = self.batch_upsert_from(keys, _ptr_pairs(keys, addresses, lengths))
        return {i: st for i, st in enumerate(statuses) if not st.ok}

    def batch_get_into_ptrs(self, keys: Sequence[Key], addresses: Sequence[Any],
                            lengths: Sequence[Any]) -> tuple[list[int], dict]:
        """batch_get_into for keys[i] read into ``lengths[i]`` bytes at ``addresses[i]``
        (registered memory; lists of one length for several buffers, filled in order).
        Returns (sizes, failures): bytes read per key (0 where it failed) and
        {index: kvbridge.Status} for the failed keys only."""
        got = self._try_get_into_ptrs(keys, addresses, lengths, _multi(addresses))
        if got is not None:
            return got
        results = self.batch_get_into(keys, _ptr_pairs(keys, addresses, lengths))
        return ([r.size if r.ok else 0 for r in results],
                {i: r.status for i, r in enumerate(results) if not r.ok})

    def _try_put_from_ptrs(self, keys: Any, addresses: Any, lengths: Any,
                           multi: bool) -> Optional[dict]:
        """The fast reader's batch_put_from_ptrs (every entry an int, or with multi every entry
        a list of ints), or None when it does not take the lists: the caller then takes its
        general path (the Mooncake layer has its own)."""
        return self._h.batch_put_from_ptrs(keys, addresses, lengths, multi)

    def _try_upsert_from_ptrs(self, keys: Any, addresses: Any, lengths: Any,
                              multi: bool) -> Optional[dict]:
        """As _try_put_from_ptrs, for batch_upsert_from_ptrs."""
        return self._h.batch_upsert_from_ptrs(keys, addresses, lengths, multi)

    def _try_get_into_ptrs(self, keys: Any, addresses: Any, lengths: Any,
                           multi: bool) -> Optional[tuple]:
        """As _try_put_from_ptrs, for batch_get_into_ptrs."""
        return self._h.batch_get_into_ptrs(keys, addresses, lengths, multi)

    def get_size(self, key: Key) -> int:
        """The object's size in bytes (NotFoundError if absent). Reads no bytes."""
        return GetResult(*self._h.batch_get_size([_key(key)])[0]).raise_if_error()

    def batch_get_size(self, keys: Sequence[Key]) -> list[GetResult]:
        """One GetResult(status, size) per key, sizes from the master; no bytes are read."""
        return [GetResult(s, n) for s, n in
                self._h.batch_get_size([_key(k, i) for i, k in enumerate(keys)])]

    def batch_replicas(self, keys: Sequence[Key]) -> list[ReplicasResult]:
        """One ReplicasResult(status, replicas) per key: where its complete replicas are, in
        the order a get tries them (DRAM before SSD, this client's node first). The master
        answers; no read lease is taken and no access counted, so asking does not keep an
        object from eviction. NOT_FOUND for a key absent or still being written."""
        return [ReplicasResult(s, [Replica(n, inc, "SSD" if ssd else "DRAM", seg, off, size)
                                   for n, inc, ssd, seg, off, size in reps])
                for s, reps in self._h.batch_replica_info([_key(k, i)
                                                           for i, k in enumerate(keys)])]

    def batch_exists(self, keys: Sequence[Key]) -> list[bool]:
        got = self._try_batch_exists(keys)
        return got if got is not None else self._h.batch_exists(
            [_key(k, i) for i, k in enumerate(keys)])

    def _try_batch_exists(self, keys: Any) -> Optional[list]:
        """A list of str/bytes keys goes to the native call as is (existence checks come
        before every write and every prefix lookup in SGLang); None for anything else, which
        the caller checks key by key."""
        if type(keys) is not list:
            return None
        try:
            return self._h.batch_exists(keys)
        except TypeError:
            return None

    def batch_remove(self, keys: Sequence[Key]) -> list:
        """One kvbridge.Status per key (NOT_FOUND for absent keys)."""
        return self._h.batch_remove([_key(k, i) for i, k in enumerate(keys)])

    # -- statistics ------------------------------------------------------------------------
    def stats(self) -> dict:
        """The client's counters since it was made (or since reset_stats()), per key unless
        said otherwise (docs/python.md "Client statistics and metrics"):

        - ``get_hits`` (= ``get_hits_dram`` + ``get_hits_ssd``, by the tier of the replica
          that served the key), ``get_misses`` (NOT_FOUND), ``hit_rate`` (hits over the keys
          gets asked for, failures included; 0.0 before any get), ``bytes_read``;
        - ``puts_stored`` and ``bytes_written`` (object bytes, once per key whatever
          replica_num), ``puts_existing`` (already stored: success, nothing written);
        - ``removes``;
        - ``gets_without_master``: keys read (and counted as hits) while the master was away,
          from replicas this client remembered and their nodes confirmed;
        - ``ops``: for "get", "put", "remove", "exists": ``calls`` (a batch is one; put/get
          are batches of one), ``keys``, ``errors`` ({status name: keys failed}; a get's
          NOT_FOUND is a miss instead), ``seconds_sum`` and ``seconds_buckets`` (cumulative
          (upper bound in seconds, calls) pairs, the last bound inf) of the calls' wall time.

        Reading costs no lock; with calls in flight two fields can be a call apart."""
        s = self._h.stats()
        asked = s["ops"]["get"]["keys"]
        s["hit_rate"] = s["get_hits"] / asked if asked else 0.0
        return s

    def reset_stats(self) -> None:
        """Zeroes the counters (a Prometheus scrape sees a counter reset)."""
        self._h.reset_stats()

    # -- lifetime --------------------------------------------------------------------------
    def close(self) -> None:
        """Closes the client (a Cluster's client closes with its cluster) and stops serving
        its metrics."""
        metrics = sys.modules.get("kvbridge.metrics")  # not imported: nothing served
        if metrics is not None:
            metrics.stop(self)
        self.metrics_port = None
        self._h.close()

    def __enter__(self) -> "StoreClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Master:
    """The store's control plane in this process. Options: master_listen ("host:port", port 0
    picks one), node_ttl_ms, lease_ms, put_timeout_ms, min_replicas, high_watermark,
    low_watermark, drain_timeout_ms, rpc_timeout_ms, task_timeout_ms, metrics_listen
    ("host:port" of the HTTP endpoint: /metrics, /health, the status page; none unless given),
    metrics_token, ... (options.MASTER_FIELDS, docs/configuration.md)."""

    def __init__(self, **kwargs: Any):
        opts = options.master_options(kwargs, alone=True)
        options.check_consumed(kwargs, "Master",
                               options.MASTER_FIELDS + options.MASTER_ONLY_FIELDS)
        if opts.master_etcd:
            raise InvalidArgumentError(
                f"master_etcd={opts.master_etcd!r} (or KVBRIDGE_MASTER_ETCD): a master of "
                "several electing a leader in etcd runs as the daemon, `kvbridge master --etcd "
                "...` (docs/ha.md); Master is a single master")
        self._token = opts.cluster_token
        self._h = _C.Master(opts)

    @property
    def address(self) -> str:
        """"host:port" with the port actually bound."""
        return self._h.address()

    @property
    def metrics_address(self) -> str:
        """"host:port" of the HTTP endpoint (/metrics, /health, the status page); "" if none."""
        return self._h.metrics_address()

    def status(self, timeout_ms: int = 3000) -> dict:
        return cluster_status(self.address, timeout_ms, cluster_token=self._token)

    def close(self) -> None:
        self._h.close()

    def __enter__(self) -> "Master":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Node:
    """A storage node: contributes DRAM to the pool of the master at ``master``. Options:
    master, node_dram_bytes, node_storage_plugin, node_rpc_listen, rpc_timeout_ms,
    drain_timeout_ms, node_ssd_path (an SSD tier; "" = none), node_ssd_bytes,
    node_ssd_plugin, node_ssd_staging_bytes, metrics_listen ("host:port" of the HTTP endpoint:
    /metrics, /health; none unless given), metrics_token, plus the engine's (node_id, listen,
    ...)."""

    def __init__(self, **kwargs: Any):
        opts = options.node_options(kwargs)
        options.check_consumed(kwargs, "Node", options.NODE_FIELDS + options.ENGINE_FIELDS)
        self._h = _C.Node(opts)

    @property
    def id(self) -> PeerId:
        return PeerId(*self._h.id())

    @property
    def metrics_address(self) -> str:
        """"host:port" of the HTTP endpoint (/metrics, /health); "" if none."""
        return self._h.metrics_address()

    @property
    def object_count(self) -> int:
        return self._h.object_count()

    @property
    def ssd_status(self) -> Any:
        """kvbridge.Status: OK when the SSD tier runs, NOT_FOUND when none is configured, else
        why it could not start (the node then serves DRAM only)."""
        return self._h.ssd_status()

    def drain(self) -> None:
        """Graceful leave: replicas move elsewhere, then the node deregisters (blocks at most
        drain_timeout_ms; DeadlineExceededError if the master did not confirm in time)."""
        self._h.drain()

    def close(self) -> None:
        """Stops at once, without draining."""
        self._h.close()

    def __enter__(self) -> "Node":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Cluster:
    """Master + storage nodes + a client in this process, on loopback: the default for
    one-machine use and tests. ``Cluster(nodes=3).client()`` is a StoreClient.

    Keywords: nodes (3), dram_bytes_per_node (256 MiB), replica_num (1), node_id_prefix
    ("embedded"), ssd_dir (an SSD tier per node under <ssd_dir>/node<i>; "" = none),
    ssd_bytes_per_node (1 GiB), ssd_plugin ("ssd"), master options (node_ttl_ms, lease_ms,
    demote_high_watermark, ...) and engine options (applied to every node's and the client's
    engine)."""

    def __init__(self, nodes: int = 3, *, dram_bytes_per_node: int = 256 << 20,
                 replica_num: int = 1, node_id_prefix: str = "embedded", ssd_dir: str = "",
                 ssd_bytes_per_node: int = 1 << 30, ssd_plugin: str = "ssd",
                 peer_discovery: str = "master", **kwargs: Any):
        opts = _C.ClusterOptions()
        for name, value in (("nodes", nodes), ("dram_bytes_per_node", dram_bytes_per_node),
                            ("replica_num", replica_num), ("node_id_prefix", node_id_prefix),
                            ("ssd_dir", str(ssd_dir)), ("ssd_bytes_per_node", ssd_bytes_per_node),
                            ("ssd_plugin", ssd_plugin), ("peer_discovery", peer_discovery)):
            options._set(opts, name, value)
        master = _C.MasterOptions.from_env()
        master.master_listen = "127.0.0.1:0"
        opts.master = options.master_options(kwargs, master)
        opts.engine = options.engine_options(kwargs)
        options.check_consumed(kwargs, "Cluster", options.MASTER_FIELDS + options.ENGINE_FIELDS)
        self._token = opts.engine.cluster_token  # the embedded master's too
        self._h = _C.Cluster(opts)
        self._client: Optional[StoreClient] = None

    @property
    def master_address(self) -> str:
        return self._h.master_address()

    def client(self) -> StoreClient:
        """The cluster's StoreClient (one per cluster; closed with it)."""
        if self._client is None:
            self._client = StoreClient(_handle=self._h.client())
        return self._client

    def node_ids(self) -> list[PeerId]:
        return [PeerId(*self._h.node_id(i)) for i in range(self._h.node_count())]

    def node_object_count(self, index: int) -> int:
        return self._h.node_object_count(index)

    def drain_node(self, index: int) -> None:
        self._h.drain_node(index)

    def stop_node(self, index: int) -> None:
        """Stops node `index` at once (as a crash would, minus the TTL wait)."""
        self._h.stop_node(index)

    def status(self, timeout_ms: int = 3000) -> dict:
        return cluster_status(self.master_address, timeout_ms, cluster_token=self._token)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()  # its metrics endpoint; the native client closes with us
        self._h.close()

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def cluster_status(master: str, timeout_ms: int = 3000,
                   cluster_token: Optional[str] = None) -> dict:
    """A master's view: nodes (id, state, capacity, usage, replicas), object counts,
    evictions, bad replicas dropped, nodes expired, under-replicated objects.
    ``cluster_token``: the cluster's (docs/security.md); None reads KVBRIDGE_CLUSTER_TOKEN."""
    if cluster_token is None:
        cluster_token = os.environ.get("KVBRIDGE_CLUSTER_TOKEN", "")
    return _C.query_cluster_status(master, timeout_ms, cluster_token)


def client_stats_summary(stats: dict) -> dict:
    """A StoreClient.stats() in a few flat integers, as the engine integrations report it
    (SGLang's stats(), vLLM's KV connector stats): ``store_client_`` + get_hits,
    get_hits_ssd, get_misses, get_keys (keys gets asked for: hit_rate is get_hits over it),
    bytes_read, bytes_written, puts_stored, errors (keys failed, every call), and per call
    kind (get, put, exists) ``<op>_calls`` and ``<op>_us`` (their wall time summed, in
    microseconds). Integers so that sums over workers stay exact."""
    ops = stats["ops"]
    out = {f"store_client_{k}": stats[k] for k in (
        "get_hits", "get_hits_ssd", "get_misses", "bytes_read", "bytes_written", "puts_stored")}
    out["store_client_get_keys"] = ops["get"]["keys"]
    out["store_client_errors"] = sum(n for o in ops.values() for n in o["errors"].values())
    for op in ("get", "put", "exists"):
        out[f"store_client_{op}_calls"] = ops[op]["calls"]
        out[f"store_client_{op}_us"] = round(ops[op]["seconds_sum"] * 1e6)
    return out


__all__ = ["StoreClient", "Master", "Node", "Cluster", "GetResult", "cluster_status",
           "client_stats_summary"]
