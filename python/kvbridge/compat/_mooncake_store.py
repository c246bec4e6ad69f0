"""Mooncake's ``MooncakeDistributedStore`` and ``ReplicateConfig``, implemented on kvbridge.

    from kvbridge.compat.mooncake import MooncakeDistributedStore, ReplicateConfig
    store = MooncakeDistributedStore()
    assert store.setup("127.0.0.1", "P2PHANDSHAKE", 512 << 20, 16 << 20, "tcp", "",
                       "127.0.0.1:50051") == 0          # a kvbridge master's address
    store.register_buffer(ptr, size)
    store.batch_put_from(keys, ptrs, sizes)              # [0, 0, ...]
    store.batch_get_into(keys, ptrs, sizes)              # [bytes read, ...] or negative codes

What setup() builds: Mooncake's client contributes ``global_segment_size`` bytes of this
process's memory to the pool; here that is a kvbridge ``Node`` (``node_dram_bytes =
global_segment_size``) registered with the kvbridge master at ``master_server_addr``, plus a
``StoreClient`` of that master sharing the node's id (reads prefer the local replica).
``global_segment_size=0`` is a pure client. ``local_buffer_size`` becomes a registered staging
area for put_batch/get_batch. ``metadata_server``, ``rdma_devices``, ``engine``, ``tenant_id``
and the client HTTP server are accepted and ignored: kvbridge peers find each other through
the master. docs/mooncake.md lists every method and what differs.

Conventions are Mooncake's: 0 on success, bytes read for reads, 1/0 for existence, negative
Mooncake error codes (:class:`ErrorCode`) on failure, ``b""`` from get/get_batch for a key
that cannot be read. Store failures never raise; an argument of the wrong type raises
TypeError, as Mooncake's pybind11 binding does. Buffers are raw addresses (ints) with sizes;
unregistered memory works too (one staging copy), registered memory moves zero-copy.

Thread-safety: every method may be called from several threads. close() waits for the calls
in flight on the kvbridge objects underneath.
"""

from __future__ import annotations

import ctypes
import enum
import ipaddress
import itertools
import logging
import math
import mmap
import operator
import os
import re
import socket
import sys
import threading
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional, Sequence

from kvbridge import _buffers
from kvbridge.compat import _mooncake_names
from kvbridge.compat import _mooncake_tensor as _tensor
from kvbridge.compat._mooncake_names import (  # noqa: F401 (re-exported: __all__)
    BufferLease, BufferLeaseView, BufferPool, EngramStore, EngramStoreConfig,
    MooncakeDistributedNoFRegister, MooncakeNotSupportedError, ObjectDataType, ParallelAxis,
    QueryTaskResponse, ReadTarget, RegisteredBufferLease, RegisteredBufferLeaseView,
    RegisteredBufferPool, SoftPinAction, TaskStatus, TaskType, TensorParallelism,
    bind_to_numa_node, get_alloc_func_addr, get_free_func_addr, not_supported)
from kvbridge.errors import KvbError, UnavailableError
from kvbridge.store import Node, StoreClient, cluster_status

# Every public name of Mooncake's mooncake.store (wheel 0.3.13.post1), plus kvbridge's
# ErrorCode and mooncake_code. The drop-in's mooncake.store exports exactly these.
__all__ = ["MooncakeDistributedStore", "ReplicateConfig", "ErrorCode", "mooncake_code",
           "ReplicaStatus", "ReplicaDescriptor", "MemoryDescriptor", "DiskDescriptor",
           "Descriptor", "MooncakeHostMemAllocator", "BufferHandle",
           *_mooncake_names.__all__, *"""UNDEFINED INITIALIZED COMPLETE REMOVED PENDING
           PROCESSING FAILED SUCCESS REPLICA_COPY REPLICA_MOVE UNKNOWN KVCACHE TENSOR WEIGHT
           SAMPLE ACTIVATION GRADIENT OPTIMIZER_STATE METADATA GENERAL""".split()]

_log = logging.getLogger("kvbridge.compat.mooncake")



def _raw(address: int, size: int) -> _buffers.Region:
    """A raw pointer from the Mooncake API: host or GPU memory alike, registered as what it is
    (CUDA device memory the driver knows, else host memory)."""
    return _buffers.Region(address, size, _buffers.DETECT)

class ErrorCode(enum.IntEnum):
    """Mooncake Store's error numbers (mooncake-store/include/types.h) that this layer returns."""

    OK = 0
    INTERNAL_ERROR = -1
    NO_AVAILABLE_HANDLE = -200
    INVALID_KEY = -400
    INVALID_PARAMS = -600
    ILLEGAL_CLIENT = -601
    OBJECT_NOT_FOUND = -704
    OBJECT_ALREADY_EXISTS = -705
    OBJECT_HAS_LEASE = -706
    TRANSFER_FAIL = -800
    RPC_FAIL = -900
    UNAVAILABLE_IN_CURRENT_STATUS = -1010
    UNAVAILABLE_IN_CURRENT_MODE = -1011
    FILE_NOT_FOUND = -1100


# kvbridge statuses of moving bytes or reaching a peer: TRANSFER_FAIL, or RPC_FAIL when the
# peer was the master (a master-only call, or the status's origin says so).
_PEER_FAILURES = frozenset({"STALE_PEER", "PEER_UNREACHABLE", "DEADLINE_EXCEEDED",
                            "PROGRESS_TIMEOUT", "BACKPRESSURE", "CANCELLED", "PROTOCOL",
                            "IO_ERROR"})
_BY_NAME = {
    "NOT_FOUND": ErrorCode.OBJECT_NOT_FOUND,
    "INVALID_ARGUMENT": ErrorCode.INVALID_PARAMS,
    "NOT_REGISTERED": ErrorCode.INVALID_PARAMS,
    "OUT_OF_BOUNDS": ErrorCode.INVALID_PARAMS,
    "UNKNOWN_MEMORY": ErrorCode.INVALID_PARAMS,
    "ALREADY_EXISTS": ErrorCode.OBJECT_ALREADY_EXISTS,
    "NO_SPACE": ErrorCode.NO_AVAILABLE_HANDLE,
    "UNAUTHENTICATED": ErrorCode.ILLEGAL_CLIENT,
    "PERMISSION_DENIED": ErrorCode.ILLEGAL_CLIENT,
    "UNSUPPORTED": ErrorCode.UNAVAILABLE_IN_CURRENT_MODE,
    "UNAVAILABLE": ErrorCode.UNAVAILABLE_IN_CURRENT_STATUS,
    "INTERNAL": ErrorCode.INTERNAL_ERROR,
}


def mooncake_code(name: str, origin: str = "", master_call: bool = False) -> int:
    """The Mooncake error number for a kvbridge status name (0 for OK). ``origin`` is the
    status's: ``"master"`` makes a peer failure RPC_FAIL, as does ``master_call``. IO_ERROR
    counts as one: bytes a node could not read (its SSD) or that arrived damaged (checksum)."""
    if name == "OK":
        return 0
    if name in _PEER_FAILURES:
        if master_call or origin == "master":
            return int(ErrorCode.RPC_FAIL)
        return int(ErrorCode.TRANSFER_FAIL)
    return int(_BY_NAME.get(name, ErrorCode.INTERNAL_ERROR))


def _code_of(err: Any, master_call: bool = False) -> int:
    """err: a kvbridge.Status or a KvbError."""
    return mooncake_code(err.name, err.origin, master_call)


class ReplicaStatus(enum.IntEnum):
    """Mooncake's replica states; kvbridge lists complete replicas only (COMPLETE)."""

    UNDEFINED = 0
    INITIALIZED = 1
    PROCESSING = 2
    COMPLETE = 3
    REMOVED = 4
    FAILED = 5

    def __str__(self) -> str:
        return f"ReplicaStatus.{self.name}"


# Module-level enum values, as Mooncake's module has them (where two enums share a name,
# TaskStatus's wins there too: FAILED and PROCESSING).
UNDEFINED, INITIALIZED, COMPLETE, REMOVED = (ReplicaStatus.UNDEFINED, ReplicaStatus.INITIALIZED,
                                             ReplicaStatus.COMPLETE, ReplicaStatus.REMOVED)
PENDING, PROCESSING, FAILED, SUCCESS = (TaskStatus.PENDING, TaskStatus.PROCESSING,
                                        TaskStatus.FAILED, TaskStatus.SUCCESS)
REPLICA_COPY, REPLICA_MOVE = TaskType.REPLICA_COPY, TaskType.REPLICA_MOVE
(UNKNOWN, KVCACHE, TENSOR, WEIGHT, SAMPLE, ACTIVATION, GRADIENT, OPTIMIZER_STATE, METADATA,
 GENERAL) = tuple(ObjectDataType)


class Descriptor:
    """Where a memory replica lies. Mooncake gives the holder's virtual address and its transfer
    endpoint; kvbridge gives the replica's offset in the holding node's pool segment and that
    node's id (node addresses are the transport's business, never a client's)."""

    def __init__(self, buffer_address: int, size: int, transport_endpoint: str):
        self.buffer_address = buffer_address
        self.size = size
        self.transport_endpoint = transport_endpoint

    def __repr__(self) -> str:
        return (f"<Descriptor size={self.size} buffer_address={self.buffer_address} "
                f"transport_endpoint={self.transport_endpoint}>")


class MemoryDescriptor:
    def __init__(self, buffer_descriptor: Descriptor):
        self.buffer_descriptor = buffer_descriptor

    def __repr__(self) -> str:
        return f"<MemoryDescriptor {self.buffer_descriptor!r}>"


class DiskDescriptor:
    """A shared-file-system replica in Mooncake; kvbridge has none (its SSD tier is node-local:
    ReplicaDescriptor.is_local_disk_replica)."""

    def __init__(self, file_path: str, object_size: int):
        self.file_path = file_path
        self.object_size = object_size


class ReplicaDescriptor:
    """One replica as ``get_replica_desc`` lists it: in a node's DRAM pool (a memory replica)
    or in its SSD tier (a local-disk replica)."""

    def __init__(self, replica: Any):
        self._replica = replica  # kvbridge.store.Replica
        self.status = ReplicaStatus.COMPLETE

    def is_memory_replica(self) -> bool:
        return self._replica.tier == "DRAM"

    def is_disk_replica(self) -> bool:
        return False

    def is_local_disk_replica(self) -> bool:
        return self._replica.tier == "SSD"

    def get_memory_descriptor(self) -> MemoryDescriptor:
        if not self.is_memory_replica():
            raise RuntimeError("Expected MemoryDescriptor")
        r = self._replica
        return MemoryDescriptor(Descriptor(r.offset, r.size, r.node_id))

    def get_disk_descriptor(self) -> DiskDescriptor:
        raise RuntimeError("Expected DiskDescriptor")

    def __repr__(self) -> str:
        r = self._replica
        return f"<ReplicaDescriptor {r.tier} on {r.node_id} size={r.size} {self.status}>"


class ReplicateConfig:
    """Mooncake's put options, with Mooncake's fields, defaults and checks (a value of the
    wrong type, or an int outside 0..2**64-1, raises TypeError as pybind11 does). kvbridge
    honours ``replica_num`` (replicas on distinct nodes) and the pins (``with_hard_pin``,
    ``soft_pin_action``, ``soft_pin_ttl_ms``: docs/store.md "Eviction"); the other fields are
    kept so that code setting them runs, and are ignored. Unlike Mooncake's, the constructor
    also takes the fields as keywords: ``ReplicateConfig(replica_num=2)``."""

    __slots__ = ("replica_num", "nof_replica_num", "dfs_replica_num", "soft_pin_action",
                 "soft_pin_ttl_ms", "with_hard_pin", "preferred_segment", "preferred_segments",
                 "preferred_nof_segments", "prefer_alloc_in_same_node", "group_ids", "data_type")

    def __init__(self, **fields: Any):
        self.replica_num = 1
        self.nof_replica_num = 0
        self.dfs_replica_num = 0
        self.soft_pin_action = SoftPinAction.PRESERVE
        self.soft_pin_ttl_ms = None  # None: the master's default TTL
        self.with_hard_pin = False
        self.preferred_segment = ""
        self.preferred_segments = []
        self.preferred_nof_segments = []
        self.prefer_alloc_in_same_node = False
        self.group_ids = None
        self.data_type = ObjectDataType.UNKNOWN
        for name, value in fields.items():
            if name not in self.__slots__:
                raise TypeError(f"ReplicateConfig: unknown field {name!r}")
            setattr(self, name, value)

    def __setattr__(self, name: str, value: Any) -> None:
        check = _CONFIG_FIELDS.get(name)
        if check is None:
            raise AttributeError(f"'ReplicateConfig' object has no attribute {name!r}")
        object.__setattr__(self, name, check(name, value))

    def __str__(self) -> str:
        def names(v: list) -> str:
            return "[" + ", ".join(v) + "]"

        parts = [f"replica_num: {self.replica_num}", f"nof_replica_num: {self.nof_replica_num}",
                 f"dfs_replica_num: {self.dfs_replica_num}",
                 f"soft_pin_action: {self.soft_pin_action.name}",
                 "soft_pin_ttl_ms: " + ("default" if self.soft_pin_ttl_ms is None
                                        else str(self.soft_pin_ttl_ms)),
                 f"with_hard_pin: {int(self.with_hard_pin)}",
                 f"preferred_segments: {names(self.preferred_segments)}"]
        if self.preferred_segment:
            parts.append(f"preferred_segment (deprecated): {self.preferred_segment}")
        parts += [f"preferred_nof_segments: {names(self.preferred_nof_segments)}",
                  f"prefer_alloc_in_same_node: {int(self.prefer_alloc_in_same_node)}",
                  f"data_type: {self.data_type.name}"]
        if self.group_ids is not None:
            parts.append(f"group_ids: {names(self.group_ids)}")
        return "ReplicateConfig: { " + ", ".join(parts) + " }"

    def __repr__(self) -> str:
        return f"ReplicateConfig(replica_num={self.replica_num})"


def _field_error(name: str, expected: str, value: Any) -> TypeError:
    return TypeError(f"ReplicateConfig.{name}: expected {expected}, got {value!r}")


def _uint64(name: str, value: Any) -> int:
    # pybind11 takes an int (or a bool, or anything with __index__), never a float or a str.
    if isinstance(value, (float, str, bytes)) or not hasattr(value, "__index__"):
        raise _field_error(name, "an int", value)
    n = operator.index(value)
    if not 0 <= n < 1 << 64:
        raise _field_error(name, "an int in 0..2**64-1", value)
    return n


def _optional_uint64(name: str, value: Any) -> Optional[int]:
    return None if value is None else _uint64(name, value)


def _bool(name: str, value: Any) -> bool:
    # pybind11's bool: None and numbers convert, anything else is refused.
    if value is None or isinstance(value, (bool, int, float)):
        return bool(value)
    raise _field_error(name, "a bool", value)


def _str(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise _field_error(name, "a str", value)
    return value


def _str_list(name: str, value: Any) -> list:
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)) or \
            not all(isinstance(v, str) for v in value):
        raise _field_error(name, "a list of str", value)
    return list(value)


def _optional_str_list(name: str, value: Any) -> Optional[list]:
    return None if value is None else _str_list(name, value)


def _member_of(enum_cls: type) -> Any:
    def check(name: str, value: Any) -> Any:
        if not isinstance(value, enum_cls):
            raise _field_error(name, f"a {enum_cls.__name__}", value)
        return value
    return check


_CONFIG_FIELDS = {
    "replica_num": _uint64, "nof_replica_num": _uint64, "dfs_replica_num": _uint64,
    "soft_pin_action": _member_of(SoftPinAction), "soft_pin_ttl_ms": _optional_uint64,
    "with_hard_pin": _bool, "preferred_segment": _str, "preferred_segments": _str_list,
    "preferred_nof_segments": _str_list, "prefer_alloc_in_same_node": _bool,
    "group_ids": _optional_str_list, "data_type": _member_of(ObjectDataType),
}


class _PutProfile(NamedTuple):
    """What of a ReplicateConfig kvbridge honours, per client (StoreClient options)."""
    replica_num: int = 1
    hard_pin: bool = False
    soft_pin: str = "preserve"  # StoreClient's soft_pin: preserve, enable, disable
    soft_pin_ttl_ms: int = 0    # 0: the master's default

    def suffix(self) -> str:
        """The node id suffix of this profile's client (unique per profile)."""
        out = f"-r{self.replica_num}"
        if self.hard_pin:
            out += "-hard"
        if self.soft_pin != "preserve":
            out += f"-{self.soft_pin}{self.soft_pin_ttl_ms or ''}"
        return out


_DEFAULT_PROFILE = _PutProfile()


def _replica_num(config: Any) -> _PutProfile:
    """The put profile of a ReplicateConfig (ours or mooncake.store's): replica_num and pins."""
    if config is None:
        return _DEFAULT_PROFILE
    n = getattr(config, "replica_num", None)  # ours or mooncake.store.ReplicateConfig
    if not isinstance(n, int) or isinstance(n, bool):
        raise TypeError(f"config: expected a ReplicateConfig, got {type(config).__name__}")
    action = getattr(config, "soft_pin_action", None)
    soft = getattr(action, "name", "PRESERVE").lower()
    ttl = getattr(config, "soft_pin_ttl_ms", None)
    return _PutProfile(n, bool(getattr(config, "with_hard_pin", False)), soft,
                       0 if ttl is None else int(ttl))


def _check_key(key: Any) -> None:
    if not isinstance(key, (str, bytes)):
        raise TypeError(f"key: expected str, got {type(key).__name__}")


def _check_keys(keys: Any) -> None:
    if isinstance(keys, (str, bytes)):
        raise TypeError("keys: expected a list of str, got a single key")
    for k in keys:
        _check_key(k)


