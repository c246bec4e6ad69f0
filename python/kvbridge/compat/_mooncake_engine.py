"""Mooncake's ``TransferEngine`` Python API on kvbridge's transfer engine.

Method names, arguments and return conventions follow ``mooncake.engine.TransferEngine``
(0 / negative codes, batch ids, status values): switch with an import. Behind the names,
kvbridge's rules hold: peers are (node id, incarnation) pairs, learnt from the handshake port
that every engine here serves; a peer restarted on the same host:port is a new incarnation
whose memory the old addresses never reach (the call fails with -104 and the next call
handshakes again); every batch ends by its deadline, a frozen peer fails with a progress
timeout, and a failing peer is fast-failed by its circuit breaker. docs/mooncake.md has the
table of every method and what differs.

Peers are named "host:port" (their handshake port, ``get_rpc_port()``), remote memory by the
peer's own virtual addresses, as in Mooncake. ``metadata_server`` may be "P2PHANDSHAKE" or
anything else (an etcd or HTTP URL, a kvbridge master address): descriptors always travel
peer-to-peer through the handshake port, so no metadata service is needed or used.
"""

from __future__ import annotations

import ctypes
import enum
import itertools
import logging
import mmap
import os
import threading
from typing import Any, Optional, Sequence

import kvbridge
from kvbridge import _buffers, errors
from kvbridge._native import _C
from kvbridge.compat._mooncake_names import not_supported

log = logging.getLogger("kvbridge.compat.mooncake")

# Every public name of Mooncake's mooncake.engine (wheel 0.3.13.post1). The drop-in's
# mooncake.engine exports exactly these.
__all__ = ["TransferEngine", "TransferOpcode", "TransferNotify", "Read", "Write",
           "SUPPORT_CUDA", "SUPPORT_EFA", "SUPPORT_HIP", "SUPPORT_INTRA_NVLINK", "SUPPORT_MNNVL",
           "SUPPORT_MUSA", "RpcInterface", "CoroRPCInterface", "create_rpc_client",
           "create_rpc_server", "ReceivedData", "ReceivedTensor", "InnerTransferEngine",
           "SharedSegment"]

# mooncake-transfer-engine/include/error.h
ERR_INVALID_ARGUMENT = -1
ERR_TOO_MANY_REQUESTS = -2
ERR_ADDRESS_NOT_REGISTERED = -3
ERR_DEVICE_NOT_FOUND = -6
ERR_ADDRESS_OVERLAPPED = -7
ERR_SOCKET = -102
ERR_REJECT_HANDSHAKE = -104
ERR_ENDPOINT = -201
ERR_NOT_IMPLEMENTED = -303

# kvbridge status name -> Mooncake's number for the same meaning (else -1, as its sync calls).
_CODE_OF = {
    "INVALID_ARGUMENT": ERR_INVALID_ARGUMENT,
    "BACKPRESSURE": ERR_TOO_MANY_REQUESTS,
    "NOT_REGISTERED": ERR_ADDRESS_NOT_REGISTERED,
    "OUT_OF_BOUNDS": ERR_ADDRESS_NOT_REGISTERED,
    "ALREADY_EXISTS": ERR_ADDRESS_OVERLAPPED,
    "PEER_UNREACHABLE": ERR_SOCKET,
    "STALE_PEER": ERR_REJECT_HANDSHAKE,
    "PROTOCOL": ERR_REJECT_HANDSHAKE,
    "UNAUTHENTICATED": ERR_REJECT_HANDSHAKE,
    "NOT_FOUND": ERR_ENDPOINT,
    "UNSUPPORTED": ERR_NOT_IMPLEMENTED,
}

_MANAGED_SLAB = 64 << 20
_ENGINE_SEQ = itertools.count()
_HANDSHAKE_TIMEOUT_MS = 3000


def _code(e: Any) -> int:
    return _CODE_OF.get(getattr(e, "name", ""), -1)


class TransferOpcode(enum.IntEnum):
    """Mooncake's member names are ``Read`` and ``Write``; ``READ`` and ``WRITE`` are the
    same members."""

    Read = 0
    Write = 1
    READ = 0
    WRITE = 1


