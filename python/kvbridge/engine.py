"""TransferEngine: one-sided READ/WRITE between this process's registered memory and peers'.

    import kvbridge, torch
    a = kvbridge.TransferEngine(node_id="prefill-0")
    buf = torch.empty(1 << 20, dtype=torch.uint8)
    seg = a.register(buf)                 # peers name (node id, seg) as remote memory
    send_to_peer(a.descriptor())          # any channel: bytes
    peer = b.add_peer(descriptor_from_a)  # on the other side
    b.write(local_buf, peer="prefill-0", segment=seg, offset=0)

The engine's rules hold here too (docs/transfer-engine.md): a restarted peer is another
incarnation and ops to the old one raise StalePeerError until its new descriptor is added;
every batch ends by its deadline; a frozen peer fails with ProgressTimeoutError; a peer that
keeps failing is fast-failed by its circuit breaker (PeerUnreachableError).
Blocking calls release the GIL.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, NamedTuple, Optional, Sequence

from kvbridge import _buffers, options
from kvbridge._native import _C
from kvbridge.errors import InvalidArgumentError, from_status

READ = 1
WRITE = 2

Status = _C.Status


def raise_if_error(status: Any) -> None:
    """Raises the KvbError for a non-OK kvbridge.Status."""
    if not status.ok:
        raise from_status(status.code, status.name, status.message, status.origin)


class PeerId(NamedTuple):
    node_id: str
    incarnation: int


@dataclass(frozen=True)
class Op:
    """One transfer: READ copies remote -> local, WRITE local -> remote.

    ``local`` is a buffer (tensor, buffer-protocol object or (address, length)) inside memory
    registered with this engine; ``length`` defaults to the whole buffer.
    """

    opcode: int
    local: Any
    peer: str
    segment: int
    offset: int = 0
    length: Optional[int] = None


class BatchError(Exception):
    """Raised by transfer()/wait() when some op of a batch failed.

    ``status`` is the first failed op's status, ``op_status`` one kvbridge.Status per op.
    ``error`` is the KvbError of ``status`` (also this exception's __cause__).
    """

    def __init__(self, status: Any, op_status: list):
        self.status = status
        self.op_status = op_status
        self.error = from_status(status.code, status.name, status.message)
        failed = sum(1 for s in op_status if not s.ok)
        super().__init__(f"{failed} of {len(op_status)} ops failed; first: {self.error}")


def _check_batch(result: tuple) -> list:
    status, op_status = result
    if not status.ok:
        if not op_status:  # refused as a whole (structural error): plain KvbError
            raise_if_error(status)
        err = BatchError(status, op_status)
        raise err from err.error
    return op_status


class TransferEngine:
    """A transfer engine. Options are keywords mirroring KVBRIDGE_* (kvbridge.options).

    Engine options: node_id, transports ("tcp" or a list), listen ("host:port,..."),
    cluster_token, deadline_ms, progress_timeout_ms, breaker_failures, breaker_backoff_ms,
    breaker_max_backoff_ms, max_ops_per_batch, max_inflight_batches, max_unpolled_batches,
    plugin_path, plugin_config, and plugin settings such as tcp_lanes_per_peer.
    """

    def __init__(self, **kwargs: Any):
        opts = options.engine_options(kwargs)
        options.check_consumed(kwargs, "TransferEngine", options.ENGINE_FIELDS)
        self._h = _C.TransferEngine(opts)
        self._keepalive: dict[int, Any] = {}

    # -- identity --------------------------------------------------------------------------
    @property
    def id(self) -> PeerId:
        """(node id, incarnation) of this process's engine."""
        return PeerId(*self._h.self_id())

    @property
    def node_id(self) -> str:
        return self._h.self_id()[0]

    @property
    def transports(self) -> list[str]:
        return self._h.transports()

    def endpoints(self, transport: str = "tcp") -> str:
        """Where `transport` listens ("127.0.0.1:41235,..."), with the ports actually bound."""
        return self._h.endpoints(transport)

    # -- memory ----------------------------------------------------------------------------
    def register(self, buf: Any) -> int:
        """Registers a buffer (CPU or CUDA tensor, buffer object or (address, length)); returns
        the segment id peers use as ``segment``. Overlapping a registered region raises
        AlreadyExistsError. A CUDA tensor is registered as device memory, which the tcp
        transport moves through pinned bounce buffers (docs/transports/tcp.md); without a CUDA
        driver, or with no transport that takes device memory, UnsupportedError."""
        r = _buffers.region(buf, writable=True, what="register")
        seg = self._h.register_memory(r.address, r.length, r.kind, r.device)
        self._keepalive[seg] = buf  # the memory must outlive the registration
        return seg

    def deregister(self, segment: int) -> None:
        """After return nothing touches the segment: no peer request, and no transfer of this
        engine that used it as local memory (unfinished ones are cancelled: their ops end
        CANCELLED). NotFoundError for an unknown id."""
        self._h.deregister_memory(segment)
        self._keepalive.pop(segment, None)

    # -- peers -----------------------------------------------------------------------------
    def descriptor(self) -> bytes:
        """Opaque bytes a peer passes to add_peer(); fetch again after registering more."""
        return self._h.local_descriptor()

    def add_peer(self, descriptor: bytes) -> PeerId:
        """Learns (or replaces) a peer from its descriptor."""
        if not isinstance(descriptor, (bytes, bytearray, memoryview)):
            raise InvalidArgumentError(
                f"add_peer: descriptor must be bytes, got {type(descriptor).__name__}")
        return PeerId(*self._h.add_peer(bytes(descriptor)))

    @property
    def handshake_endpoint(self) -> str:
        """"host:port" of this engine's handshake service ("" without handshake_listen)."""
        return self._h.handshake_endpoint()

    def peer_segments(self, node_id: str) -> list[tuple[int, int, int]]:
        """(segment id, base address in the peer, length) of each segment a peer registered,
        sorted by base address. NotFoundError for an unknown peer."""
        return self._h.peer_segments(node_id)

    def remove_peer(self, node_id: str) -> None:
        self._h.remove_peer(node_id)

    def peer_health(self, node_id: str) -> Optional[dict]:
        """Breaker state, failures and staleness of a peer; None for an unknown peer."""
        return self._h.peer_health(node_id)

    def transport_stats(self, transport: str = "tcp") -> dict:
        return self._h.transport_stats(transport)

    # -- transfers -------------------------------------------------------------------------
    @staticmethod
    def _ops(ops: Iterable[Op]) -> list[tuple]:
        out = []
        for i, op in enumerate(ops):
            if not isinstance(op, Op):
                raise InvalidArgumentError(
                    f"ops[{i}]: expected kvbridge.Op, got {type(op).__name__}")
            r = _buffers.region(op.local, writable=op.opcode == READ, what=f"ops[{i}].local")
            length = r.length if op.length is None else op.length
            if length > r.length:
                raise InvalidArgumentError(
                    f"ops[{i}]: length {length} exceeds the local buffer's {r.length} bytes")
            out.append((op.opcode, r.address, length, op.peer, op.segment, op.offset))
        return out

    def submit_raw(self, ops: Sequence[tuple], *, deadline_ms: int = 0,
                   progress_timeout_ms: int = 0) -> int:
        """submit() for ops given as ``(opcode, local_address, length, peer, segment, offset)``
        tuples of ints (and the peer's node id): no Python-side buffer resolution, for hot
        loops over raw addresses. The engine still checks that the local range is registered
        (NOT_REGISTERED) and every other rule; a malformed tuple is a TypeError."""
        return self._h.submit(list(ops), deadline_ms, progress_timeout_ms)

    def transfer_raw(self, ops: Sequence[tuple], *, deadline_ms: int = 0,
                     progress_timeout_ms: int = 0) -> list:
        """transfer() for raw tuples, as submit_raw()."""
        return _check_batch(self._h.transfer(list(ops), deadline_ms, progress_timeout_ms))

    # Mooncake's pointer lists for one peer (local addresses, the peer's addresses, lengths,
    # with the peer's (segment id, base, length) list), read natively with no Python object
    # per op. None when the lists do not qualify (non-empty lists of one length of positive
    # plain ints, every remote range inside one segment): the Mooncake layer then takes its
    # general path, which names what is wrong or re-reads the peer's segments.
    def _try_transfer_ptrs(self, opcode: int, peer: str, segments: Sequence[tuple],
                           local_addresses: Any, remote_addresses: Any,
                           lengths: Any) -> Optional[list]:
        r = self._h.transfer_ptrs(opcode, peer, segments, local_addresses, remote_addresses,
                                  lengths, 0, 0)
        return None if r is None else _check_batch(r)

    def _try_submit_ptrs(self, opcode: int, peer: str, segments: Sequence[tuple],
                         local_addresses: Any, remote_addresses: Any,
                         lengths: Any) -> Optional[int]:
        return self._h.submit_ptrs(opcode, peer, segments, local_addresses, remote_addresses,
                                   lengths, 0, 0)

    def submit(self, ops: Sequence[Op], *, deadline_ms: int = 0,
               progress_timeout_ms: int = 0) -> int:
        """Queues a batch and returns its id (0 timeouts = the engine's defaults)."""
        return self._h.submit(self._ops(ops), deadline_ms, progress_timeout_ms)

    def poll(self, batch_id: int) -> Optional[list]:
        """None while in flight; then the per-op statuses (raises BatchError if one failed)."""
        result = self._h.poll(batch_id)
        return None if result is None else _check_batch(result)

    def wait(self, batch_id: int) -> list:
        """Blocks (GIL released) until the batch ends; per-op statuses, BatchError on failure."""
        return _check_batch(self._h.wait(batch_id))

    def cancel(self, batch_id: int) -> None:
        """Unfinished ops become CANCELLED; afterwards no local memory of the batch is touched."""
        self._h.cancel(batch_id)

    def transfer(self, ops: Sequence[Op], *, deadline_ms: int = 0,
                 progress_timeout_ms: int = 0) -> list:
        """Submit + wait. Returns per-op statuses; raises BatchError when an op failed."""
        return _check_batch(
            self._h.transfer(self._ops(ops), deadline_ms, progress_timeout_ms))

    def read(self, local: Any, peer: str, segment: int, offset: int = 0, *,
             length: Optional[int] = None, deadline_ms: int = 0) -> None:
        """Copies remote bytes into `local`; raises the op's KvbError on failure."""
        self._single(Op(READ, local, peer, segment, offset, length), deadline_ms)

    def write(self, local: Any, peer: str, segment: int, offset: int = 0, *,
              length: Optional[int] = None, deadline_ms: int = 0) -> None:
        """Copies `local` to the peer's memory; raises the op's KvbError on failure."""
        self._single(Op(WRITE, local, peer, segment, offset, length), deadline_ms)

    def _single(self, op: Op, deadline_ms: int) -> None:
        status, _ = self._h.transfer(self._ops([op]), deadline_ms, 0)
        raise_if_error(status)

    # -- lifetime --------------------------------------------------------------------------
    def close(self) -> None:
        """Stops the engine (listeners, lanes). Later calls raise UnavailableError."""
        self._h.close()
        self._keepalive.clear()

    @property
    def closed(self) -> bool:
        return self._h.closed

    def __enter__(self) -> "TransferEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        if self.closed:
            return "TransferEngine(closed)"
        node, inc = self._h.self_id()
        return f"TransferEngine(node_id={node!r}, incarnation={inc:#018x})"


def fetch_descriptor(host_port: str, timeout_ms: int = 3000) -> bytes:
    """Asks the handshake service at "host:port" for that engine's descriptor (pass it to
    TransferEngine.add_peer). PeerUnreachableError, DeadlineExceededError, ProtocolError."""
    return _C.fetch_descriptor(host_port, timeout_ms)