def _check_ints(what: str, values: Any) -> None:
    for v in values:
        if not isinstance(v, int) or isinstance(v, bool):
            raise TypeError(f"{what}: expected int, got {type(v).__name__}")


def _bytes_view(value: Any, what: str) -> memoryview:
    if isinstance(value, str):  # Mooncake takes buffers, not text
        raise TypeError(f"{what}: expected a bytes-like object, got str")
    mv = memoryview(value)
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


def _split_duplicates(keys: Sequence[Any]) -> tuple[list[int], list[int]]:
    """Indexes of first occurrences and of repeats. kvbridge refuses a key twice in one put
    batch; a repeat goes in a second batch, where it is an existing key (success, not written)."""
    seen: set = set()
    first, repeats = [], []
    for i, k in enumerate(keys):
        (repeats if k in seen else first).append(i)
        seen.add(k)
    return first, repeats


def _put_rounds(keys: Sequence[Any], upsert: bool) -> list[list[int]]:
    """The batches a put of these keys goes in, in order, none with a key twice (kvbridge
    refuses that). A put: first occurrences, then the repeats, which find the key existing
    (success, not written). An upsert: the n-th occurrences in round n, so that of a key given
    twice the last value stays, as in Mooncake."""
    if not upsert:
        return list(_split_duplicates(keys))
    seen: dict = {}
    rounds: list[list[int]] = []
    for i, k in enumerate(keys):
        n = seen.get(k, 0)
        seen[k] = n + 1
        if n == len(rounds):
            rounds.append([])
        rounds[n].append(i)
    return rounds or [[]]


def _host_of(local_hostname: str) -> str:
    """An address to listen on for Mooncake's local_hostname ("host" or "host:port")."""
    host = local_hostname.strip()
    if host.startswith("[") and "]" in host:  # [v6]:port
        host = host[1:host.index("]")]
    elif host.count(":") == 1:
        host = host.split(":", 1)[0]
    try:
        ipaddress.ip_address(host)
        return host
    except ValueError:
        return socket.gethostbyname(host)


def _local_host_towards(address: str) -> str:
    """The local address this host reaches ``address`` ("host:port") from: loopback for a
    loopback master, else the source address the routing table picks (no packet is sent)."""
    host, sep, port = address.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit():
        raise ValueError("expected host:port")
    ip = _host_of(host)
    if ipaddress.ip_address(ip).is_loopback:
        return ip
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((ip, int(port)))
        return s.getsockname()[0]


_instances = itertools.count()


class _PutSession:
    """One key's put session: the object being assembled in this process, the put profile
    it was started with, and whether ranged writes may still land (end and revoke close it
    under ``lock``, so a write either lands before the object is stored or is refused)."""

    __slots__ = ("data", "profile", "lock", "open")

    def __init__(self, size: int, profile: "_PutProfile"):
        self.data = bytearray(size)
        self.profile = profile
        self.lock = threading.Lock()
        self.open = True


class _Session:
    """What one setup() built; closed as a whole by close()."""

    def __init__(self, master: str, node: Optional[Node], client: StoreClient,
                 client_options: dict, staging: Optional[mmap.mmap], metrics_listen: str = "",
                 node_options: Optional[dict] = None):
        self.master = master
        self.node = node
        self.client = client
        # Segments mounted after setup (allocate_and_mount_segment, mount_segment): id ->
        # (kind, its Node), started from node_options (setup's node's, less its size and id).
        self._node_options = dict(node_options or {})
        self.has_ssd = "node_ssd_path" in self._node_options
        self._segments: dict[str, tuple[str, Node]] = {}
        self._segment_ids = itertools.count(1)
        self.mem_pool: Optional[_BumpPool] = None  # setup_dummy's (alloc_from_mem_pool)
        self._client_options = client_options
        self.node_id = client_options["node_id"]  # the node's and the main client's
        # enable_client_http_server: where every client of the session is served (one
        # endpoint, their sums); "" when off.
        self.metrics_listen = metrics_listen
        _serve_metrics(client, metrics_listen)
        self._lock = threading.Lock()
        # Clients for puts with another replica_num or pins (kvbridge's are per client).
        self._by_replicas: dict[_PutProfile, StoreClient] = {_DEFAULT_PROFILE: client}
        self._registered: dict[int, int] = {}  # address -> size, re-registered on new clients
        self._closed = False
        self.staging = staging
        self.staging_address = 0
        self.staging_lock = threading.Lock()
        # Mooncake's put and get sessions (batch_put_session_start, batch_get_session_start):
        # key -> _PutSession, key -> the object's bytes. They end with the setup, as
        # Mooncake's end with its client.
        self.sessions_lock = threading.Lock()
        self.put_sessions: dict[Any, _PutSession] = {}
        self.get_sessions: dict[Any, bytes] = {}
        if staging is not None:
            self.staging_address = ctypes.addressof(ctypes.c_char.from_buffer(staging))
            self.register(self.staging_address, len(staging))

    def client_for(self, profile: _PutProfile) -> StoreClient:
        with self._lock:
            c = self._by_replicas.get(profile)
            closed = self._closed
        if c is not None:
            return c
        if closed:
            raise UnavailableError("the store is closed")
        opts = dict(self._client_options, replica_num=profile.replica_num,
                    hard_pin=profile.hard_pin, soft_pin=profile.soft_pin,
                    soft_pin_ttl_ms=profile.soft_pin_ttl_ms)
        opts["node_id"] = opts["node_id"] + profile.suffix()
        # InvalidArgumentError for replica_num < 1, or a TTL without SoftPinAction.ENABLE
        fresh = StoreClient(**opts)
        _serve_metrics(fresh, self.metrics_listen)
        with self._lock:
            closed = self._closed
            c = fresh if closed else self._by_replicas.setdefault(profile, fresh)
            buffers = list(self._registered.items()) if c is fresh else []
        if closed or c is not fresh:
            fresh.close()
        if closed:
            raise UnavailableError("the store is closed")
        for address, size in buffers:
            try:
                c.register_buffer(_raw(address, size))
            except KvbError:
                pass  # unregistered meanwhile; that key then goes through the staging copy
        return c

    def mount(self, kind: str, size: int, path: Optional[str] = None, offset: int = 0) -> str:
        """Starts a storage node of ``size`` bytes (of the file ``path`` from ``offset`` when
        given) registered with the master; its id, the segment id. KvbError if it cannot."""
        with self._lock:
            if self._closed:
                raise UnavailableError("the store is closed")
            segment = f"{self.node_id}-segment-{next(self._segment_ids)}"
        opts = dict(self._node_options, node_id=segment, node_dram_bytes=size)
        opts.pop("node_ssd_path", None)  # the SSD tier stays with setup's node
        if path is not None:
            opts["plugin_config"] = {"dram.file": path, "dram.file_offset": str(offset)}
        node = Node(**opts)
        with self._lock:
            if not self._closed:
                self._segments[segment] = (kind, node)
                return segment
        node.close()
        raise UnavailableError("the store is closed")

    def unmount(self, kind: str, segment_ids: list) -> None:
        """Drains and stops the segments, all of ``kind``; KeyError (naming the id, nothing
        unmounted) if one is not."""
        with self._lock:
            for segment in segment_ids:
                if self._segments.get(segment, ("", None))[0] != kind:
                    raise KeyError(f"{segment!r} is not a segment {kind} mounted on this store")
            nodes = [self._segments.pop(segment)[1] for segment in segment_ids]
        for segment, node in zip(segment_ids, nodes):
            try:
                node.drain()
            except KvbError as e:
                _log.warning("unmounting %s: its drain did not finish (%s); stopping it",
                             segment, e)
            node.close()

    def clients(self) -> list:
        """Every client of this setup: the main one and one per other put profile."""
        with self._lock:
            return list(self._by_replicas.values())

    def register(self, address: int, size: int) -> None:
        self.client.register_buffer(_raw(address, size))
        with self._lock:
            self._registered[address] = size
            others = [c for n, c in self._by_replicas.items() if n != _DEFAULT_PROFILE]
        for c in others:
            c.register_buffer(_raw(address, size))

    def unregister(self, address: int) -> None:
        self.client.unregister_buffer((address, 0))
        with self._lock:
            self._registered.pop(address, None)
            others = [c for n, c in self._by_replicas.items() if n != _DEFAULT_PROFILE]
        for c in others:
            try:
                c.unregister_buffer((address, 0))
            except KvbError:
                pass  # registered on the main client only (a race with client_for)

    def close(self) -> None:
        with self._lock:
            clients = list(self._by_replicas.values())
            self._by_replicas = {}
            self._closed = True
        for c in clients:
            c.close()
        with self._lock:
            segments, self._segments = list(self._segments.values()), {}
        for _, node in segments:
            node.close()
        if self.node is not None:
            self.node.close()  # like Mooncake's close: the segment and its replicas go away
        # The staging mmap is left to the garbage collector: a buffer export of it (the
        # registration) may still be alive in a client being torn down.