# Module-level values, as Mooncake's module has them.
Read, Write = TransferOpcode.Read, TransferOpcode.Write
# What Mooncake's build was compiled with; kvbridge's compat engine moves host memory only
# (no *_on_cuda calls, no EFA, HIP, MUSA or NVLink transports).
SUPPORT_CUDA = SUPPORT_EFA = SUPPORT_HIP = SUPPORT_INTRA_NVLINK = SUPPORT_MNNVL = \
    SUPPORT_MUSA = False


class RpcInterface:
    """Mooncake's RPC channel between engine processes (send_data, send_tensor)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        not_supported(type(self).__name__, "kvbridge has no RPC channel for data or tensors; "
                      "move bytes with the transfer calls")


class CoroRPCInterface(RpcInterface):
    pass


def create_rpc_client(local_rank: int = 0, world_size: int = 1) -> RpcInterface:
    return RpcInterface()


def create_rpc_server(local_rank: int = 0, world_size: int = 1) -> RpcInterface:
    return RpcInterface()


class ReceivedData:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        not_supported("ReceivedData", "it comes from RpcInterface, which kvbridge has not")


class ReceivedTensor:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        not_supported("ReceivedTensor", "it comes from RpcInterface, which kvbridge has not")


class InnerTransferEngine:
    """Mooncake's native engine type; kvbridge's is ``TransferEngine.get_engine()``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        not_supported("InnerTransferEngine", "kvbridge's engine behind a TransferEngine is "
                      "TransferEngine.get_engine()")


class SharedSegment:
    """Mooncake's memory shared across processes of one host."""

    @staticmethod
    def supported() -> bool:
        return False  # what code probes before create()

    @staticmethod
    def create(*args: Any, **kwargs: Any) -> Any:
        not_supported("SharedSegment.create", "kvbridge shares no segments between processes; "
                      "register each process's memory with register_memory")


class TransferNotify:
    """Accepted for signature compatibility; kvbridge sends no notifications (see docs)."""

    def __init__(self, name: str = "", msg: str = ""):
        self.name = name
        self.msg = msg