class MooncakeDistributedStore:
    """Mooncake's store client on kvbridge (module docstring: the mapping and conventions)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._session: Optional[_Session] = None

    # -- setup and lifetime ----------------------------------------------------------------
    def setup(self, *args: Any, **kwargs: Any) -> int:
        """``setup(local_hostname, metadata_server, global_segment_size, local_buffer_size,
        protocol, rdma_devices, master_server_addr, engine=None, enable_ssd_offload=False,
        ssd_offload_path="", tenant_id="default", enable_client_http_server=False,
        client_http_port=9300)`` or ``setup(config_dict)`` (keys as the parameters; only
        local_hostname and metadata_server required). 0 on success, -1 on failure (logged)."""
        config = _setup_arguments(args, kwargs)
        with self._lock:
            if self._session is not None:
                _log.warning("setup: already set up; keeping the existing setup")
                return 0
        try:
            session = _start(config)
        except _InvalidSize as e:
            _log.error("setup failed: %s", e)
            return int(ErrorCode.INVALID_PARAMS)  # as Mooncake answers a size it cannot read
        except (KvbError, ValueError, OSError) as e:
            _log.error("setup failed: %s", e)
            return -1
        with self._lock:
            if self._session is None:
                self._session = session
                return 0
        session.close()  # another thread's setup won
        return 0

    def setup_dummy(self, mem_pool_size: int, local_buffer_size: int,
                    server_address: str) -> int:
        """Mooncake's standalone ("dummy client") mode: this process contributes no memory and
        a separate process holds the pool. Mooncake's dummy client talks to a ``mooncake_client``
        daemon at ``server_address`` and hands it shared memory (``MooncakeHostMemAllocator``)
        to read from. Here ``server_address`` is a kvbridge master's ``host:port``, the pool is
        the kvbridge nodes (``kvbridge node``) registered with it, and this is a pure client of
        it (``setup`` with ``global_segment_size=0``): nodes read and write this process's
        registered buffers over the transport, so no memory is handed over. ``mem_pool_size``
        bytes are registered here as the pool ``alloc_from_mem_pool`` hands out. 0, or -1 with
        the reason logged."""
        _check_ints("mem_pool_size/local_buffer_size", (mem_pool_size, local_buffer_size))
        if not isinstance(server_address, str):
            raise TypeError(f"server_address: expected str, got {type(server_address).__name__}")
        if mem_pool_size < 0 or local_buffer_size < 0:
            _log.error("setup_dummy: sizes must be >= 0")
            return -1
        try:
            host = _local_host_towards(server_address)
        except (ValueError, OSError) as e:
            _log.error("setup_dummy: server_address %r: %s", server_address, e)
            return -1
        rc = self.setup({"local_hostname": host, "metadata_server": "P2PHANDSHAKE",
                         "global_segment_size": 0, "local_buffer_size": local_buffer_size,
                         "protocol": "tcp", "master_server_addr": server_address})
        s = self._session
        if rc == 0 and s is not None and mem_pool_size > 0 and s.mem_pool is None:
            try:
                pool = _BumpPool(mem_pool_size)
                s.register(pool.base, pool.size)
            except (KvbError, OSError, ValueError) as e:
                _log.error("setup_dummy: the %d-byte memory pool: %s", mem_pool_size, e)
                return -1
            s.mem_pool = pool
        return rc

    def close(self) -> int:
        """Closes the client and stops this process's contribution to the pool. 0; idempotent."""
        with self._lock:
            session, self._session = self._session, None
        if session is not None:
            session.close()
        return 0

    def health_check(self) -> int:
        """0 healthy, 1 not set up or closed, 2 master unreachable."""
        s = self._session
        if s is None:
            return 1
        host, _, port = s.master.rpartition(":")
        try:  # a refused connection answers at once; the RPC below would wait out a backoff
            socket.create_connection((host.strip("[]"), int(port)), timeout=2).close()
            cluster_status(s.master, timeout_ms=2000)
        except (KvbError, OSError, ValueError):
            return 2
        return 0

    # -- plain values ----------------------------------------------------------------------
    def put(self, key: str, value: Any, config: Any = None) -> int:
        """Stores value's bytes. An existing key succeeds and keeps its bytes. 0 or an error."""
        return self._put_value(key, value, config, upsert=False)

    def upsert(self, key: str, value: Any, config: Any = None) -> int:
        """put that replaces an existing key's bytes: readers see the old bytes or the new,
        never a mix (StoreClient.upsert). 0 or an error."""
        return self._put_value(key, value, config, upsert=True)

    def _put_value(self, key: str, value: Any, config: Any, upsert: bool) -> int:
        _check_key(key)
        view = _bytes_view(value, "value")
        n = _replica_num(config)
        s = self._session
        if s is None:
            return int(ErrorCode.INVALID_PARAMS)
        try:
            client = s.client_for(n)
            (client.upsert if upsert else client.put)(key, view)
            return 0
        except KvbError as e:
            return _code_of(e)

    def put_parts(self, key: str, *parts: Any, config: Any = None) -> int:
        """Stores the parts' bytes, concatenated, as one object."""
        _check_key(key)
        return self.put(key, b"".join(_bytes_view(p, "parts") for p in parts), config)

    def upsert_parts(self, key: str, *parts: Any, config: Any = None) -> int:
        """upsert of the parts' bytes, concatenated, as one object."""
        _check_key(key)
        return self.upsert(key, b"".join(_bytes_view(p, "parts") for p in parts), config)

    def get(self, key: str) -> bytes:
        """The object's bytes; b"" when it cannot be read (missing key or failure)."""
        _check_key(key)
        s = self._session
        if s is None:
            return b""
        try:
            return s.client.get(key)
        except KvbError:
            return b""

    def put_batch(self, keys: list, values: list, config: Any = None) -> int:
        """Stores each key's value. 0 when all succeeded, else the first key's error; a
        length mismatch or an empty value fails the whole call (INVALID_PARAMS) up front."""
        return self._put_values(keys, values, config, upsert=False)

    def upsert_batch(self, keys: list, values: list, config: Any = None) -> int:
        """put_batch that replaces existing keys, each as upsert does; of a key given twice
        the last value stays."""
        return self._put_values(keys, values, config, upsert=True)

    def _put_values(self, keys: list, values: list, config: Any, upsert: bool) -> int:
        _check_keys(keys)
        views = [_bytes_view(v, "values") for v in values]
        n = _replica_num(config)
        s = self._session
        if s is None or len(keys) != len(views) or any(len(v) == 0 for v in views):
            return int(ErrorCode.INVALID_PARAMS)
        try:
            client = s.client_for(n)
        except KvbError as e:
            return _code_of(e)
        results = [0] * len(keys)
        for group in _put_rounds(keys, upsert):
            for i, code in zip(group, self._staged_put(s, client, [keys[i] for i in group],
                                                        [views[i] for i in group], upsert)):
                results[i] = code
        return next((c for c in results if c != 0), 0)

    def get_batch(self, keys: list) -> list:
        """Each key's bytes, b"" for a key that cannot be read."""
        _check_keys(keys)
        s = self._session
        if s is None:
            return [b""] * len(keys)
        sizes = self._sizes(s, list(keys))
        out = [b""] * len(keys)
        chunk: list[tuple[int, int, int]] = []  # (index, offset in staging, size)
        used = 0
        capacity = len(s.staging) if s.staging is not None else 0
        for i, size in enumerate(sizes):
            if size <= 0:
                continue
            if size > capacity:
                out[i] = self.get(keys[i])
                continue
            if used + size > capacity:
                self._staged_get(s, keys, chunk, out)
                chunk, used = [], 0
            chunk.append((i, used, size))
            used += size
        if chunk:
            self._staged_get(s, keys, chunk, out)
        return out

    # -- zero-copy forms (raw addresses) ---------------------------------------------------
    def put_from(self, key: str, buffer_ptr: int, size: int, config: Any = None) -> int:
        """Stores [buffer_ptr, buffer_ptr + size). Zero-copy when registered. 0 or an error."""
        return self._put_range(key, buffer_ptr, size, config, upsert=False)

    def upsert_from(self, key: str, buffer_ptr: int, size: int, config: Any = None) -> int:
        """put_from that replaces an existing key, as upsert does. 0 or an error."""
        return self._put_range(key, buffer_ptr, size, config, upsert=True)

    def _put_range(self, key: str, buffer_ptr: int, size: int, config: Any,
                   upsert: bool) -> int:
        _check_key(key)
        _check_ints("buffer_ptr/size", (buffer_ptr, size))
        n = _replica_num(config)
        s = self._session
        if s is None or buffer_ptr <= 0 or size <= 0:
            return int(ErrorCode.INVALID_PARAMS)
        try:
            client = s.client_for(n)
            (client.upsert if upsert else client.put)(key, (buffer_ptr, size))
            return 0
        except KvbError as e:
            return _code_of(e)

    def get_into(self, key: str, buffer_ptr: int, size: int) -> int:
        """Reads the object into [buffer_ptr, buffer_ptr + size): bytes read, or an error
        (INVALID_PARAMS when the buffer is smaller than the object; it is then untouched)."""
        _check_key(key)
        _check_ints("buffer_ptr/size", (buffer_ptr, size))
        s = self._session
        if s is None or buffer_ptr <= 0 or size < 0:
            return int(ErrorCode.INVALID_PARAMS)
        try:  # a missing key is OBJECT_NOT_FOUND whatever the size, as in Mooncake
            return s.client.get_into(key, (buffer_ptr, size))
        except KvbError as e:
            return _code_of(e)

    def batch_put_from(self, keys: list, buffer_ptrs: list, sizes: list,
                       config: Any = None) -> list:
        """Stores each key from one buffer. One result per key: 0 or an error."""
        return self._batch_put_from(keys, buffer_ptrs, sizes, config, upsert=False)

    def batch_upsert_from(self, keys: list, buffer_ptrs: list, sizes: list,
                          config: Any = None) -> list:
        """batch_put_from that replaces existing keys, each as upsert does; of a key given
        twice the last buffer stays. One result per key: 0 or an error."""
        return self._batch_put_from(keys, buffer_ptrs, sizes, config, upsert=True)

    def _batch_put_from(self, keys: list, buffer_ptrs: list, sizes: list, config: Any,
                        upsert: bool) -> list:
        fast = self._put_from_ptrs(keys, buffer_ptrs, sizes, config, upsert=upsert)
        if fast is not None:
            return fast
        _check_keys(keys)
        _check_ints("buffer_ptrs", buffer_ptrs)
        _check_ints("sizes", sizes)
        if len(buffer_ptrs) != len(keys) or len(sizes) != len(keys):
            return [int(ErrorCode.INVALID_PARAMS)] * len(keys)
        return self._batch_put(keys, [[(p, n)] for p, n in zip(buffer_ptrs, sizes)], config,
                               upsert=upsert)

    def batch_get_into(self, keys: list, buffer_ptrs: list, sizes: list) -> list:
        """Reads each key into one buffer. One result per key: bytes read or an error."""
        fast = self._get_into_ptrs(keys, buffer_ptrs, sizes)
        if fast is not None:
            return fast
        _check_keys(keys)
        _check_ints("buffer_ptrs", buffer_ptrs)
        _check_ints("sizes", sizes)
        if len(buffer_ptrs) != len(keys) or len(sizes) != len(keys):
            return [int(ErrorCode.INVALID_PARAMS)] * len(keys)
        return self._batch_get(keys, [[(p, n)] for p, n in zip(buffer_ptrs, sizes)])

    def batch_put_from_multi_buffers(self, keys: list, all_buffer_ptrs: list, all_sizes: list,
                                     config: Any = None) -> list:
        """Stores each key from several buffers (e.g. K and V), concatenated into one object."""
        fast = self._put_from_ptrs(keys, all_buffer_ptrs, all_sizes, config, multi=True)
        if fast is not None:
            return fast
        bufs = _multi_buffers(keys, all_buffer_ptrs, all_sizes)
        if bufs is None:
            return [int(ErrorCode.INVALID_PARAMS)] * len(keys)
        return self._batch_put(keys, bufs, config)

    def batch_get_into_multi_buffers(self, keys: list, all_buffer_ptrs: list, all_sizes: list,
                                     prefer_alloc_in_same_node: bool = False) -> list:
        """Reads each key into several buffers, filled in order: bytes read or an error.
        (prefer_alloc_in_same_node is accepted and ignored.)"""
        fast = self._get_into_ptrs(keys, all_buffer_ptrs, all_sizes, multi=True)
        if fast is not None:
            return fast
        bufs = _multi_buffers(keys, all_buffer_ptrs, all_sizes)
        if bufs is None:
            return [int(ErrorCode.INVALID_PARAMS)] * len(keys)
        return self._batch_get(keys, bufs)

    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        """Registers memory for zero-copy transfers. 0, or INVALID_PARAMS (zero size, overlap)."""
        _check_ints("buffer_ptr/size", (buffer_ptr, size))
        s = self._session
        if s is None or buffer_ptr <= 0 or size <= 0:
            return int(ErrorCode.INVALID_PARAMS)
        try:
            s.register(buffer_ptr, size)
            return 0
        except KvbError as e:
            return int(ErrorCode.INVALID_PARAMS) if e.name != "UNAVAILABLE" else _code_of(e)

    def unregister_buffer(self, buffer_ptr: int) -> int:
        """0, or INVALID_PARAMS unless buffer_ptr starts a registered buffer."""
        _check_ints("buffer_ptr", (buffer_ptr,))
        s = self._session
        if s is None or buffer_ptr <= 0:
            return int(ErrorCode.INVALID_PARAMS)
        try:
            s.unregister(buffer_ptr)
            return 0
        except (KvbError, ValueError) as e:  # ValueError: not in the client's own list
            name = getattr(e, "name", "")
            return int(ErrorCode.INVALID_PARAMS) if name != "UNAVAILABLE" else _code_of(e)

    # -- existence, sizes, removal ---------------------------------------------------------
    def is_exist(self, key: str) -> int:
        """1 if the key exists (complete), 0 if not, negative on error."""
        _check_key(key)
        return self.batch_is_exist([key])[0]

    def batch_is_exist(self, keys: list) -> list:
        """One 1/0/negative per key. SGLang calls it before every batch write and for every
        prefix lookup, so a list of str goes straight to the native call (which refuses
        anything else with TypeError; the checked path then names the bad key)."""
        s = self._session
        if s is not None and keys:
            try:
                got = s.client._try_batch_exists(keys)
            except KvbError as e:
                return [_code_of(e, master_call=True)] * len(keys)
            if got is not None:
                return list(map(int, got))
        _check_keys(keys)
        if s is None:
            return [int(ErrorCode.INVALID_PARAMS)] * len(keys)
        if not keys:
            return []
        try:
            return [1 if e else 0 for e in s.client.batch_exists(list(keys))]
        except KvbError as e:
            return [_code_of(e, master_call=True)] * len(keys)

    def get_size(self, key: str) -> int:
        """The object's size in bytes, or an error (OBJECT_NOT_FOUND)."""
        _check_key(key)
        s = self._session
        if s is None:
            return int(ErrorCode.INVALID_PARAMS)
        return self._sizes(s, [key])[0]

    def get_replica_desc(self, key: str) -> list:
        """The key's replicas (ReplicaDescriptor), in the order a get tries them; [] when it
        is absent or the master cannot answer. Unlike Mooncake, asking takes no read lease:
        a remove or an eviction right after it is not refused for it."""
        _check_key(key)
        return self.batch_get_replica_desc([key]).get(key, [])

    def batch_get_replica_desc(self, keys: list) -> dict:
        """{key: [ReplicaDescriptor, ...]} for the keys found; absent keys (and all keys, when
        the master cannot answer) are left out, as in Mooncake."""
        _check_keys(keys)
        s = self._session
        if s is None or not keys:
            return {}
        try:
            results = s.client.batch_replicas(list(keys))
        except KvbError as e:
            _log.warning("batch_get_replica_desc: %s", e)
            return {}
        return {k: [ReplicaDescriptor(r) for r in res.replicas]
                for k, res in zip(keys, results) if res.ok and res.replicas}

    def remove(self, key: str, force: bool = False) -> int:
        """0, OBJECT_NOT_FOUND, or an error. kvbridge never refuses for a read lease (the
        space stays reserved until leased reads end), so ``force`` changes nothing."""
        _check_key(key)
        return self.batch_remove([key], force)[0]

    def batch_remove(self, keys: list, force: bool = False) -> list:
        """One 0/negative per key."""
        _check_keys(keys)
        s = self._session
        if s is None:
            return [int(ErrorCode.INVALID_PARAMS)] * len(keys)
        if not keys:
            return []
        try:
            return [_code_of(st, master_call=True) for st in s.client.batch_remove(list(keys))]
        except KvbError as e:
            return [_code_of(e, master_call=True)] * len(keys)

    def remove_all(self, force: bool = False) -> int:
        """Removes every complete object in the cluster: how many were removed, or an error.
        (The count is the master's object count before minus after, so puts completing
        meanwhile are subtracted.)"""
        s = self._session
        if s is None:
            return int(ErrorCode.INVALID_PARAMS)
        try:
            before = cluster_status(s.master)["objects"]
            s.client.remove_all()
            after = cluster_status(s.master)["objects"]
        except KvbError as e:
            return _code_of(e, master_call=True)
        return max(before - after, 0)

    def remove_by_regex(self, regex_pattern: str, force: bool = False) -> int:
        """Removes every complete object whose key the regular expression matches anywhere
        (ECMAScript syntax, as Mooncake's master reads it): how many were removed,
        INVALID_PARAMS for a malformed pattern, or an error; an empty pattern removes every
        object, as Mooncake's does (``remove_all``). The master does the
        matching (StoreClient.remove_by_regex). ``force`` changes nothing, as for ``remove``."""
        if not isinstance(regex_pattern, str):
            raise TypeError("remove_by_regex(): incompatible function arguments: regex_pattern "
                            f"must be str, not {type(regex_pattern).__name__}")
        if regex_pattern == "":
            # Matches every key, as in Mooncake (kvbridge's own remove_by_regex refuses it).
            return self.remove_all(force)
        s = self._session
        if s is None:
            return int(ErrorCode.INVALID_PARAMS)
        try:
            return s.client.remove_by_regex(regex_pattern)
        except KvbError as e:
            return _code_of(e, master_call=True)

    # -- segments beyond setup's (Mooncake's mount API) ------------------------------------
    # Each segment is a kvbridge storage node of its own in this process, registered with the
    # session's master, its id the segment id. Unmounting drains it: its objects move to the
    # other nodes before it leaves (Mooncake's unmount drops them).
    def allocate_and_mount_segment(self, size: int, protocol: str = "tcp",
                                   location: str = "") -> dict:
        """Contributes ``size`` more bytes of this process's memory to the pool: ``{"ret": 0,
        "segment_ids": [id], "allocated_size": size}``, or ``ret`` -1 (logged) before setup,
        for a size of 0 or when the node cannot start. ``protocol`` and ``location`` (a NUMA or
        device hint) are not used: the segment's node runs on the session's transports."""
        _check_ints("size", (size,))
        failed = {"ret": -1, "segment_ids": [], "allocated_size": 0}
        s = self._session
        if s is None:
            _log.error("allocate_and_mount_segment: not set up")
            return failed
        if size <= 0:
            _log.error("allocate_and_mount_segment: size is %d", size)
            return failed
        try:
            segment = s.mount(_SEGMENT_ALLOCATED, size)
        except (KvbError, ValueError) as e:
            _log.error("allocate_and_mount_segment(%d): %s", size, e)
            return failed
        return {"ret": 0, "segment_ids": [segment], "allocated_size": size}

    def mount_segment(self, path: str, size: int, offset: int = 0, protocol: str = "tcp",
                      location: str = "") -> dict:
        """Contributes ``size`` bytes of the existing file ``path`` from ``offset`` (a multiple
        of the page size), mapped shared, e.g. a /dev/shm file another process maps:
        ``{"ret": 0, "segment_ids": [id]}``, or ``ret`` -1 (logged) when the file is missing or
        too small, the offset unaligned, the size 0 or before setup."""
        if not isinstance(path, str):
            raise TypeError(f"path: expected str, got {type(path).__name__}")
        _check_ints("size/offset", (size, offset))
        failed = {"ret": -1, "segment_ids": []}
        s = self._session
        if s is None:
            _log.error("mount_segment: not set up")
            return failed
        if size <= 0 or offset < 0:
            _log.error("mount_segment(%s): size %d, offset %d", path, size, offset)
            return failed
        try:
            segment = s.mount(_SEGMENT_FILE, size, path, offset)
        except (KvbError, ValueError) as e:
            _log.error("mount_segment(%s, %d, %d): %s", path, size, offset, e)
            return failed
        return {"ret": 0, "segment_ids": [segment]}

    def unmount_segment(self, segment_ids: list, grace_period_seconds: int = 0) -> int:
        """Unmounts segments that ``mount_segment`` mounted: each is drained (its objects move
        to other nodes, for at most the node's drain timeout, 30 s) and stopped. 0; -1 (logged,
        nothing unmounted) when an id is not such a segment of this store; INVALID_PARAMS for an
        id given twice. ``grace_period_seconds`` is accepted; draining already lets reads in
        flight finish."""
        return self._unmount("unmount_segment", _SEGMENT_FILE, segment_ids, grace_period_seconds)

    def unmount_and_free_segment(self, segment_ids: list, grace_period_seconds: int = 0) -> int:
        """unmount_segment for segments that ``allocate_and_mount_segment`` made; their memory
        is freed."""
        return self._unmount("unmount_and_free_segment", _SEGMENT_ALLOCATED, segment_ids,
                             grace_period_seconds)

    def _unmount(self, what: str, kind: str, segment_ids: Any, grace_period_seconds: int) -> int:
        _check_ints("grace_period_seconds", (grace_period_seconds,))
        if grace_period_seconds < 0:
            raise TypeError(f"{what}(): grace_period_seconds must be >= 0")
        ids = _str_list("segment_ids", segment_ids)
        s = self._session
        if s is None:
            _log.error("%s: not set up", what)
            return -1
        if len(set(ids)) != len(ids):
            _log.error("%s: a segment id is given twice", what)
            return int(ErrorCode.INVALID_PARAMS)
        try:
            s.unmount(kind, ids)
        except KeyError as e:
            _log.error("%s: %s", what, e.args[0])
            return -1
        return 0

    def unmount_local_disk_segment(self, grace_period_seconds: int = 0) -> int:
        """0 when this store has no SSD tier (``enable_ssd_offload``), as Mooncake answers with
        no local disk segment. With one: MooncakeNotSupportedError (_NO_DISK_UNMOUNT)."""
        _check_ints("grace_period_seconds", (grace_period_seconds,))
        s = self._session
        if s is None or not s.has_ssd:
            return 0
        not_supported("unmount_local_disk_segment", _NO_DISK_UNMOUNT)

    def alloc_from_mem_pool(self, size: int) -> int:
        """After ``setup_dummy``: the address of ``size`` bytes of its ``mem_pool_size`` pool,
        registered with the store (``put_from``/``get_into`` on it move no staging copy), kept
        until ``close``; 0 when the pool cannot hold them. 0 after ``setup``, as Mooncake's
        embedded client answers (its pool is the dummy client's shared memory)."""
        _check_ints("size", (size,))
        s = self._session
        if s is None or s.mem_pool is None or size <= 0:
            return 0
        return s.mem_pool.alloc(size)

    def init_all(self, protocol: str, device_name: str, mount_segment_size: int) -> int:
        """Mooncake's one-call setup: ``setup("localhost", ..., mount_segment_size, 1 GiB,
        protocol, device_name, master)``, where the master is ``$KVBRIDGE_MASTER`` if set, else
        Mooncake's fixed ``127.0.0.1:50051``. 0; INVALID_PARAMS when already set up; -1 (logged)
        when the master cannot be reached."""
        if not isinstance(protocol, str) or not isinstance(device_name, str):
            raise TypeError("init_all(): protocol and device_name must be str")
        _check_ints("mount_segment_size", (mount_segment_size,))
        if self._session is not None:
            _log.error("init_all: the store is already set up")
            return int(ErrorCode.INVALID_PARAMS)
        master = os.environ.get("KVBRIDGE_MASTER", "") or "127.0.0.1:50051"
        return self.setup({"local_hostname": "localhost", "metadata_server": "P2PHANDSHAKE",
                           "global_segment_size": mount_segment_size,
                           "local_buffer_size": 1 << 30, "protocol": protocol,
                           "rdma_devices": device_name, "master_server_addr": master})

    def batch_replica_clear(self, keys: list, segment_name: str = "") -> list:
        """Drops the keys' replicas, all of them (``segment_name=""``) or those on one segment
        (``get_hostname()`` of the store holding it): the keys cleared. kvbridge's master keeps
        or drops an object's replicas as a whole, so with a segment a key is cleared only when
        every replica of it lies there (the object goes, as in Mooncake when its last replica
        does); a key with replicas elsewhere too is left alone (logged) and not listed. Mooncake
        skips keys under a read lease; kvbridge clears at once, as its ``remove`` does."""
        _check_keys(keys)
        if not isinstance(segment_name, str):
            raise TypeError(f"segment_name: expected str, got {type(segment_name).__name__}")
        s = self._session
        if s is None or not keys:
            return []
        keys = list(keys)
        if segment_name:
            try:
                found = s.client.batch_replicas(keys)
            except KvbError as e:
                _log.warning("batch_replica_clear: %s", e)
                return []
            whole, mixed = [], []
            for k, res in zip(keys, found):
                held = {str(r.node_id) for r in res.replicas} if res.ok else set()
                if held == {segment_name}:
                    whole.append(k)
                elif segment_name in held:
                    mixed.append(k)
            if mixed:
                _log.warning("batch_replica_clear: %d key(s) also have replicas off %s and "
                             "are left alone (kvbridge drops an object's replicas only as a "
                             "whole), e.g. %r", len(mixed), segment_name, mixed[0])
            keys = whole
        codes = self.batch_remove(keys) if keys else []
        return [k for k, code in zip(keys, codes) if code == 0]

    # -- copy and move tasks (docs/store.md "Copying and moving objects") -------------------
    # Segment names are node ids (get_hostname). A task id is Mooncake's UUID pair: (0, the
    # master's task number); ((0, 0), code) on failure.
    def create_copy_task(self, key: str, targets: list) -> tuple:
        """Copies the object to the segments named: (task id, 0), or ((0, 0), error code)."""
        _check_key(key)
        if isinstance(targets, (str, bytes)) or not all(isinstance(t, str) for t in targets):
            raise TypeError("targets: expected a list of str")
        s = self._session
        if s is None or not targets:
            return (0, 0), int(ErrorCode.INVALID_PARAMS)
        try:
            return (0, s.client.copy_object(key, list(targets))), 0
        except KvbError as e:
            return (0, 0), _code_of(e)

    def create_move_task(self, key: str, source: str, target: str) -> tuple:
        """Moves the object's replica from segment `source` to `target`: (task id, 0), or
        ((0, 0), error code)."""
        _check_key(key)
        for name, v in (("source", source), ("target", target)):
            if not isinstance(v, str):
                raise TypeError(f"{name}: expected str, got {type(v).__name__}")
        s = self._session
        if s is None or not source or not target:
            return (0, 0), int(ErrorCode.INVALID_PARAMS)
        try:
            return (0, s.client.move_object(key, source, target)), 0
        except KvbError as e:
            return (0, 0), _code_of(e)

    def query_task(self, task_id: tuple) -> tuple:
        """(QueryTaskResponse, 0), or (None, error code) for an unknown task."""
        if (not isinstance(task_id, tuple) or len(task_id) != 2 or
                not all(isinstance(x, int) for x in task_id)):
            raise TypeError("task_id: expected a tuple of two ints (a task's UUID)")
        s = self._session
        if s is None:
            return None, int(ErrorCode.INVALID_PARAMS)
        try:
            t = s.client.query_task(task_id[1])
        except KvbError as e:
            return None, _code_of(e)
        r = QueryTaskResponse()
        r.id = task_id
        r.type = TaskType.REPLICA_MOVE if t["move"] else TaskType.REPLICA_COPY
        r.status = getattr(TaskStatus, t["state"])
        r.created_at_ms_epoch = t["created_unix_ms"]
        r.last_updated_at_ms_epoch = t["updated_unix_ms"]
        r.message = t["message"]
        return r, 0

    def get_hostname(self) -> str:
        """The name of this store's segment: what ``transport_endpoint`` says for a replica
        held here (``get_replica_desc``). kvbridge's is the node id, not Mooncake's
        ``host:port``; "" before setup and after close."""
        s = self._session
        return s.node_id if s is not None else ""

    # -- reads into Python buffers and byte ranges ----------------------------------------
    def get_buffer(self, key: str) -> Optional["BufferHandle"]:
        """The object's bytes in a BufferHandle; None when it cannot be read."""
        _check_key(key)
        data = self.get(key)
        return BufferHandle(data) if data else None

    def batch_get_buffer(self, keys: list) -> list:
        """A BufferHandle per key, None for a key that cannot be read."""
        _check_keys(keys)
        return [BufferHandle(v) if v else None for v in self.get_batch(list(keys))]

    def get_into_ranges(self, buffer_ptrs: list, all_keys: list, all_dst_offsets: list,
                        all_src_offsets: list, all_sizes: list) -> list:
        """Copies byte ranges of objects into buffers: for buffer ``i``, key ``j`` and range
        ``k``, ``all_sizes[i][j][k]`` bytes from offset ``all_src_offsets[i][j][k]`` of object
        ``all_keys[i][j]`` to ``buffer_ptrs[i] + all_dst_offsets[i][j][k]``. The same shape
        back: bytes copied per range, or an error (INVALID_PARAMS for a range past the object's
        end or lists of different lengths; the object's error, e.g. OBJECT_NOT_FOUND, for every
        range of a key that cannot be read). Each object is read once, whole."""
        _check_ints("buffer_ptrs", buffer_ptrs)
        for keys in all_keys:
            _check_keys(keys)
        for what, nested in (("all_dst_offsets", all_dst_offsets),
                             ("all_src_offsets", all_src_offsets), ("all_sizes", all_sizes)):
            for per_buffer in nested:
                for per_key in per_buffer:
                    _check_ints(what, per_key)
        invalid = int(ErrorCode.INVALID_PARAMS)
        s = self._session
        n = len(buffer_ptrs)
        if s is None or any(len(x) != n for x in (all_keys, all_dst_offsets, all_src_offsets,
                                                    all_sizes)):
            return [[[invalid]] for _ in range(n)]
        objects: dict = {}  # key -> bytes, or an error code
        for keys in all_keys:
            for k in keys:
                if k not in objects:
                    try:
                        objects[k] = s.client.get(k)
                    except KvbError as e:
                        objects[k] = _code_of(e)
        out = []
        for ptr, keys, dsts, srcs, sizes in zip(buffer_ptrs, all_keys, all_dst_offsets,
                                                all_src_offsets, all_sizes):
            if not len(dsts) == len(srcs) == len(sizes) == len(keys):
                out.append([[invalid] for _ in keys])
                continue
            per_buffer = []
            for k, key_dsts, key_srcs, key_sizes in zip(keys, dsts, srcs, sizes):
                data = objects[k]
                if not len(key_dsts) == len(key_srcs) == len(key_sizes):
                    per_buffer.append([invalid] * len(key_dsts))
                elif isinstance(data, int):
                    per_buffer.append([data] * len(key_dsts))
                else:
                    per_buffer.append([_copy_range(data, ptr, d, o, m)
                                       for d, o, m in zip(key_dsts, key_srcs, key_sizes)])
            out.append(per_buffer)
        return out

    def put_from_with_metadata(self, key: str, buffer_ptr: int, metadata_buffer_ptr: int,
                               size: int, metadata_size: int, config: Any = None) -> int:
        """Stores one object: ``metadata_size`` bytes at ``metadata_buffer_ptr`` followed by
        ``size`` bytes at ``buffer_ptr``, as Mooncake lays it out (a get returns both, the
        metadata first; get_size counts both). No metadata (``metadata_size`` 0) is put_from.
        An existing key succeeds and keeps its bytes, as put. 0 or an error: INVALID_PARAMS
        for a zero pointer with a size or an empty object. Mooncake returns 0 for ``size`` 0
        and stores nothing, not even the metadata (docs/mooncake.md); kvbridge stores the
        metadata. ``config.prefer_alloc_in_same_node`` is ignored, as in every kvbridge put
        (Mooncake refuses it here with -1)."""
        _check_key(key)
        _check_ints("buffer_ptr/metadata_buffer_ptr/size/metadata_size",
                    (buffer_ptr, metadata_buffer_ptr, size, metadata_size))
        _replica_num(config)  # TypeError for a config that is not one
        ranges = [(p, n) for p, n in ((metadata_buffer_ptr, metadata_size), (buffer_ptr, size))
                  if n != 0]
        if not _valid_ranges(ranges):  # a negative size, a zero pointer, nothing to store
            return int(ErrorCode.INVALID_PARAMS)
        return self._batch_put([key], [ranges], config)[0]

    def get_offload_rpc_read_count(self) -> int:
        """Mooncake counts the reads its client made of objects offloaded to a holder's local
        SSD (each a read RPC to that holder). kvbridge's counterpart: keys this store's clients
        read from a replica in a node's SSD tier (the clients' ``get_hits_ssd``; the node
        reads its SSD and sends the bytes). Counted per key, where Mooncake counts one per
        RPC, which may carry several keys of one holder. 0 before setup and after close."""
        s = self._session
        if s is None:
            return 0
        total = 0
        for c in s.clients():
            try:
                total += int(c.stats().get("get_hits_ssd", 0))
            except KvbError:
                pass  # closed meanwhile
        return total

    # -- put and get sessions (Mooncake's layerwise API) -----------------------------------
    # Mooncake's put session reserves objects on its master (batch_put_session_start), writes
    # byte ranges of them straight into the replicas (batch_put_from_multi_buffer_ranges) and
    # makes them readable at batch_put_session_end; its get session looks the replicas up
    # once and holds a read lease on them while ranges are read. kvbridge's store has no
    # reserved-but-unwritten objects and no ranged transfers, so here a put session assembles
    # the object in this process and stores it whole at the end (one upsert, so the session's
    # bytes are what the key holds afterwards, as in Mooncake, where the reservation makes
    # other puts of the key meanwhile no-ops), and a get session reads each object once,
    # whole, at its start and copies ranges out of that copy. The bytes a caller sees are
    # Mooncake's; what differs (memory held in this process, no space reserved, no lease
    # expiry) is in docs/mooncake.md.
    def batch_put_session_start(self, keys: list, sizes: list, config: Any = None) -> list:
        """Opens a put session per key for an object of ``sizes[i]`` bytes, zero-filled until
        written. One result per key: 0, OBJECT_ALREADY_EXISTS for a stored key (and for a
        key's repeats in ``keys``, as Mooncake's master answers), INVALID_PARAMS for a size
        of 0, a key already in a session, lists of different lengths (every key) or
        ``config.group_ids`` not one per key (every key)."""
        _check_keys(keys)
        _check_ints("sizes", sizes)
        profile = _replica_num(config)
        invalid = int(ErrorCode.INVALID_PARAMS)
        s = self._session
        group_ids = getattr(config, "group_ids", None)
        if s is None or len(sizes) != len(keys) or (group_ids is not None
                                                    and len(group_ids) != len(keys)):
            return [invalid] * len(keys)
        if not keys:
            return []
        try:
            s.client_for(profile)  # refuses a profile kvbridge cannot put with, before any start
            stored = s.client.batch_exists(list(keys))
        except KvbError as e:
            return [_code_of(e, master_call=True)] * len(keys)
        results = [invalid] * len(keys)
        started: set = set()
        with s.sessions_lock:
            for i, (k, n) in enumerate(zip(keys, sizes)):
                if k in started or stored[i]:  # a key twice: its first entry holds it
                    results[i] = int(ErrorCode.OBJECT_ALREADY_EXISTS)
                    continue
                if n <= 0 or k in s.put_sessions:
                    continue
                try:
                    s.put_sessions[k] = _PutSession(n, profile)
                except MemoryError:
                    results[i] = int(ErrorCode.NO_AVAILABLE_HANDLE)
                    continue
                started.add(k)
                results[i] = 0
        return results

    def batch_put_from_multi_buffer_ranges(self, keys: list, all_buffer_ptrs: list,
                                           all_sizes: list, all_dst_offsets: list) -> list:
        """Writes, for each key in a put session, ``all_sizes[i][j]`` bytes from
        ``all_buffer_ptrs[i][j]`` (registered or not) at offset ``all_dst_offsets[i][j]`` of
        its object. One result per key: bytes written, or INVALID_PARAMS (no open session,
        lists of different lengths, a zero pointer with a size, a range past the object's
        size: then none of that key's ranges is written). Readable after
        batch_put_session_end."""
        invalid = int(ErrorCode.INVALID_PARAMS)
        entries = self._range_entries(keys, all_buffer_ptrs, all_sizes, all_dst_offsets,
                                      "all_dst_offsets")
        if entries is None:
            return [invalid] * len(keys)
        s = self._session
        if s is None:
            return [invalid] * len(keys)
        results = [invalid] * len(keys)
        for i, (k, ranges) in enumerate(zip(keys, entries)):
            with s.sessions_lock:
                entry = s.put_sessions.get(k)
            if entry is None or ranges is None:
                continue
            with entry.lock:
                if not entry.open or not _ranges_fit(ranges, len(entry.data)):
                    continue
                base = _address_of(entry.data)
                for ptr, n, off in ranges:
                    if n:
                        ctypes.memmove(base + off, ptr, n)
                results[i] = sum(n for _, n, _ in ranges)
        return results

    def batch_put_session_end(self, keys: list) -> list:
        """Stores each session's object and closes the session. One result per key: 0, or
        INVALID_PARAMS for a key in no session, or the put's error (the session then stays,
        for another end or a revoke, as in Mooncake). A key given twice is stored once; both
        entries get its result, as in Mooncake."""
        _check_keys(keys)
        invalid = int(ErrorCode.INVALID_PARAMS)
        s = self._session
        if s is None:
            return [invalid] * len(keys)
        results = [invalid] * len(keys)
        by_profile: dict[_PutProfile, list] = {}
        first: dict = {}  # key -> index of its first entry; a repeat gets that one's result
        with s.sessions_lock:
            for i, k in enumerate(keys):
                if k in first:
                    continue
                first[k] = i
                entry = s.put_sessions.get(k)
                if entry is not None and entry.open:
                    entry.open = False  # no more writes
                    by_profile.setdefault(entry.profile, []).append((i, k, entry))
        for profile, items in by_profile.items():
            for _, _, entry in items:  # writes that started before the close finish first
                with entry.lock:
                    pass
            try:
                client = s.client_for(profile)
                codes = self._staged_put(s, client, [k for _, k, _ in items],
                                         [memoryview(e.data) for _, _, e in items], upsert=True)
            except KvbError as e:
                codes = [_code_of(e)] * len(items)
            with s.sessions_lock:
                for (i, k, entry), code in zip(items, codes):
                    results[i] = code
                    if code == 0:
                        if s.put_sessions.get(k) is entry:
                            del s.put_sessions[k]
                    else:
                        entry.open = True
        return [results[first[k]] for k in keys]

    def batch_put_session_revoke(self, keys: list) -> list:
        """Drops each key's put session; nothing is stored. One result per key: 0 (for every
        entry of a key given twice), or INVALID_PARAMS for a key in no session."""
        _check_keys(keys)
        invalid = int(ErrorCode.INVALID_PARAMS)
        s = self._session
        if s is None:
            return [invalid] * len(keys)
        results = [invalid] * len(keys)
        revoked: set = set()
        with s.sessions_lock:
            for i, k in enumerate(keys):
                entry = s.put_sessions.pop(k, None)
                if entry is not None:
                    with entry.lock:
                        entry.open = False
                    revoked.add(k)
                if k in revoked:  # a key twice: revoked by its first entry
                    results[i] = 0
        return results

    def batch_get_session_start(self, keys: list) -> list:
        """Opens a get session per key: the object is read once, whole, into this process,
        and ranged reads copy from that copy (so they see the object as it was here, as
        Mooncake's lease keeps its replica). A key already in a session is read again. One
        result per key: 0 or the read's error (OBJECT_NOT_FOUND)."""
        _check_keys(keys)
        s = self._session
        if s is None:
            return [int(ErrorCode.INVALID_PARAMS)] * len(keys)
        # One size lookup and batched reads through the staging area (get_batch's path), not
        # a read per key: a layerwise connector opens sessions for a whole request's pages.
        sizes = self._sizes(s, list(keys))
        present = [i for i, n in enumerate(sizes) if n > 0]
        got = dict(zip(present, self.get_batch([keys[i] for i in present]) if present else []))
        results = []
        for i, k in enumerate(keys):
            data = got.get(i) or None
            code = sizes[i] if sizes[i] < 0 else 0
            if data is None and code == 0:  # removed or replaced meanwhile: ask alone
                try:
                    data = s.client.get(k)
                except KvbError as e:
                    code = _code_of(e)
            with s.sessions_lock:
                if data is None:
                    s.get_sessions.pop(k, None)
                else:
                    s.get_sessions[k] = data
            results.append(code)
        return results

    def batch_get_into_multi_buffer_ranges(self, keys: list, all_buffer_ptrs: list,
                                           all_sizes: list, all_src_offsets: list) -> list:
        """Copies, for each key in a get session, ``all_sizes[i][j]`` bytes from offset
        ``all_src_offsets[i][j]`` of its object to ``all_buffer_ptrs[i][j]`` (registered or
        not). One result per key: bytes copied, or INVALID_PARAMS (no session, lists of
        different lengths, a zero pointer with a size, a range past the object's end: then
        nothing of that key is copied)."""
        invalid = int(ErrorCode.INVALID_PARAMS)
        entries = self._range_entries(keys, all_buffer_ptrs, all_sizes, all_src_offsets,
                                      "all_src_offsets")
        s = self._session
        if entries is None or s is None:
            return [invalid] * len(keys)
        results = [invalid] * len(keys)
        for i, (k, ranges) in enumerate(zip(keys, entries)):
            with s.sessions_lock:
                data = s.get_sessions.get(k)
            if data is None or ranges is None or not _ranges_fit(ranges, len(data)):
                continue
            base = _address_of(data)
            for ptr, n, off in ranges:
                if n:
                    ctypes.memmove(ptr, base + off, n)
            results[i] = sum(n for _, n, _ in ranges)
        return results

    def batch_get_session_end(self, keys: list) -> int:
        """Drops the keys' get sessions (keys in none are fine). 0."""
        _check_keys(keys)
        s = self._session
        if s is not None:
            with s.sessions_lock:
                for k in keys:
                    s.get_sessions.pop(k, None)
        return 0

    @staticmethod
    def _range_entries(keys: Any, all_ptrs: Any, all_sizes: Any, all_offsets: Any,
                       offsets_name: str) -> Optional[list]:
        """Per key its (pointer, size, offset) ranges, None for a key whose lists differ in
        length or that has a zero pointer with a size; None for all when the outer lists do
        not match the keys."""
        _check_keys(keys)
        for what, nested in (("all_buffer_ptrs", all_ptrs), ("all_sizes", all_sizes),
                             (offsets_name, all_offsets)):
            for per_key in nested:
                _check_ints(what, per_key)
        if not len(all_ptrs) == len(all_sizes) == len(all_offsets) == len(keys):
            return None
        out: list = []
        for ptrs, sizes, offsets in zip(all_ptrs, all_sizes, all_offsets):
            ranges = list(zip(ptrs, sizes, offsets))
            ok = (len(ptrs) == len(sizes) == len(offsets)
                  and all(n >= 0 and off >= 0 and (p > 0 or n == 0) for p, n, off in ranges))
            out.append(ranges if ok else None)
        return out

    # -- tensors ---------------------------------------------------------------------------
    # Mooncake's tensor API. A tensor is one object, [304-byte header][data] in Mooncake's own
    # layout (_mooncake_tensor: dtype, shapes, shard axes), so buffers and objects move
    # between the two implementations unchanged. A put assembles each object once (one copy
    # of the tensor) and sends them through the staging area in batches, as put_batch does:
    # 128 tensors of 64 KiB took 11-26 ms that way, 68-90 ms as one put per tensor. Bad input
    # (not a tensor, a dtype Mooncake has no number for, more than 8 dims, a header that does
    # not match its buffer) is refused with INVALID_PARAMS before anything is written.
    def put_tensor(self, key: str, tensor: Any) -> int:
        """Stores a torch tensor (any device; a non-contiguous one as its contiguous copy).
        An existing key succeeds and keeps its value, as ``put``. 0 or an error."""
        return self._put_tensors([key], [tensor], None, upsert=False)[0]

    def upsert_tensor(self, key: str, tensor: Any) -> int:
        """put_tensor that replaces an existing key's value, as ``upsert``. 0 or an error."""
        return self._put_tensors([key], [tensor], None, upsert=True)[0]

    def pub_tensor(self, key: str, tensor: Any, config: Any = None) -> int:
        """put_tensor with a ReplicateConfig (``replica_num`` honoured). 0 or an error."""
        return self._put_tensors([key], [tensor], config, upsert=False)[0]

    def upsert_pub_tensor(self, key: str, tensor: Any, config: Any = None) -> int:
        """upsert_tensor with a ReplicateConfig. 0 or an error."""
        return self._put_tensors([key], [tensor], config, upsert=True)[0]

    def batch_put_tensor(self, keys: list, tensors_list: list) -> list:
        """put_tensor per key: one 0 or error per key (a bad tensor fails only its key). Of a
        key given twice the first tensor stays, as in ``batch_put_from``."""
        return self._put_tensors(keys, tensors_list, None, upsert=False)

    def batch_upsert_tensor(self, keys: list, tensors_list: list) -> list:
        """upsert_tensor per key; of a key given twice the last tensor stays."""
        return self._put_tensors(keys, tensors_list, None, upsert=True)

    def batch_pub_tensor(self, keys: list, tensors_list: list, config: Any = None) -> list:
        """batch_put_tensor with a ReplicateConfig."""
        return self._put_tensors(keys, tensors_list, config, upsert=False)

    def batch_upsert_pub_tensor(self, keys: list, tensors_list: list,
                                config: Any = None) -> list:
        """batch_upsert_tensor with a ReplicateConfig."""
        return self._put_tensors(keys, tensors_list, config, upsert=True)

    def get_tensor(self, key: str) -> Any:
        """The tensor stored under key (a CPU tensor owning its memory), or None when the key
        cannot be read or its object is not a tensor object."""
        _check_key(key)
        s = self._session
        if s is None:
            return None
        try:
            data = s.client.get(key)
        except KvbError:
            return None
        return _tensor_of(data, key)

    def batch_get_tensor(self, keys: list) -> list:
        """get_tensor per key (through the staging area, as ``get_batch``): a tensor or None."""
        _check_keys(keys)
        if self._session is None:
            return [None] * len(keys)
        return [_tensor_of(d, k) if d else None for k, d in zip(keys, self.get_batch(keys))]

    def get_tensor_into(self, key: str, buffer_ptr: int, size: int) -> Any:
        """Reads the object, header and data, into [buffer_ptr, buffer_ptr + size) and returns a
        tensor over the data in that buffer (no copy, not owning it: the buffer must outlive
        it); None when the key cannot be read, the buffer is smaller than the object (left
        untouched then) or the object is not a tensor object."""
        _check_key(key)
        _check_ints("buffer_ptr/size", (buffer_ptr, size))
        if self._session is None or buffer_ptr <= 0:
            return None
        return _tensor_in_buffer(self.get_into(key, buffer_ptr, size), buffer_ptr, key)

    def batch_get_tensor_into(self, keys: list, buffer_ptrs: list, sizes: list) -> list:
        """get_tensor_into per key: a tensor over its buffer, or None. Lists of different
        lengths, a zero pointer or no setup: INVALID_PARAMS for every key (Mooncake's answer)."""
        _check_keys(keys)
        _check_ints("buffer_ptrs", buffer_ptrs)
        _check_ints("sizes", sizes)
        if self._session is None or len(buffer_ptrs) != len(keys) or \
                len(sizes) != len(keys) or any(p <= 0 for p in buffer_ptrs):
            return [int(ErrorCode.INVALID_PARAMS)] * len(keys)
        got = self.batch_get_into(keys, buffer_ptrs, sizes)
        return [_tensor_in_buffer(n, p, k) for k, p, n in zip(keys, buffer_ptrs, got)]

    def put_tensor_from(self, key: str, buffer_ptr: int, size: int) -> int:
        """Stores a buffer laid out as an object is, [header][data] (what get_tensor_into
        fills): INVALID_PARAMS unless the header is valid for exactly ``size`` bytes."""
        return self._put_tensor_from(key, buffer_ptr, size, upsert=False)

    def upsert_tensor_from(self, key: str, buffer_ptr: int, size: int) -> int:
        """put_tensor_from that replaces an existing key's value."""
        return self._put_tensor_from(key, buffer_ptr, size, upsert=True)

    def batch_put_tensor_from(self, keys: list, buffer_ptrs: list, sizes: list) -> list:
        """put_tensor_from per key. One invalid buffer refuses the whole batch (INVALID_PARAMS
        for every key, nothing written), as Mooncake checks every header first."""
        return self._batch_put_tensor_from(keys, buffer_ptrs, sizes, upsert=False)

    def batch_upsert_tensor_from(self, keys: list, buffer_ptrs: list, sizes: list) -> list:
        """upsert_tensor_from per key, checked as batch_put_tensor_from."""
        return self._batch_put_tensor_from(keys, buffer_ptrs, sizes, upsert=True)

    # Tensor parallelism: a put stores every shard, ``<key>_tp_<rank>`` for rank 0..tp_size-1,
    # the tensor cut into tp_size equal parts along split_dim (a dimension tp_size does not
    # divide is INVALID_PARAMS); tp_rank names the caller and changes nothing on a put. A get
    # reads rank tp_rank's shard (split_dim is not needed). tp_size <= 1 is the plain call on
    # the key itself, as in Mooncake.
    def put_tensor_with_tp(self, key: str, tensor: Any, tp_rank: int = 0, tp_size: int = 1,
                           split_dim: int = 0) -> int:
        """Stores every TP shard of tensor. 0, or the first shard's error."""
        return self.pub_tensor_with_tp(key, tensor, None, tp_rank, tp_size, split_dim)

    def pub_tensor_with_tp(self, key: str, tensor: Any, config: Any = None, tp_rank: int = 0,
                           tp_size: int = 1, split_dim: int = 0) -> int:
        """put_tensor_with_tp with a ReplicateConfig."""
        _check_key(key)
        _check_ints("tp_rank/tp_size/split_dim", (tp_rank, tp_size, split_dim))
        if tp_size <= 1:
            return self.pub_tensor(key, tensor, config)
        return self._put_tp([key], [tensor], config, tp_size, split_dim)[0]

    def batch_put_tensor_with_tp(self, base_keys: list, tensors_list: list, tp_rank: int = 0,
                                 tp_size: int = 1, split_dim: int = 0) -> list:
        """put_tensor_with_tp per key: 0 or an error per key (a bad tensor fails only its
        key)."""
        return self.batch_pub_tensor_with_tp(base_keys, tensors_list, None, tp_rank, tp_size,
                                             split_dim)

    def batch_pub_tensor_with_tp(self, base_keys: list, tensors_list: list, config: Any = None,
                                 tp_rank: int = 0, tp_size: int = 1,
                                 split_dim: int = 0) -> list:
        """batch_put_tensor_with_tp with a ReplicateConfig."""
        _check_keys(base_keys)
        _check_ints("tp_rank/tp_size/split_dim", (tp_rank, tp_size, split_dim))
        if tp_size <= 1:
            return self.batch_pub_tensor(base_keys, tensors_list, config)
        return self._put_tp(base_keys, tensors_list, config, tp_size, split_dim)

    def get_tensor_with_tp(self, key: str, tp_rank: int = 0, tp_size: int = 1,
                           split_dim: int = 0) -> Any:
        """Rank tp_rank's shard (get_tensor of ``<key>_tp_<tp_rank>``), or None."""
        _check_ints("tp_rank/tp_size/split_dim", (tp_rank, tp_size, split_dim))
        return self.get_tensor(_tp_key(key, tp_rank, tp_size))

    def batch_get_tensor_with_tp(self, base_keys: list, tp_rank: int = 0,
                                 tp_size: int = 1) -> list:
        """get_tensor_with_tp per key."""
        _check_keys(base_keys)
        _check_ints("tp_rank/tp_size", (tp_rank, tp_size))
        return self.batch_get_tensor([_tp_key(k, tp_rank, tp_size) for k in base_keys])

    def get_tensor_with_tp_into(self, key: str, buffer_ptr: int, size: int, tp_rank: int = 0,
                                tp_size: int = 1, split_dim: int = 0) -> Any:
        """get_tensor_into of rank tp_rank's shard."""
        _check_ints("tp_rank/tp_size/split_dim", (tp_rank, tp_size, split_dim))
        return self.get_tensor_into(_tp_key(key, tp_rank, tp_size), buffer_ptr, size)

    def batch_get_tensor_with_tp_into(self, base_keys: list, buffer_ptrs: list, sizes: list,
                                      tp_rank: int = 0, tp_size: int = 1) -> list:
        """batch_get_tensor_into of rank tp_rank's shards (None per key without setup, as in
        Mooncake)."""
        _check_keys(base_keys)
        _check_ints("tp_rank/tp_size", (tp_rank, tp_size))
        if self._session is None:
            return [None] * len(base_keys)
        return self.batch_get_tensor_into([_tp_key(k, tp_rank, tp_size) for k in base_keys],
                                          buffer_ptrs, sizes)

    def put_tensor_with_tp_from(self, key: str, buffer_ptr: int, size: int, tp_rank: int = 0,
                                tp_size: int = 1, split_dim: int = 0) -> int:
        """put_tensor_with_tp of the whole tensor in a [header][data] buffer."""
        _check_key(key)
        _check_ints("buffer_ptr/size/tp_rank/tp_size/split_dim",
                    (buffer_ptr, size, tp_rank, tp_size, split_dim))
        if self._session is None or buffer_ptr <= 0 or size < _tensor.HEADER_BYTES:
            return int(ErrorCode.INVALID_PARAMS)
        if tp_size <= 1:
            return self.put_tensor_from(key, buffer_ptr, size)
        tensor = _tensor_in_buffer(size, buffer_ptr, key)
        if tensor is None:
            return int(ErrorCode.INVALID_PARAMS)
        return self._put_tp([key], [tensor], None, tp_size, split_dim)[0]

    def batch_put_tensor_with_tp_from(self, base_keys: list, buffer_ptrs: list, sizes: list,
                                      tp_rank: int = 0, tp_size: int = 1,
                                      split_dim: int = 0) -> list:
        """put_tensor_with_tp_from per key; unlike batch_put_tensor_from (and as in Mooncake)
        an invalid buffer fails only its key."""
        _check_keys(base_keys)
        _check_ints("buffer_ptrs", buffer_ptrs)
        _check_ints("sizes", sizes)
        _check_ints("tp_rank/tp_size/split_dim", (tp_rank, tp_size, split_dim))
        invalid = int(ErrorCode.INVALID_PARAMS)
        if self._session is None:
            return [invalid] * len(base_keys)
        if tp_size <= 1:
            return self.batch_put_tensor_from(base_keys, buffer_ptrs, sizes)
        if len(buffer_ptrs) != len(base_keys) or len(sizes) != len(base_keys):
            return [invalid] * len(base_keys)
        tensors = [_tensor_in_buffer(n, p, k) if p > 0 and n >= _tensor.HEADER_BYTES else None
                   for k, p, n in zip(base_keys, buffer_ptrs, sizes)]
        return self._put_tp(base_keys, tensors, None, tp_size, split_dim)

    # The parallelism forms (Mooncake 0.3.13). With no layout (``parallelism``, ``target`` or
    # ``writer_partition`` None) they store and read whole tensors, exactly as the plain tensor
    # calls (with a ReplicateConfig), which is what the wheel does on that route. A layout with
    # a TP axis is the wheel's: with that axis alone the tensor put is rank r's shard, stored
    # under ``<key>_tp_<r>`` (the TP forms' shard objects); with DP, EP or PP axes too it is the
    # whole tensor, and rank r's part is stored under a key naming every axis (_Layout); both
    # write a ``<key>__parallelism_manifest``. Reads in mode "shard" or "full" reshard from the
    # stored shards to the TP layout asked for; mode "as_stored" with a layout reads the object
    # stored for exactly that layout. A layout without a TP axis stores the whole tensor under
    # a key naming its axes. A writer partition (a ParallelAxis) stores rank r's cut of the
    # whole tensor under ``<key>__writer_<r>of<n>_sd<d>`` with a ``<key>__writer_manifest``.
    # The ``_into`` reads write what the plain reads return into the caller's buffer.
    def put_tensor_with_parallelism(self, key: str, tensor: Any, parallelism: Any = None,
                                    config: Any = None, writer_partition: Any = None) -> int:
        """put_tensor with a ReplicateConfig, or the tensor's part for a layout (a
        TensorParallelism or a writer partition). 0 or an error."""
        return self._put_parallel("put_tensor_with_parallelism", [key], [tensor], [parallelism],
                                  config, writer_partition, upsert=False)[0]

    def upsert_tensor_with_parallelism(self, key: str, tensor: Any, parallelism: Any = None,
                                       config: Any = None, writer_partition: Any = None) -> int:
        """upsert_tensor with a ReplicateConfig, or the tensor's part for a layout. 0 or an
        error."""
        return self._put_parallel("upsert_tensor_with_parallelism", [key], [tensor],
                                  [parallelism], config, writer_partition, upsert=True)[0]

    def put_tensor_with_parallelism_from(self, key: str, buffer_ptr: int, size: int,
                                         parallelism: Any = None, config: Any = None,
                                         writer_partition: Any = None) -> int:
        """put_tensor_from with a ReplicateConfig, or the buffer's tensor with a layout."""
        return self._batch_parallel_from("put_tensor_with_parallelism_from", [key],
                                         [buffer_ptr], [size], [parallelism], config,
                                         [writer_partition], upsert=False)[0]

    def upsert_tensor_with_parallelism_from(self, key: str, buffer_ptr: int, size: int,
                                            parallelism: Any = None, config: Any = None,
                                            writer_partition: Any = None) -> int:
        """upsert_tensor_from with a ReplicateConfig, or the buffer's tensor with a layout."""
        return self._batch_parallel_from("upsert_tensor_with_parallelism_from", [key],
                                         [buffer_ptr], [size], [parallelism], config,
                                         [writer_partition], upsert=True)[0]

    def batch_put_tensor_with_parallelism(self, keys: list, tensors_list: list,
                                          parallelisms: Any = None, config: Any = None,
                                          writer_partitions: Any = None) -> list:
        """put_tensor_with_parallelism per key: one 0 or error per key."""
        return self._put_parallel("batch_put_tensor_with_parallelism", keys, tensors_list,
                                  parallelisms, config, writer_partitions, upsert=False)

    def batch_upsert_tensor_with_parallelism(self, keys: list, tensors_list: list,
                                             parallelisms: Any = None, config: Any = None,
                                             writer_partitions: Any = None) -> list:
        """upsert_tensor_with_parallelism per key: one 0 or error per key."""
        return self._put_parallel("batch_upsert_tensor_with_parallelism", keys, tensors_list,
                                  parallelisms, config, writer_partitions, upsert=True)

    def batch_put_tensor_with_parallelism_from(self, keys: list, buffer_ptrs: list, sizes: list,
                                               parallelisms: Any = None, config: Any = None,
                                               writer_partitions: Any = None) -> list:
        """put_tensor_with_parallelism_from per key."""
        return self._batch_parallel_from("batch_put_tensor_with_parallelism_from", keys,
                                         buffer_ptrs, sizes, parallelisms, config,
                                         writer_partitions, upsert=False)

    def batch_upsert_tensor_with_parallelism_from(self, keys: list, buffer_ptrs: list,
                                                  sizes: list, parallelisms: Any = None,
                                                  config: Any = None,
                                                  writer_partitions: Any = None) -> list:
        """upsert_tensor_with_parallelism_from per key."""
        return self._batch_parallel_from("batch_upsert_tensor_with_parallelism_from", keys,
                                         buffer_ptrs, sizes, parallelisms, config,
                                         writer_partitions, upsert=True)

    def get_tensor_with_parallelism(self, key: str, target: Any = None) -> Any:
        """get_tensor, or what a ReadTarget asks for: mode "shard" the part of the tensor its
        layout gives its TP rank, resharded from the stored shards; "full" all of it;
        "as_stored" the object stored for exactly that layout. None when it cannot be read."""
        return self._get_parallel("get_tensor_with_parallelism", [key], [target])[0]

    def get_tensor_with_parallelism_into(self, key: str, buffer_ptr: int, size: int,
                                         target: Any = None) -> Any:
        """get_tensor_into (no layout); with a layout, what get_tensor_with_parallelism reads,
        written into the buffer as a tensor object (header, then data) and returned as a
        tensor over the buffer's data; None when it cannot be read or does not fit (the
        buffer untouched then)."""
        return self.batch_get_tensor_with_parallelism_into([key], [buffer_ptr], [size],
                                                           [target])[0]

    def batch_get_tensor_with_parallelism(self, keys: list, targets: Any = None) -> list:
        """get_tensor_with_parallelism per key (``targets``: None, or one per key)."""
        _check_keys(keys)
        if _no_layouts(targets):
            return self.batch_get_tensor(keys)
        return self._get_parallel("batch_get_tensor_with_parallelism", keys, targets)

    def batch_get_tensor_with_parallelism_into(self, keys: list, buffer_ptrs: list, sizes: list,
                                               targets: Any = None) -> list:
        """get_tensor_with_parallelism_into per key (``targets``: None, or one per key)."""
        _check_keys(keys)
        per_key = _per_key(targets, len(keys))
        if per_key is None or all(_read_layout(t) is None for t in per_key):
            return self.batch_get_tensor_into(keys, buffer_ptrs, sizes)
        _check_ints("buffer_ptrs", buffer_ptrs)
        _check_ints("sizes", sizes)
        if len(buffer_ptrs) != len(keys) or len(sizes) != len(keys):
            return [None] * len(keys)
        out = []
        for k, p, n, t in zip(keys, buffer_ptrs, sizes, per_key):
            if _read_layout(t) is None:
                out.append(self.get_tensor_into(k, p, n))
                continue
            got = self._get_parallel("get_tensor_with_parallelism_into", [k], [t])[0]
            out.append(None if got is None else _tensor_to_buffer(got, p, n, k))
        return out

    def _put_parallel(self, what: str, keys: list, tensors: Any, parallelisms: Any,
                      config: Any, writer_partitions: Any, upsert: bool) -> list:
        """Per key: the whole tensor (no layout), or its shard for its layout (a
        TensorParallelism or a writer partition) and the layout's manifest."""
        _check_keys(keys)
        invalid = int(ErrorCode.INVALID_PARAMS)
        layouts = _per_key(parallelisms, len(keys))
        writers = _per_key(writer_partitions, len(keys))
        if self._session is None or layouts is None or writers is None or \
                len(tensors) != len(keys):
            return [invalid] * len(keys)
        put_keys, objects, manifests = [], [], []  # manifests: (key index, key, bytes)
        for i, (k, t, p, w) in enumerate(zip(keys, tensors, layouts, writers)):
            put_keys.append(k)
            try:
                if p is not None and w is not None:
                    _log.error("%s: writer_partition cannot be combined with parallelism", what)
                    raise _InvalidLayout
                tp = _parallel_layout(what, p) if w is None else _writer_layout(what, w)
            except _InvalidLayout:
                objects.append(None)  # refused: INVALID_PARAMS
                continue
            whole = _tensor_object(t, k)
            if tp is None or whole is None:
                objects.append(whole)
                continue
            shard = _layout_shard_object(whole[1], k, tp)
            if shard is None:
                objects.append(None)
                continue
            put_keys[-1], header, data, whole_shape = shard
            objects.append((header, data))
            if tp.has_tp:
                manifests.append((i, tp.manifest_key(k), _tensor.manifest(
                    _tensor.dtype_number(data.dtype), whole_shape, tp.split_dim, tp.size)))
        results = self._put_tensor_objects(put_keys, objects, config, upsert)
        # Each rank's put writes the manifest too (the same bytes from every rank of one layout:
        # an upsert), once per key in a batch.
        by_key: dict = {}
        for i, name, data in manifests:
            if results[i] == 0:
                by_key.setdefault(name, (data, []))[1].append(i)
        if by_key:
            s = self._session
            try:
                codes = self._staged_put(s, s.client_for(_replica_num(config)), list(by_key),
                                         [data for data, _ in by_key.values()], True)
            except KvbError as e:
                codes = [_code_of(e)] * len(by_key)
            for (_, owners), code in zip(by_key.values(), codes):
                for i in owners:
                    results[i] = code
        return results

    def _batch_parallel_from(self, what: str, keys: list, buffer_ptrs: list, sizes: list,
                             parallelisms: Any, config: Any, writer_partitions: Any,
                             upsert: bool) -> list:
        if _no_layouts(parallelisms) and _no_layouts(writer_partitions):
            return self._batch_put_tensor_from(keys, buffer_ptrs, sizes, upsert=upsert,
                                               config=config)
        return self._put_parallel_from(what, keys, buffer_ptrs, sizes, parallelisms, config,
                                       writer_partitions, upsert=upsert)

    def _put_parallel_from(self, what: str, keys: list, buffer_ptrs: list, sizes: list,
                           parallelisms: Any, config: Any, writer_partitions: Any,
                           upsert: bool) -> list:
        """_put_parallel of the tensors the buffers hold (tensor objects, header first)."""
        _check_keys(keys)
        _check_ints("buffer_ptrs", buffer_ptrs)
        _check_ints("sizes", sizes)
        if len(buffer_ptrs) != len(keys) or len(sizes) != len(keys):
            return [int(ErrorCode.INVALID_PARAMS)] * len(keys)
        tensors = [_tensor_in_buffer(n, p, k) if p > 0 and n >= _tensor.HEADER_BYTES else None
                   for k, p, n in zip(keys, buffer_ptrs, sizes)]
        return self._put_parallel(what, keys, tensors, parallelisms, config, writer_partitions,
                                  upsert)

    def _get_parallel(self, what: str, keys: list, targets: Any) -> list:
        _check_keys(keys)
        per_key = _per_key(targets, len(keys))
        if per_key is None or self._session is None:
            return [None] * len(keys)
        out = []
        for k, target in zip(keys, per_key):
            try:
                read = _read_target(what, target)
            except _InvalidLayout:
                out.append(None)
                continue
            if read is None:
                out.append(self.get_tensor(k))
            elif read[0] == "as_stored":  # the object stored for exactly that layout
                out.append(self.get_tensor(read[1].own_key(k)))
            elif read[1] is None:
                out.append(None)  # "shard" or "full" without a layout: nothing to reshard to
            else:
                out.append(self._reshard(k, read[0], read[1]))
        return out

    def _reshard(self, key: str, mode: str, layout: _Layout) -> Any:
        """The part of key's TP-sharded tensor that TP rank `layout.rank` of `layout.size`
        holds along its split_dim ("shard"), or all of it ("full"), from the stored shards of
        the layout's other axes; None (logged) when the shards cannot be read, disagree, or do
        not cut evenly into the layout."""
        import torch

        if not layout.has_tp:  # the whole tensor of these axes, read as it is
            if mode == "full":
                _log.error("%s: a full read needs a TP axis", key)
                return None
            return self.get_tensor(layout.own_key(key))
        if layout.several:
            # The stored TP size and split: the manifest's (the shards' keys name them).
            try:
                m = _tensor.parse_manifest(self._session.client.get(layout.manifest_key(key)))
            except KvbError:
                m = None
            if m is None:
                _log.error("%s: no parallelism manifest to reshard from", key)
                return None
            stored_size, stored_dim = m[3], m[2]
        else:
            stored_size, stored_dim = 0, 0  # from shard 0's header
        got = self._read_shard(layout.shard_key(key, 0, stored_size, stored_dim))
        if got is None:
            _log.error("%s: no TP shard 0 to reshard from", key)
            return None
        meta0, first = got
        _kind, _i, _r, stored, dim, _r0, _ext = _tp_axis_of(meta0)
        if layout.several and (stored, dim) != (stored_size, stored_dim):
            _log.error("%s: shard 0 disagrees with the manifest", key)
            return None
        extent = meta0.global_shape[dim]
        if mode == "full":
            lo, hi = 0, extent
        elif layout.split_dim != dim or extent % layout.size:
            _log.error("%s: stored in %d shards along dim %d of shape %s; a TP layout of %d "
                       "along dim %d does not cut it evenly", key, stored, dim,
                       list(meta0.global_shape), layout.size, layout.split_dim)
            return None
        else:
            lo = layout.rank * extent // layout.size
            hi = (layout.rank + 1) * extent // layout.size
        step = extent // stored
        parts = []
        for s in range(lo // step, max(lo, hi - 1) // step + 1):
            got = (meta0, first) if s == 0 else self._read_shard(
                layout.shard_key(key, s, stored, dim))
            if got is None or not _same_tp_layout(got[0], meta0, s, step):
                _log.error("%s: TP shard %d of %d is missing or disagrees with shard 0", key, s,
                           stored)
                return None
            begin, end = max(lo, s * step) - s * step, min(hi, (s + 1) * step) - s * step
            parts.append(got[1].narrow(dim, begin, end - begin))
        return torch.cat(parts, dim=dim) if len(parts) > 1 else parts[0].clone()

    def _read_shard(self, key: str) -> Optional[tuple]:
        """(header, tensor) of a TP shard object (one TP axis, maybe others), or None."""
        try:
            data = self._session.client.get(key)
        except KvbError:
            return None
        meta = _tensor.parse(bytes(data[:_tensor.HEADER_BYTES]), len(data))
        tp = None if meta is None or meta.layout != _tensor.LAYOUT_SHARD else _tp_axis_of(meta)
        if tp is None or not 0 <= tp[4] < len(meta.shape) or meta.global_shape[tp[4]] % tp[3]:
            return None  # not a TP shard, or not an even cut
        return meta, _tensor_of(data, key)

    # Mooncake's CUDA forms fill CUDA tensors through CUDA IPC handles that its standalone
    # client daemon (mooncake_client, dummy-client mode) opens; outside that mode the wheel
    # answers INVALID_PARAMS. kvbridge has no such daemon, and no GPU build of this layer.
    def get_tensor_into_cuda(self, key: str, tensor: Any) -> int:
        """Not supported: raises MooncakeNotSupportedError (get_tensor, then ``.to(device)``)."""
        not_supported("get_tensor_into_cuda", _NO_CUDA_IPC)

    def batch_get_tensor_into_cuda(self, keys: list, tensors_list: list) -> list:
        """Not supported: raises MooncakeNotSupportedError (batch_get_tensor, then
        ``.to(device)``)."""
        not_supported("batch_get_tensor_into_cuda", _NO_CUDA_IPC)

    def save_tensor_to_safetensor(self, key: str, file_name: Optional[str] = None) -> int:
        """Writes the tensor under key to a safetensors file (``file_name``, else the key as a
        path), the tensor named ``key`` in it. 0; FILE_NOT_FOUND when the key cannot be read as
        a tensor; INVALID_PARAMS when the file cannot be written. Written by kvbridge itself:
        the ``safetensors`` package is not needed (Mooncake's needs it)."""
        _check_key(key)
        if file_name is not None and not isinstance(file_name, str):
            raise TypeError(f"file_name: expected str, got {type(file_name).__name__}")
        s = self._session
        if s is None:
            return int(ErrorCode.INVALID_PARAMS)
        try:
            data = s.client.get(key)
        except KvbError:
            data = b""
        meta = _tensor.parse(data[:_tensor.HEADER_BYTES], len(data))
        if meta is None:
            _log.error("save_tensor_to_safetensor: no tensor under %r", key)
            return int(ErrorCode.FILE_NOT_FOUND)
        path = key if file_name is None else file_name
        try:
            with open(path, "wb") as f:
                f.write(_tensor.safetensors_bytes(key, meta.dtype, meta.shape,
                                                  data[_tensor.HEADER_BYTES:]))
        except OSError as e:
            _log.error("save_tensor_to_safetensor: %s", e)
            return int(ErrorCode.INVALID_PARAMS)
        return 0

    def load_tensor_from_safetensor(self, key: Optional[str] = None,
                                    file_name: Optional[str] = None) -> Any:
        """Reads a safetensors file and stores one of its tensors with put_tensor under
        ``key`` (else under ``file_name``): the tensor named ``key`` if the file has it, else
        its first tensor (logged). Returns that tensor, or None when the file cannot be read or
        the put fails (an existing key is kept, as put_tensor does, and the file's tensor is
        still returned)."""
        if file_name is None:
            raise TypeError("load_tensor_from_safetensor() missing required argument "
                            "'file_name'")
        if not isinstance(file_name, str):
            raise TypeError(f"file_name: expected str, got {type(file_name).__name__}")
        if key is not None:
            _check_key(key)
        if self._session is None:
            return None
        try:
            with open(file_name, "rb") as f:
                entries = _tensor.safetensors_entries(f.read())
        except (OSError, ValueError) as e:
            _log.error("load_tensor_from_safetensor: %s: %s", file_name, e)
            return None
        if not entries:
            _log.error("load_tensor_from_safetensor: no tensors in %s", file_name)
            return None
        target = file_name if key is None else key
        name = target if key is not None and key in entries else next(iter(entries))
        if key is not None and name != key:
            _log.warning("load_tensor_from_safetensor: %r is not in %s; using its first "
                         "tensor %r", key, file_name, name)
        dtype, shape, data = entries[name]
        tensor = _new_tensor(dtype, shape, data)
        rc = self.put_tensor(target, tensor)
        if rc != 0:
            _log.error("load_tensor_from_safetensor: put_tensor(%r) returned %d", target, rc)
            return None
        return tensor

    def _put_tensors(self, keys: list, tensors: Any, config: Any, upsert: bool) -> list:
        _check_keys(keys)
        invalid = int(ErrorCode.INVALID_PARAMS)
        if self._session is None or len(tensors) != len(keys):
            return [invalid] * len(keys)
        return self._put_tensor_objects(keys, [_tensor_object(t, k) for k, t in
                                               zip(keys, tensors)], config, upsert)

    def _put_tp(self, keys: list, tensors: list, config: Any, tp_size: int,
                split_dim: int) -> list:
        """Every shard of every tensor in one batch; per key 0 or its first failed shard's
        error. A tensor that cannot be sharded fails its key and writes nothing of it."""
        invalid = int(ErrorCode.INVALID_PARAMS)
        if self._session is None or len(tensors) != len(keys):
            return [invalid] * len(keys)
        results = [invalid] * len(keys)
        shard_keys, shard_objects, owners = [], [], []
        for i, (k, t) in enumerate(zip(keys, tensors)):
            shards = _tp_shards(t, k, tp_size, split_dim)
            if shards is None:
                continue
            results[i] = 0
            for rank, obj in enumerate(shards):
                shard_keys.append(f"{k}_tp_{rank}")
                shard_objects.append(obj)
                owners.append(i)
        if shard_keys:
            for i, code in zip(owners, self._put_tensor_objects(shard_keys, shard_objects,
                                                                config, upsert=False)):
                if code != 0 and results[i] == 0:
                    results[i] = code
        return results

    def _put_tensor_objects(self, keys: list, objects: list, config: Any,
                            upsert: bool) -> list:
        """objects: (header, contiguous CPU tensor) per key, None for a refused tensor
        (INVALID_PARAMS). Each object is assembled once, then they go through the staging
        area in as few batches as it allows (as put_batch; larger ones alone), so a batch of
        tensors costs a few round trips rather than one per tensor."""
        results = [int(ErrorCode.INVALID_PARAMS)] * len(keys)
        idx = [i for i, o in enumerate(objects) if o is not None]
        s = self._session
        if not idx or s is None:
            return results
        try:
            client = s.client_for(_replica_num(config))
        except KvbError as e:
            return [_code_of(e) if o is not None else r for o, r in zip(objects, results)]
        values = {i: _object_bytes(*objects[i]) for i in idx}
        for group in _put_rounds([keys[i] for i in idx], upsert):
            sel = [idx[j] for j in group]
            for i, code in zip(sel, self._staged_put(s, client, [keys[i] for i in sel],
                                                      [values[i] for i in sel], upsert)):
                results[i] = code
        return results

    def _put_tensor_from(self, key: str, buffer_ptr: int, size: int, upsert: bool,
                         config: Any = None) -> int:
        _check_key(key)
        _check_ints("buffer_ptr/size", (buffer_ptr, size))
        if self._session is None or not _valid_tensor_buffer(buffer_ptr, size, key):
            return int(ErrorCode.INVALID_PARAMS)
        return self._put_range(key, buffer_ptr, size, config, upsert)

    def _batch_put_tensor_from(self, keys: list, buffer_ptrs: list, sizes: list,
                               upsert: bool, config: Any = None) -> list:
        _check_keys(keys)
        _check_ints("buffer_ptrs", buffer_ptrs)
        _check_ints("sizes", sizes)
        invalid = [int(ErrorCode.INVALID_PARAMS)] * len(keys)
        if self._session is None:
            return invalid
        if not keys:
            return []
        if len(buffer_ptrs) != len(keys) or len(sizes) != len(keys) or not all(
                _valid_tensor_buffer(p, n, k) for k, p, n in zip(keys, buffer_ptrs, sizes)):
            return invalid
        return self._batch_put_from(keys, buffer_ptrs, sizes, config, upsert)

    # -- internals -------------------------------------------------------------------------
    def _sizes(self, s: _Session, keys: list) -> list:
        try:
            results = s.client.batch_get_size(keys)
        except KvbError as e:
            return [_code_of(e, master_call=True)] * len(keys)
        return [r.size if r.ok else _code_of(r.status, master_call=True) for r in results]

    def _staged_put(self, s: _Session, client: StoreClient, keys: list,
                    views: list, upsert: bool = False) -> list:
        """Puts through the registered staging area, in as few batches as it allows; values
        larger than the area go alone through kvbridge's own staging copy."""
        results = [0] * len(keys)
        capacity = len(s.staging) if s.staging is not None else 0
        chunk: list[tuple[int, int]] = []  # (index, offset)
        used = 0

        def flush() -> None:
            # The staging area is one buffer, so batches through it take turns (as
            # StoreClient.put does with kvbridge's own staging area).
            with s.staging_lock:
                for i, off in chunk:
                    s.staging[off:off + len(views[i])] = views[i]
                try:
                    batch = client.batch_upsert_from if upsert else client.batch_put_from
                    st = batch(
                        [keys[i] for i, _ in chunk],
                        [(s.staging_address + off, len(views[i])) for i, off in chunk])
                    for (i, _), status in zip(chunk, st):
                        results[i] = _code_of(status)
                except KvbError as e:
                    for i, _ in chunk:
                        results[i] = _code_of(e)

        for i, v in enumerate(views):
            if len(v) > capacity:
                try:
                    (client.upsert if upsert else client.put)(keys[i], v)
                except KvbError as e:
                    results[i] = _code_of(e)
                continue
            if used + len(v) > capacity:
                flush()
                chunk, used = [], 0
            chunk.append((i, used))
            used += len(v)
        if chunk:
            flush()
        return results

    def _staged_get(self, s: _Session, keys: list, chunk: list, out: list) -> None:
        with s.staging_lock:
            try:
                results = s.client.batch_get_into(
                    [keys[i] for i, _, _ in chunk],
                    [(s.staging_address + off, size) for _, off, size in chunk])
            except KvbError:
                return
            for (i, off, _), r in zip(chunk, results):
                if r.ok:
                    out[i] = bytes(s.staging[off:off + r.size])
        for (i, _, _), r in zip(chunk, results):
            if not r.ok and r.status.name == "INVALID_ARGUMENT":
                out[i] = self.get(keys[i])  # replaced by a larger object meanwhile

    # batch_put_from / batch_get_into, 128 pages per call in SGLang and vLLM, first try the
    # pointer lists' native reader (no Python object per key); None when it does not take the
    # arguments (other types, a zero pointer or size, a key twice in a put, no session), and
    # the general path below then decides, with Mooncake's errors.
    def _put_from_ptrs(self, keys: Any, ptrs: Any, sizes: Any, config: Any,
                       multi: bool = False, upsert: bool = False) -> Optional[list]:
        s = self._session
        if s is None:
            return None
        try:
            client = s.client_for(_replica_num(config))
        except (KvbError, TypeError):
            return None
        try:
            if upsert:
                failed = client._try_upsert_from_ptrs(keys, ptrs, sizes, multi)
            else:
                failed = client._try_put_from_ptrs(keys, ptrs, sizes, multi)
        except KvbError as e:
            return [_code_of(e)] * len(keys)
        if failed is None:
            return None
        results = [0] * len(keys)
        for i, st in failed.items():
            if st.name == "NOT_REGISTERED":  # Mooncake accepts any memory: copy it once
                results[i] = _put_copy(client, keys[i], _ranges(ptrs[i], sizes[i], multi),
                                       upsert)
            else:
                results[i] = _code_of(st)
        return results

    def _get_into_ptrs(self, keys: Any, ptrs: Any, sizes: Any,
                       multi: bool = False) -> Optional[list]:
        s = self._session
        if s is None:
            return None
        try:
            got = s.client._try_get_into_ptrs(keys, ptrs, sizes, multi)
        except KvbError as e:
            return [_code_of(e)] * len(keys)
        if got is None:
            return None
        results, failed = got
        for i, st in failed.items():
            if st.name == "NOT_REGISTERED":
                results[i] = _get_copy(s.client, keys[i], _ranges(ptrs[i], sizes[i], multi))
            else:
                results[i] = _code_of(st)
        return results

    def _batch_put(self, keys: list, bufs: list, config: Any, upsert: bool = False) -> list:
        _check_keys(keys)
        n = _replica_num(config)
        s = self._session
        if s is None:
            return [int(ErrorCode.INVALID_PARAMS)] * len(keys)
        try:
            client = s.client_for(n)
        except KvbError as e:
            return [_code_of(e)] * len(keys)
        results = [int(ErrorCode.INVALID_PARAMS)] * len(keys)
        valid = [i for i, b in enumerate(bufs) if _valid_ranges(b)]
        batch = client.batch_upsert_from if upsert else client.batch_put_from
        for group in _put_rounds([keys[i] for i in valid], upsert):
            idx = [valid[j] for j in group]
            if not idx:
                continue
            try:
                statuses = batch([keys[i] for i in idx], [bufs[i] for i in idx])
            except KvbError as e:
                for i in idx:
                    results[i] = _code_of(e)
                continue
            for i, st in zip(idx, statuses):
                if st.name == "NOT_REGISTERED":  # Mooncake accepts any memory: copy it once
                    results[i] = _put_copy(client, keys[i], bufs[i], upsert)
                else:
                    results[i] = _code_of(st)
        return results

    def _batch_get(self, keys: list, bufs: list) -> list:
        s = self._session
        if s is None:
            return [int(ErrorCode.INVALID_PARAMS)] * len(keys)
        results = [int(ErrorCode.INVALID_PARAMS)] * len(keys)
        idx = [i for i, b in enumerate(bufs) if _valid_ranges(b)]
        if not idx:
            return results
        try:
            got = s.client.batch_get_into([keys[i] for i in idx], [bufs[i] for i in idx])
        except KvbError as e:
            for i in idx:
                results[i] = _code_of(e)
            return results
        for i, r in zip(idx, got):
            if r.ok:
                results[i] = r.size
            elif r.status.name == "NOT_REGISTERED":
                results[i] = _get_copy(s.client, keys[i], bufs[i])
            else:
                results[i] = _code_of(r.status)
        return results


def _setup_arguments(args: tuple, kwargs: dict) -> dict:
    """setup()'s arguments as one dict (TypeError for a call that fits neither form)."""
    if len(args) == 1 and isinstance(args[0], dict) and not kwargs:
        config = dict(args[0])
    elif not args and set(kwargs) == {"config"} and isinstance(kwargs["config"], dict):
        config = dict(kwargs["config"])
    else:
        config = _positional_setup(*args, **kwargs)
    for required in ("local_hostname", "metadata_server"):
        if required not in config:
            raise TypeError(f"setup: missing {required!r}")
    return config


def _positional_setup(local_hostname: str, metadata_server: str, global_segment_size: int,
                      local_buffer_size: int, protocol: str, rdma_devices: str,
                      master_server_addr: str, engine: Any = None,
                      enable_ssd_offload: bool = False, ssd_offload_path: str = "",
                      tenant_id: str = "default", enable_client_http_server: bool = False,
                      client_http_port: int = 9300) -> dict:
    return dict(locals())


_DEFAULTS = {"global_segment_size": 16 << 20, "local_buffer_size": 16 << 20, "protocol": "tcp",
             "rdma_devices": "", "master_server_addr": "127.0.0.1:50051",
             "enable_ssd_offload": False, "ssd_offload_path": ""}
_IGNORED = {"metadata_server", "rdma_devices", "engine", "tenant_id", "ipc_socket_path"}
_METRICS = {"enable_client_http_server", "client_http_port"}


def _serve_metrics(client: StoreClient, listen: str) -> None:
    """Mooncake's client HTTP server: the client's stats on ``listen``'s /metrics
    (kvbridge.metrics). As in Mooncake, a server that cannot start is a warning and the store
    works on without it."""
    if not listen:
        return
    from kvbridge import metrics

    try:
        metrics.serve(client, listen, "client_http_port")
    except (KvbError, ImportError) as e:
        _log.warning("client HTTP server on %s not started; continuing without it: %s",
                     listen, e)


def _flag(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


class _InvalidSize(ValueError):
    pass


# A size as Mooncake's setup reads it from a dict: a number (C's strtod: decimal, a fraction,
# an exponent or hex), optional blanks, an optional unit of powers of 1024 (k, kb, m, mb, g, gb,
# t, tb, b), any case, blanks around; the bytes are the whole part. "16MB", "16 MB", "1gb",
# "1.5GB" and "0x1000" are sizes; "16MiB", "-1MB" and "1_000" are not.
_SIZE = re.compile(r"\s*(\+?(?:0x(?:[0-9a-f]+\.?[0-9a-f]*|\.[0-9a-f]+)(?:p[+-]?\d+)?"
                   r"|(?:\d+\.?\d*|\.\d+)(?:e[+-]?\d+)?))\s*(kb|mb|gb|tb|k|m|g|t|b)?\s*",
                   re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
          "g": 1 << 30, "gb": 1 << 30, "t": 1 << 40, "tb": 1 << 40}


def _size(config: dict, key: str) -> int:
    """config[key] as bytes: an int, a float (its whole part) or a size string (_SIZE)."""
    value = config[key]
    if isinstance(value, bool):
        raise _InvalidSize(f"{key} {value!r}: expected a size")
    if isinstance(value, (int, float)):
        number, unit = float(value) if isinstance(value, float) else value, ""
    elif isinstance(value, str) and (m := _SIZE.fullmatch(value)):
        text, unit = m.group(1).lstrip("+"), (m.group(2) or "").lower()
        number = float.fromhex(text) if text.lower().startswith("0x") else float(text)
    else:
        raise _InvalidSize(f"{key} {value!r}: expected a size such as 16777216, \"16MB\" or "
                           "\"1 gb\"")
    if isinstance(number, float) and not math.isfinite(number):
        raise _InvalidSize(f"{key} {value!r}: expected a size")
    size = int(number * _UNITS[unit]) if isinstance(number, float) else number * _UNITS[unit]
    if size < 0:
        raise _InvalidSize(f"{key} {value!r}: must be >= 0")
    return size


def _start(config: dict) -> _Session:
    """Starts the Node (when global_segment_size > 0) and the StoreClient; ValueError or a
    KvbError says why not."""
    unknown = set(config) - set(_DEFAULTS) - _IGNORED - _METRICS - {"local_hostname"}
    if unknown:
        _log.warning("setup: ignoring unknown keys %s", ", ".join(sorted(unknown)))
    c = dict(_DEFAULTS, **{k: v for k, v in config.items() if v is not None})
    segment_bytes = _size(c, "global_segment_size")
    staging_bytes = _size(c, "local_buffer_size")
    if segment_bytes < 0 or staging_bytes < 0:
        raise ValueError("global_segment_size and local_buffer_size must be >= 0")
    master = str(c["master_server_addr"]).strip()
    if master.startswith("etcd://"):
        # HA masters elected in etcd (docs/ha.md); Mooncake separates etcd endpoints with ';'.
        master = master.replace(";", ",")
    elif "://" in master or ";" in master:
        raise ValueError(f"master_server_addr {master!r}: kvbridge takes one master as "
                         "host:port, or etcd://host:port[,...] for HA masters (no redis/k8s "
                         "addresses)")
    elif master.rpartition(":")[2].isdigit() is False:
        raise ValueError(f"master_server_addr {master!r}: expected host:port")
    metrics_listen = ""
    if _flag(c.get("enable_client_http_server", False)):
        port = c.get("client_http_port", 9300)
        if isinstance(port, str) and port.strip().isdigit():
            port = int(port)
        if type(port) is not int or not 0 < port <= 65535:
            raise ValueError(f"client_http_port {port!r}: expected a port, 1..65535")
        metrics_listen = f"0.0.0.0:{port}"  # Mooncake's client server listens on every address
    host = _host_of(str(c["local_hostname"]))
    node_id = f"mooncake-{host}-{os.getpid()}-{next(_instances)}"
    engine: dict[str, Any] = {"node_id": node_id, "listen": f"{host}:0"}
    if str(c["protocol"]).lower() == "tcp":
        engine["transports"] = ["tcp"]
    # Fail fast (Mooncake retries for about a minute and a half) when the master is not there.
    cluster_status(master, timeout_ms=3000)
    node = None
    node_opts: dict[str, Any] = dict(engine, master=master, node_dram_bytes=segment_bytes,
                                     node_rpc_listen=f"{host}:0")
    if segment_bytes > 0:
        if _flag(c["enable_ssd_offload"]):
            path = c["ssd_offload_path"] or os.environ.get("MOONCAKE_OFFLOAD_FILE_STORAGE_PATH", "")
            if not path:
                raise ValueError("enable_ssd_offload needs ssd_offload_path "
                                 "(or MOONCAKE_OFFLOAD_FILE_STORAGE_PATH)")
            node_opts["node_ssd_path"] = str(path)
        node = Node(**node_opts)
    client_opts = dict(engine, master=master)
    try:
        client = StoreClient(replica_num=1, **client_opts)
        staging = mmap.mmap(-1, staging_bytes) if staging_bytes > 0 else None
        return _Session(master, node, client, client_opts, staging, metrics_listen, node_opts)
    except BaseException:
        if node is not None:
            node.close()
        raise


def _valid_ranges(ranges: list) -> bool:
    return bool(ranges) and all(p > 0 and n > 0 for p, n in ranges)


def _multi_buffers(keys: Any, all_ptrs: Any, all_sizes: Any) -> Optional[list]:
    _check_keys(keys)
    if len(all_ptrs) != len(keys) or len(all_sizes) != len(keys):
        return None
    out = []
    for ptrs, sizes in zip(all_ptrs, all_sizes):
        _check_ints("all_buffer_ptrs", ptrs)
        _check_ints("all_sizes", sizes)
        if len(ptrs) != len(sizes):
            return None
        out.append(list(zip(ptrs, sizes)))
    return out


def _ranges(ptrs: Any, sizes: Any, multi: bool) -> list:
    """One key's (address, length) ranges from its pointer-list entries."""
    return list(zip(ptrs, sizes)) if multi else [(ptrs, sizes)]


def _put_copy(client: StoreClient, key: Any, ranges: list, upsert: bool = False) -> int:
    """Puts unregistered memory through one copy (Mooncake's TCP path accepts any memory)."""
    data = b"".join(ctypes.string_at(p, n) for p, n in ranges)
    try:
        (client.upsert if upsert else client.put)(key, data)
        return 0
    except KvbError as e:
        return _code_of(e)


def _get_copy(client: StoreClient, key: Any, ranges: list) -> int:
    """Reads into unregistered memory through one copy; the ranges are filled in order."""
    try:
        data = client.get(key)
    except KvbError as e:
        return _code_of(e)
    if len(data) > sum(n for _, n in ranges):
        return int(ErrorCode.INVALID_PARAMS)
    base = ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value or 0
    at = 0
    for p, n in ranges:
        take = min(n, len(data) - at)
        if take <= 0:
            break
        ctypes.memmove(p, base + at, take)
        at += take
    return len(data)


def _ranges_fit(ranges: list, object_size: int) -> bool:
    """Whether every (pointer, size, offset) range lies inside an object of that size."""
    return all(off + n <= object_size for _, n, off in ranges)


def _address_of(data: Any) -> int:
    """The address of a bytes or bytearray object's first byte (0 for an empty one)."""
    if isinstance(data, bytearray):
        return ctypes.addressof(ctypes.c_char.from_buffer(data)) if data else 0
    return ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value or 0


def _copy_range(data: bytes, ptr: int, dst: int, src: int, size: int) -> int:
    """One range of get_into_ranges: bytes copied, or INVALID_PARAMS."""
    if ptr <= 0 or dst < 0 or src < 0 or size < 0 or src + size > len(data):
        return int(ErrorCode.INVALID_PARAMS)
    if size:
        base = ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value or 0
        ctypes.memmove(ptr + dst, base + src, size)
    return size


# -- tensors: values to objects and back (the layout: _mooncake_tensor) -----------------------
_SEGMENT_ALLOCATED = "allocate_and_mount_segment"
_SEGMENT_FILE = "mount_segment"
_NO_DISK_UNMOUNT = ("kvbridge's SSD tier belongs to the store's storage node and leaves with "
                    "it: close() the store (or drain its node) to take it out of the pool")


class _BumpPool:
    """setup_dummy's memory pool: ``size`` bytes of anonymous memory registered with the
    session's clients, handed out in 64-byte-aligned pieces that live until the session
    closes (Mooncake's alloc_from_mem_pool has no free)."""

    def __init__(self, size: int):
        self.memory = mmap.mmap(-1, size)
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(self.memory))
        self.size = size
        self._next = 0
        self._lock = threading.Lock()

    def alloc(self, n: int) -> int:
        with self._lock:
            start = (self._next + 63) & ~63
            if start + n > self.size:
                return 0
            self._next = start + n
            return self.base + start


_READ_MODES = ("as_stored", "shard", "full")
_AXIS_KINDS = ("dp", "tp", "ep", "pp")


class _InvalidLayout(Exception):
    """A layout the wheel refuses too (logged where raised): INVALID_PARAMS, or None."""


def _no_layouts(layouts: Any) -> bool:
    given = layouts if isinstance(layouts, (list, tuple)) else [layouts]
    return all(x is None for x in given)


def _per_key(layouts: Any, n: int) -> Optional[list]:
    """One layout per key: None for all, or a list of n (None for a list of another length)."""
    if layouts is None:
        return [None] * n
    if not isinstance(layouts, (list, tuple)):
        return [layouts] * n
    return list(layouts) if len(layouts) == n else None


_AXIS_NUMBERS = {"dp": 0, "tp": 1, "ep": 2, "pp": 3}  # the header's axis kinds


@dataclass(frozen=True)
class _Layout:
    """A TensorParallelism: its TP axis (rank, size, split_dim; None without one) and every
    axis as given, DP/EP/PP ones with their expert or stage id."""

    rank: Optional[int]
    size: Optional[int]
    split_dim: Optional[int]
    axes: tuple  # every axis as given: (kind, rank, size, split_dim or None, id or None)
    writer: bool = False  # a writer partition: a TP cut of the whole tensor, keyed __writer_

    @property
    def has_tp(self) -> bool:
        return self.size is not None

    @property
    def several(self) -> bool:
        """Several axes, or none of them TP: the tensor put is the whole one (the TP rank's
        part is stored, if there is a TP axis), and the shards' keys name every axis. One TP
        axis: the tensor put is the rank's shard."""
        return len(self.axes) > 1 or not self.has_tp or self.writer

    def manifest_key(self, key: Any) -> str:
        return f"{key}__writer_manifest" if self.writer else f"{key}__parallelism_manifest"

    def shard_key(self, key: Any, tp_rank: int, tp_size: int, split_dim: int) -> str:
        """The object of TP shard tp_rank of tp_size with this layout's other axes: the wheel's
        ``<key>_tp_<r>`` for one axis; ``<key>__dp_1of2__tp_0of4_sd0__ep_..._eid5__pp_..._sid3``
        (axes in the order dp, tp, ep, pp) for several (the tp_ arguments unused without a TP
        axis)."""
        if self.writer:
            return f"{key}__writer_{tp_rank}of{tp_size}_sd{split_dim}"
        if not self.several:
            return f"{key}_tp_{tp_rank}"
        parts = []
        for kind, rank, size, _split, ident in sorted(self.axes,
                                                       key=lambda a: _AXIS_NUMBERS[a[0]]):
            if kind == "tp":
                parts.append(f"__tp_{tp_rank}of{tp_size}_sd{split_dim}")
            else:
                suffix = {"ep": f"_eid{ident}", "pp": f"_sid{ident}"}.get(kind, "")
                parts.append(f"__{kind}_{rank}of{size}{suffix}")
        return str(key) + "".join(parts)

    def own_key(self, key: Any) -> str:
        """The object this layout's rank stores (and mode "as_stored" reads)."""
        return self.shard_key(key, self.rank, self.size, self.split_dim)

    def header_axes(self, extent: int) -> tuple:
        """The shard header's axes, in the order given: (kind, index, rank, count, split dim or
        -1, expert/stage id or 0, the TP shard's extent or 0)."""
        return tuple((_AXIS_NUMBERS[kind], i, rank, size, -1 if split is None else split,
                      ident or 0, extent if kind == "tp" else 0)
                     for i, (kind, rank, size, split, ident) in enumerate(self.axes))


def _parallel_layout(what: str, parallelism: Any) -> Optional[_Layout]:
    """The layout of a TensorParallelism; None for no layout. _InvalidLayout (logged) where
    the wheel refuses the layout too."""
    if parallelism is None:
        return None
    axes = list(getattr(parallelism, "axes", None) or [])
    if not axes:
        _log.error("%s: TensorParallelism must provide axes", what)
        raise _InvalidLayout
    kinds = [str(getattr(a, "kind", "")).lower() for a in axes]
    if any(k not in _AXIS_KINDS for k in kinds) or len(set(kinds)) != len(kinds):
        _log.error("%s: unsupported or duplicate axis kinds %s", what, kinds)
        raise _InvalidLayout
    given = []
    for kind, a in zip(kinds, axes):
        rank, size, split = a.rank, a.size, a.split_dim
        ident = {"ep": getattr(a, "expert_id", None),
                 "pp": getattr(a, "stage_id", None)}.get(kind)
        if type(rank) is not int or type(size) is not int or size < 1 or not 0 <= rank < size:
            _log.error("%s: invalid rank/size %r/%r for the %s axis", what, rank, size, kind)
            raise _InvalidLayout
        if kind == "tp" and (type(split) is not int or split < 0):
            _log.error("%s: the TP axis requires a split_dim >= 0 (got %r)", what, split)
            raise _InvalidLayout
        if kind != "tp" and split is not None:
            _log.error("%s: the %s axis must not provide split_dim", what, kind.upper())
            raise _InvalidLayout
        if kind in ("ep", "pp") and (type(ident) is not int or ident < 0):
            _log.error("%s: the %s axis requires %s", what, kind.upper(),
                       "expert_id" if kind == "ep" else "stage_id")
            raise _InvalidLayout
        given.append((kind, rank, size, split, ident))
    rank, size, split = next(((r, n, d) for k, r, n, d, _ in given if k == "tp"),
                             (None, None, None))
    return _Layout(rank, size, split, tuple(given))


def _writer_layout(what: str, partition: Any) -> _Layout:
    """The layout of a writer partition (a ParallelAxis: rank, size, split_dim; its kind is
    not read): rank r's cut of the whole tensor along split_dim, under
    ``<key>__writer_<r>of<n>_sd<d>``, with a ``<key>__writer_manifest``. _InvalidLayout
    (logged) when one of the three is missing or out of range, as the wheel refuses it."""
    rank, size = getattr(partition, "rank", None), getattr(partition, "size", None)
    split = getattr(partition, "split_dim", None)
    if any(type(v) is not int for v in (rank, size, split)) or size < 1 or \
            not 0 <= rank < size or split < 0:
        _log.error("%s: writer_partition must provide rank, size, and split_dim (got %r, %r, "
                   "%r)", what, rank, size, split)
        raise _InvalidLayout
    return _Layout(rank, size, split, (("tp", rank, size, split, None),), writer=True)


def _read_layout(target: Any) -> Any:
    """The layout a ReadTarget names (None for none)."""
    return None if target is None else getattr(target, "parallelism", None)


def _read_target(what: str, target: Any) -> Optional[tuple]:
    """(mode, layout or None) of a ReadTarget; None for a plain read (no target, or
    "as_stored" without a layout)."""
    if target is None:
        return None
    mode = str(getattr(target, "mode", "as_stored")).lower()
    if mode not in _READ_MODES:
        _log.error("%s: unsupported ReadTarget mode %r", what, mode)
        raise _InvalidLayout
    layout = _parallel_layout(what, getattr(target, "parallelism", None))
    if mode == "as_stored" and layout is None:
        return None
    return mode, layout


def _layout_shard_object(data: Any, key: Any, layout: _Layout) -> Optional[tuple]:
    """(shard key, header, data, whole shape or None) of a tensor put with `layout`: with one
    TP axis the tensor is the rank's shard, stored as it is (as put_tensor_with_tp's shards);
    with several axes, or a writer partition, it is the whole tensor, and the rank's part along
    split_dim is stored; with no TP axis the whole tensor is. None (logged) when the tensor has
    no such dimension or it does not cut evenly."""
    if not layout.has_tp:  # the whole tensor, under a key naming its axes
        header = _tensor.pack(_tensor.dtype_number(data.dtype), tuple(data.shape),
                              data.numel() * data.element_size(), global_shape=tuple(data.shape),
                              axes=layout.header_axes(0))
        return layout.own_key(key), header, data, None
    d = layout.split_dim
    if d >= data.dim():
        _log.error("%r: split_dim %d of a %d-dim tensor", key, d, data.dim())
        return None
    if layout.several:
        if data.shape[d] % layout.size:
            _log.error("%r: dim %d of shape %s does not cut into %d equal shards", key, d,
                       list(data.shape), layout.size)
            return None
        whole = tuple(data.shape)
        step = whole[d] // layout.size
        data = data.narrow(d, layout.rank * step, step).contiguous()
    else:
        whole = list(data.shape)
        whole[d] *= layout.size
        whole = tuple(whole)
    header = _tensor.pack(_tensor.dtype_number(data.dtype), tuple(data.shape),
                          data.numel() * data.element_size(), global_shape=whole,
                          axes=layout.header_axes(int(data.shape[d])))
    return layout.own_key(key), header, data, whole


def _tp_axis_of(meta: Any) -> Optional[tuple]:
    """The TP axis of a shard header (the only one), or None."""
    tps = [a for a in meta.axes if a[0] == _tensor.AXIS_TP]
    return tps[0] if len(tps) == 1 else None


def _same_tp_layout(meta: Any, first: Any, rank: int, step: int) -> bool:
    """Whether a shard's header is TP shard `rank` of the layout shard 0's header gives."""
    a, f = _tp_axis_of(meta), _tp_axis_of(first)
    return (a is not None and meta.dtype == first.dtype
            and meta.global_shape == first.global_shape and a[2] == rank and a[3] == f[3]
            and a[4] == f[4] and meta.shape[a[4]] == step)


_NO_CUDA_IPC = ("Mooncake fills CUDA tensors through CUDA IPC handles its standalone client "
                "daemon opens, which kvbridge has not; read with get_tensor (or "
                "batch_get_tensor) and move the result with .to(device)")


def _tensor_object(tensor: Any, key: Any) -> Optional[tuple]:
    """(header, contiguous CPU tensor) to store for a tensor; None (logged) for a value
    Mooncake refuses: not a torch tensor, a dtype without a Mooncake number (complex, ...),
    more than 8 dims. A GPU tensor is read through host memory; a non-contiguous one is stored
    as its contiguous copy, as Mooncake does."""
    torch = sys.modules.get("torch")  # a value can only be a tensor when torch is loaded
    if torch is None or not isinstance(tensor, torch.Tensor):
        _log.error("tensor for %r: expected a torch.Tensor, got %s", key, type(tensor).__name__)
        return None
    dtype = _tensor.dtype_number(tensor.dtype)
    if dtype is None:
        _log.error("tensor for %r: Mooncake's tensor format has no dtype %s", key, tensor.dtype)
        return None
    if tensor.dim() > _tensor.MAX_DIMS:
        _log.error("tensor for %r: %d dims, Mooncake's tensor format holds up to %d", key,
                   tensor.dim(), _tensor.MAX_DIMS)
        return None
    data = tensor.detach().cpu().contiguous()
    return _tensor.pack(dtype, tuple(data.shape), data.numel() * data.element_size()), data


def _object_bytes(header: bytes, data: Any) -> bytearray:
    """The object of a header and a contiguous CPU tensor: one copy of the tensor's bytes."""
    n = data.numel() * data.element_size()
    out = bytearray(len(header) + n)
    out[:len(header)] = header
    if n:
        ctypes.memmove(ctypes.addressof(ctypes.c_char.from_buffer(out, len(header))),
                       data.data_ptr(), n)
    return out


def _tp_shards(tensor: Any, key: Any, count: int, split_dim: int) -> Optional[list]:
    """(header, data) of each of ``count`` equal shards of tensor along split_dim, as shard
    objects; None (logged) when the tensor is refused or that dimension cannot be cut evenly."""
    whole = _tensor_object(tensor, key)
    if whole is None:
        return None
    data = whole[1]
    shape = tuple(data.shape)
    if not 0 <= split_dim < len(shape) or shape[split_dim] % count:
        _log.error("put with tp for %r: cannot cut shape %s into %d equal shards along dim %d",
                   key, list(shape), count, split_dim)
        return None
    dtype = _tensor.dtype_number(data.dtype)
    step = shape[split_dim] // count
    shards = []
    for rank in range(count):
        part = data.narrow(split_dim, rank * step, step).contiguous()
        axis = _tensor.tp_axis(rank, count, split_dim, step)
        shards.append((_tensor.pack(dtype, tuple(part.shape), part.numel() * part.element_size(),
                                    global_shape=shape, axes=(axis,)), part))
    return shards


def _tp_key(key: Any, tp_rank: int, tp_size: int) -> Any:
    """The object a TP read of rank tp_rank reads: the key itself when tp_size <= 1."""
    _check_key(key)
    return key if tp_size <= 1 else f"{key}_tp_{tp_rank}"


def _new_tensor(dtype: int, shape: tuple, data: Any) -> Any:
    """A CPU tensor owning a copy of data's bytes."""
    import torch

    torch_dtype = _tensor.torch_dtype(dtype)
    if len(data) == 0:
        return torch.empty(shape, dtype=torch_dtype)
    return torch.frombuffer(bytearray(data), dtype=torch_dtype).reshape(shape)


def _tensor_of(data: Any, key: Any) -> Any:
    """The tensor an object's bytes hold, or None (logged) when they are not a tensor object."""
    meta = _tensor.parse(bytes(data[:_tensor.HEADER_BYTES]), len(data))
    if meta is None:
        _log.error("get_tensor: %r is not a tensor object", key)
        return None
    return _new_tensor(meta.dtype, meta.shape, memoryview(data)[_tensor.HEADER_BYTES:])


def _tensor_to_buffer(tensor: Any, address: int, size: int, key: Any) -> Any:
    """Writes tensor as a whole-tensor object (header, then data) to [address, address +
    size) and returns a tensor over the data there; None (logged, nothing written) when it
    does not fit or the address is 0."""
    data = tensor.contiguous()
    n = data.numel() * data.element_size()
    if address <= 0 or _tensor.HEADER_BYTES + n > size:
        _log.error("%r: a buffer of %d bytes cannot hold its %d-byte tensor object", key, size,
                   _tensor.HEADER_BYTES + n)
        return None
    header = _tensor.pack(_tensor.dtype_number(data.dtype), tuple(data.shape), n)
    ctypes.memmove(address, header, len(header))
    if n:
        ctypes.memmove(address + len(header), data.data_ptr(), n)
    return _tensor_in_buffer(len(header) + n, address, key)


def _tensor_in_buffer(n: int, address: int, key: Any) -> Any:
    """A tensor over the data of the tensor object of n bytes read to address (a view: the
    buffer stays the caller's); None when n is an error or the bytes are not a tensor object."""
    if n < _tensor.HEADER_BYTES:
        return None
    meta = _tensor.parse(ctypes.string_at(address, _tensor.HEADER_BYTES), n)
    if meta is None:
        _log.error("%r: not a tensor object", key)
        return None
    import torch

    dtype = _tensor.torch_dtype(meta.dtype)
    if meta.data_bytes == 0:
        return torch.empty(meta.shape, dtype=dtype)
    data = (ctypes.c_char * meta.data_bytes).from_address(address + _tensor.HEADER_BYTES)
    return torch.frombuffer(data, dtype=dtype).reshape(meta.shape)


def _valid_tensor_buffer(address: int, size: int, key: Any) -> bool:
    """Whether [address, address + size) is a tensor object: a header valid for exactly size
    bytes (what put_tensor_from takes)."""
    if address <= 0 or size < _tensor.HEADER_BYTES:
        _log.error("tensor buffer for %r: %d bytes at %#x, a tensor object needs at least %d",
                   key, size, address, _tensor.HEADER_BYTES)
        return False
    if _tensor.parse(ctypes.string_at(address, _tensor.HEADER_BYTES), size) is None:
        _log.error("tensor buffer for %r: no valid tensor header for %d bytes", key, size)
        return False
    return True


class BufferHandle(bytearray):
    """An object's bytes as ``get_buffer``/``batch_get_buffer`` return them: Mooncake's
    ``ptr()`` and ``size()``, and the buffer protocol (``memoryview(handle)``). Here it is a
    bytearray that cannot be resized, so the bytes stay at ``ptr()`` while the handle lives."""

    def __init__(self, data: Any = b"") -> None:
        super().__init__(data)
        # An export of the bytearray's memory: while it lives, the bytearray cannot be
        # resized, so the address below stays valid.
        self._pin = (ctypes.c_char * len(self)).from_buffer(self) if len(self) else None
        self._address = ctypes.addressof(self._pin) if self._pin is not None else 0

    def ptr(self) -> int:
        return self._address

    def size(self) -> int:
        return len(self)


class MooncakeHostMemAllocator:
    """Mooncake's host-memory allocator (SGLang allocates its HiCache host pool with it when
    the storage backend is ``mooncake``): ``alloc(size)`` gives the address of ``size`` bytes of
    zeroed, page-aligned shared memory, 0 when none can be had; ``free(ptr)`` returns it.

    Mooncake hands this memory to its ``mooncake_client`` daemon in standalone mode; kvbridge
    reads and writes registered memory of any kind, so here it is anonymous shared memory that
    only has to be registered with ``register_buffer`` like any other. The memory lives until
    ``free`` (not until the allocator is collected: tensors over it may outlive the allocator).
    ``use_hugepage`` asks for huge pages (``MAP_HUGETLB``) and falls back to normal pages when
    the kernel has none to give; ``hugepage_size`` ("2MB" or "1GB") is accepted and, like the
    rest of huge-page sizing, left to the kernel's default.
    """

    _lock = threading.Lock()
    _live: dict = {}  # address -> length, for every allocator of this process

    def __init__(self, use_hugepage: Optional[bool] = None,
                 hugepage_size: Optional[Any] = None) -> None:
        self.use_hugepage = bool(use_hugepage)
        self.hugepage_size = hugepage_size

    def alloc(self, size: int) -> int:
        _check_ints("size", (size,))
        if size <= 0:
            return 0
        libc = _libc()
        flags = mmap.MAP_SHARED | mmap.MAP_ANONYMOUS
        prot = mmap.PROT_READ | mmap.PROT_WRITE
        length = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE
        addr = None
        if self.use_hugepage:
            huge = (size + (2 << 20) - 1) // (2 << 20) * (2 << 20)
            addr = libc.mmap(None, huge, prot, flags | _MAP_HUGETLB, -1, 0)
            if addr in (None, _MAP_FAILED):
                _log.warning("MooncakeHostMemAllocator: no huge pages for %d bytes; using "
                             "normal pages", size)
                addr = None
            else:
                length = huge
        if addr is None:
            addr = libc.mmap(None, length, prot, flags, -1, 0)
        if addr in (None, _MAP_FAILED):
            _log.error("MooncakeHostMemAllocator: mmap of %d bytes failed (errno %d)", size,
                       ctypes.get_errno())
            return 0
        with self._lock:
            MooncakeHostMemAllocator._live[addr] = length
        return addr

    def free(self, ptr: int) -> int:
        """0, or -1 when ``ptr`` is not an address ``alloc`` gave (and not yet freed)."""
        _check_ints("ptr", (ptr,))
        with self._lock:
            length = MooncakeHostMemAllocator._live.pop(ptr, None)
        if length is None:
            return -1
        return 0 if _libc().munmap(ctypes.c_void_p(ptr), ctypes.c_size_t(length)) == 0 else -1


_MAP_HUGETLB = getattr(mmap, "MAP_HUGETLB", 0x40000)
_MAP_FAILED = ctypes.c_void_p(-1).value
_libc_handle = None


def _libc():
    global _libc_handle
    if _libc_handle is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                              ctypes.c_int, ctypes.c_long]
        libc.munmap.restype = ctypes.c_int
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        _libc_handle = libc
    return _libc_handle