class TransferEngine:
    """``mooncake.engine.TransferEngine`` on kvbridge (docs/mooncake.md)."""

    TransferOpcode = TransferOpcode

    def __init__(self) -> None:
        self._eng: Optional[kvbridge.TransferEngine] = None
        self._lock = threading.Lock()
        # "host:port" -> (peer node id, its segments as (id, base, length)); a peer's segments
        # change only when it is handshaken again (_peer with refresh), which replaces both.
        self._targets: dict[str, tuple[str, list]] = {}
        self._local: dict[int, int] = {}  # registered address -> segment id
        self._done: dict[int, int] = {}  # async batch id -> final transfer_check_status value
        self._slabs: list[tuple[mmap.mmap, int]] = []  # managed-buffer slabs: (mapping, address)
        self._free: list[tuple[int, int]] = []  # managed free ranges (address, length)
        self._hostname = ""

    # -- setup -------------------------------------------------------------------------------
    def initialize(self, local_hostname: str, metadata_server: str, protocol: str,
                   device_name: str) -> int:
        return self.initialize_ext(local_hostname, metadata_server, protocol, device_name, "")

    def initialize_ext(self, local_hostname: str, metadata_server: str, protocol: str,
                       device_name: str, metadata_type: str) -> int:
        if self._eng is not None:
            log.error("initialize: this TransferEngine is initialized already")
            return ERR_INVALID_ARGUMENT
        host, _, port = local_hostname.rpartition(":") if ":" in local_hostname else (
            local_hostname, "", "0")
        if not host or not port.isdigit():
            log.error("initialize: local_hostname %r is not 'host' or 'host:port'", local_hostname)
            return ERR_INVALID_ARGUMENT
        # Every engine a node id of its own (several may live in one process); peers learn it
        # from the handshake, callers keep naming them "host:port".
        kw: dict[str, Any] = {"listen": f"{host}:0", "handshake_listen": f"{host}:{port}",
                              "node_id": f"mc-{host}-{os.getpid()}-{next(_ENGINE_SEQ)}"}
        if protocol and protocol != "tcp":
            log.warning("initialize: protocol %r is not available in this kvbridge build; "
                        "using its transports (tcp)", protocol)
        if metadata_server and metadata_server.upper() != "P2PHANDSHAKE":
            log.info("initialize: metadata server %r is not needed: descriptors travel over the "
                     "handshake port", metadata_server)
        try:
            self._eng = kvbridge.TransferEngine(**kw)
        except errors.KvbError as e:
            log.error("initialize: %s", e)
            return _code(e) if _code(e) != -1 else ERR_SOCKET
        self._hostname = host
        return 0

    def get_rpc_port(self) -> int:
        ep = self._engine().handshake_endpoint
        return int(ep.rsplit(":", 1)[1])

    def _engine(self) -> kvbridge.TransferEngine:
        if self._eng is None:
            raise RuntimeError("TransferEngine is not initialized (call initialize first)")
        return self._eng

    # -- registration ------------------------------------------------------------------------
    def register_memory(self, buffer_addr: int, capacity: int, location: str = "*") -> int:
        """0 or a negative code. ``location`` (Mooncake's ``"cpu:0"``, ``"cuda:1"`` or ``"*"``
        to detect) is accepted and not needed: kvbridge always detects what the memory is."""
        try:
            # Mooncake takes raw pointers to host or GPU memory alike: registered as what they
            # are (CUDA device memory the driver knows, else host memory).
            seg = self._engine().register(
                _buffers.Region(int(buffer_addr), int(capacity), _buffers.DETECT))
        except errors.KvbError as e:
            log.error("register_memory(%#x, %d): %s", buffer_addr, capacity, e)
            return _code(e)
        with self._lock:
            self._local[int(buffer_addr)] = seg
        return 0

    def unregister_memory(self, buffer_addr: int) -> int:
        with self._lock:
            seg = self._local.get(int(buffer_addr))
        if seg is None:
            return ERR_ADDRESS_NOT_REGISTERED
        try:
            self._engine().deregister(seg)
        except errors.KvbError as e:
            return _code(e)
        with self._lock:
            self._local.pop(int(buffer_addr), None)
        return 0

    def batch_register_memory(self, buffer_addresses: Sequence[int],
                              capacities: Sequence[int], location: str = "*") -> int:
        if len(buffer_addresses) != len(capacities):
            return ERR_INVALID_ARGUMENT
        for a, c in zip(buffer_addresses, capacities):
            rc = self.register_memory(a, c, location)
            if rc != 0:
                return rc
        return 0

    def batch_unregister_memory(self, buffer_addresses: Sequence[int]) -> int:
        rc = 0
        for a in buffer_addresses:
            rc = self.unregister_memory(a) or rc
        return rc

    # -- peers -------------------------------------------------------------------------------
    def _peer_and_segments(self, target: str, refresh: bool = False) -> tuple[str, list]:
        """(node id, segments) of the engine at "host:port", handshaking when unknown or asked."""
        with self._lock:
            known = None if refresh else self._targets.get(target)
        if known is not None:
            return known
        eng = self._engine()
        peer = eng.add_peer(kvbridge.fetch_descriptor(target, _HANDSHAKE_TIMEOUT_MS))
        known = (peer.node_id, eng.peer_segments(peer.node_id))
        with self._lock:
            self._targets[target] = known
        return known

    def _peer(self, target: str, refresh: bool = False) -> str:
        """The node id of the engine at "host:port", handshaking when unknown or asked."""
        return self._peer_and_segments(target, refresh)[0]

    def _forget(self, target: str) -> None:
        with self._lock:
            self._targets.pop(target, None)

    def _remote(self, target: str, addresses: Sequence[int], lengths: Sequence[int]):
        """(node, [(segment id, offset)]) for remote [address, address+length) ranges."""
        node, segs = self._peer_and_segments(target)
        for attempt in range(2):
            out = []
            for a, n in zip(addresses, lengths):
                for sid, base, length in segs:
                    if base <= a and a + n <= base + length:
                        out.append((sid, a - base))
                        break
                else:
                    break
            if len(out) == len(addresses):
                return node, out
            if attempt == 0:  # the peer may have registered more memory since: ask again
                node, segs = self._peer_and_segments(target, refresh=True)
        raise errors.NotRegisteredError(
            f"remote range [{a:#x}, +{n}) is not inside memory {target} registered")

    def send_probe(self, peer_server_name: str) -> int:
        try:
            kvbridge.fetch_descriptor(peer_server_name, _HANDSHAKE_TIMEOUT_MS)
            return 0
        except errors.KvbError:
            return -1

    # -- transfers ---------------------------------------------------------------------------
    def _ops(self, target: str, buffers, peer_addrs, lengths, opcode: int) -> list:
        if not (len(buffers) == len(peer_addrs) == len(lengths)) or not buffers:
            raise errors.InvalidArgumentError(
                "buffers, peer_buffer_addresses and lengths must be non-empty and of one length")
        buffers, lengths = [int(b) for b in buffers], [int(n) for n in lengths]
        if any(n <= 0 for n in lengths) or any(b <= 0 for b in buffers):
            raise errors.InvalidArgumentError("buffer addresses and lengths must be positive")
        node, remote = self._remote(target, [int(a) for a in peer_addrs], lengths)
        op = kvbridge.WRITE if int(opcode) == TransferOpcode.WRITE else kvbridge.READ
        # Raw (opcode, address, length, peer, segment, offset) tuples: the engine checks the
        # local ranges against registered memory itself.
        return [(op, b, n, node, sid, off)
                for b, n, (sid, off) in zip(buffers, lengths, remote)]

    def _native(self, target: str, buffers, peer_addrs, lengths, opcode: int, wait: bool):
        """The batch through the engine's native pointer-list reader (no Python object per
        op): the transfer's op statuses (wait) or its batch id; None when the arguments are
        not plain lists of one length, or the reader does not take them (see _ops)."""
        if not (type(buffers) is list and type(peer_addrs) is list and type(lengths) is list
                and 0 < len(buffers) == len(peer_addrs) == len(lengths)):
            return None
        node, segs = self._peer_and_segments(target)
        op = kvbridge.WRITE if int(opcode) == TransferOpcode.WRITE else kvbridge.READ
        eng = self._engine()
        run = eng._try_transfer_ptrs if wait else eng._try_submit_ptrs
        return run(op, node, segs, buffers, peer_addrs, lengths)

    def _sync(self, target: str, buffers, peer_addrs, lengths, opcode: int) -> int:
        try:
            if self._native(target, buffers, peer_addrs, lengths, opcode, True) is None:
                self._engine().transfer_raw(
                    self._ops(target, buffers, peer_addrs, lengths, opcode))
            return 0
        except kvbridge.BatchError as e:
            err = e.error
        except errors.KvbError as e:
            err = e
        if err.name in ("STALE_PEER", "PEER_UNREACHABLE"):
            self._forget(target)  # the next call handshakes again (a new incarnation, maybe)
        log.warning("transfer to %s failed: %s", target, err)
        return _code(err)

    def transfer_sync_write(self, target_hostname: str, buffer: int, peer_buffer_address: int,
                            length: int, transport_hint: str = "") -> int:
        return self._sync(target_hostname, [buffer], [peer_buffer_address], [length],
                          TransferOpcode.WRITE)

    def transfer_sync_read(self, target_hostname: str, buffer: int, peer_buffer_address: int,
                           length: int, transport_hint: str = "") -> int:
        return self._sync(target_hostname, [buffer], [peer_buffer_address], [length],
                          TransferOpcode.READ)

    def transfer_sync(self, target_hostname: str, buffer: int, peer_buffer_address: int,
                      length: int, opcode: int, notify: Any = None,
                      transport_hint: str = "") -> int:
        return self._sync(target_hostname, [buffer], [peer_buffer_address], [length], opcode)

    def batch_transfer_sync_write(self, target_hostname: str, buffers: Sequence[int],
                                  peer_buffer_addresses: Sequence[int], lengths: Sequence[int],
                                  transport_hint: str = "") -> int:
        return self._sync(target_hostname, buffers, peer_buffer_addresses, lengths,
                          TransferOpcode.WRITE)

    def batch_transfer_sync_read(self, target_hostname: str, buffers: Sequence[int],
                                 peer_buffer_addresses: Sequence[int], lengths: Sequence[int],
                                 transport_hint: str = "") -> int:
        return self._sync(target_hostname, buffers, peer_buffer_addresses, lengths,
                          TransferOpcode.READ)

    def batch_transfer_sync(self, target_hostname: str, buffers: Sequence[int],
                            peer_buffer_addresses: Sequence[int], lengths: Sequence[int],
                            opcode: int, notify: Any = None, transport_hint: str = "") -> int:
        return self._sync(target_hostname, buffers, peer_buffer_addresses, lengths, opcode)

    def _submit(self, target: str, buffers, peer_addrs, lengths, opcode: int) -> int:
        try:
            batch = self._native(target, buffers, peer_addrs, lengths, opcode, False)
            if batch is not None:
                return batch
            return self._engine().submit_raw(
                self._ops(target, buffers, peer_addrs, lengths, opcode))
        except errors.KvbError as e:
            log.warning("submit to %s failed: %s", target, e)
            return 0

    def batch_transfer_async_write(self, target_hostname: str, buffers: Sequence[int],
                                   peer_buffer_addresses: Sequence[int], lengths: Sequence[int],
                                   transport_hint: str = "") -> int:
        """A batch id, or 0 on failure (as Mooncake)."""
        return self._submit(target_hostname, buffers, peer_buffer_addresses, lengths,
                            TransferOpcode.WRITE)

    def batch_transfer_async_read(self, target_hostname: str, buffers: Sequence[int],
                                  peer_buffer_addresses: Sequence[int], lengths: Sequence[int],
                                  transport_hint: str = "") -> int:
        return self._submit(target_hostname, buffers, peer_buffer_addresses, lengths,
                            TransferOpcode.READ)

    def batch_transfer_async(self, target_hostname: str, buffers: Sequence[int],
                             peer_buffer_addresses: Sequence[int], lengths: Sequence[int],
                             opcode: int, transport_hint: str = "") -> int:
        return self._submit(target_hostname, buffers, peer_buffer_addresses, lengths, opcode)

    def get_batch_transfer_status(self, batch_ids: Sequence[int]) -> int:
        """Waits for every batch; 0 when all completed, -1 when any failed or timed out."""
        rc = 0
        for bid in batch_ids:
            if self._final(int(bid), block=True) != 1:
                rc = -1
        return rc

    def transfer_submit_write(self, target_hostname: str, buffer: int, peer_buffer_address: int,
                              length: int, transport_hint: str = "") -> int:
        """A batch id, or 0 on failure, Mooncake's sentinel: callers check ``batch_id != 0``
        before ``transfer_check_status``, so a negative code would pass for a batch id."""
        try:
            return self._engine().submit_raw(self._ops(target_hostname, [buffer],
                                                   [peer_buffer_address], [length],
                                                   TransferOpcode.WRITE))
        except errors.KvbError as e:
            log.warning("submit to %s failed: %s", target_hostname, e)
            return 0

    def transfer_check_status(self, batch_id: int) -> int:
        """1 completed, 0 in progress, -1 failed, -2 timed out."""
        return self._final(int(batch_id), block=False)

    def _final(self, bid: int, block: bool) -> int:
        with self._lock:
            if bid in self._done:
                return self._done[bid]
        eng = self._engine()
        try:
            result = eng.wait(bid) if block else eng.poll(bid)
            if result is None:
                return 0
            value = 1
        except kvbridge.BatchError as e:
            value = -2 if e.error.name in ("DEADLINE_EXCEEDED", "PROGRESS_TIMEOUT") else -1
        except errors.NotFoundError:
            return -1  # never submitted (or already reported and forgotten by an older call)
        with self._lock:
            self._done[bid] = value
        return value

    # -- managed buffers and raw bytes -------------------------------------------------------
    def allocate_managed_buffer(self, length: int) -> int:
        """Registered memory from slabs this engine owns; 0 when none can be had."""
        length = (int(length) + 63) & ~63
        if length <= 0:
            return 0
        with self._lock:
            for i, (a, n) in enumerate(self._free):
                if n >= length:
                    self._free[i] = (a + length, n - length)
                    if self._free[i][1] == 0:
                        del self._free[i]
                    return a
        slab = max(_MANAGED_SLAB, length)
        mapping = mmap.mmap(-1, slab)
        addr = _C.buffer_address(mapping, True)[0]
        if self.register_memory(addr, slab) != 0:
            mapping.close()
            return 0
        with self._lock:
            self._slabs.append((mapping, addr))
            if slab > length:
                self._free.append((addr + length, slab - length))
        return addr

    def free_managed_buffer(self, buffer_addr: int, length: int) -> int:
        length = (int(length) + 63) & ~63
        with self._lock:
            if not any(a <= buffer_addr < a + len(m) for m, a in self._slabs):
                return ERR_INVALID_ARGUMENT
            self._free.append((int(buffer_addr), length))
            self._free.sort()
            merged: list[tuple[int, int]] = []
            for a, n in self._free:  # coalesce neighbours
                if merged and merged[-1][0] + merged[-1][1] == a:
                    merged[-1] = (merged[-1][0], merged[-1][1] + n)
                else:
                    merged.append((a, n))
            self._free = merged
        return 0

    def write_bytes_to_buffer(self, dest_address: int, src_ptr: bytes, length: int) -> int:
        if length > len(src_ptr) or length < 0:
            return ERR_INVALID_ARGUMENT
        ctypes.memmove(int(dest_address), src_ptr, int(length))
        return 0

    def read_bytes_from_buffer(self, source_address: int, length: int) -> bytes:
        return ctypes.string_at(int(source_address), int(length))

    def get_first_buffer_address(self, segment_name: str) -> int:
        """The lowest registered address of the engine named "host:port" (this one or a peer);
        0 when it has none."""
        eng = self._engine()
        try:
            if segment_name in (f"{self._hostname}:{self.get_rpc_port()}", eng.node_id):
                with self._lock:
                    return min(self._local) if self._local else 0
            segs = eng.peer_segments(self._peer(segment_name, refresh=True))
            return segs[0][1] if segs else 0
        except errors.KvbError as e:
            log.warning("get_first_buffer_address(%s): %s", segment_name, e)
            return 0

    def get_engine(self) -> kvbridge.TransferEngine:
        """The kvbridge engine behind this one. Mooncake returns its native engine here, to
        share with ``MooncakeDistributedStore.setup(..., engine)`` (SGLang's HiCache does with
        the PD engine); that argument is accepted and not used (the store runs engines of its
        own), so sharing changes nothing. RuntimeError before ``initialize``."""
        return self._engine()

    def get_engine_ptr(self) -> int:
        """Not supported: raises MooncakeNotSupportedError. Mooncake's is the address of its
        C++ engine, for C++ code that shares it; kvbridge's engine is not that class, and C++
        code handed its address would misread it."""
        not_supported("get_engine_ptr", "the engine behind this one is kvbridge's, not "
                      "Mooncake's C++ TransferEngine; share it from Python with get_engine()")

    def warmup_efa_segment(self, segment_name: str) -> int:
        """Not supported: raises MooncakeNotSupportedError (kvbridge has no EFA transport)."""
        not_supported("warmup_efa_segment", "kvbridge has no EFA transport to warm up; its "
                      "transports connect to a peer on first use (send_probe does it at once)")

    def get_local_topology(self, device_name: Optional[str] = None) -> str:
        return "{}"

    def get_notifies(self) -> list:
        return []

    def close(self) -> None:
        if self._eng is not None:
            self._eng.close()
            self._eng = None
