"""Prefill/decode disaggregation for the vLLM connector, over kvbridge's TransferEngine.

The prefill worker serves (``PdServer``), the decode worker pulls (``PdPuller``):

* Each prefill worker rank registers its KV tensors with a TransferEngine and listens on a
  small side channel (one TCP request per connection: a 4-byte big-endian length and a JSON
  object, answered the same way). ``hello`` returns the engine's descriptor, its identity
  (node id + incarnation) and where each layer's blocks are; ``release`` tells it that a
  decode is done with a request's blocks.
* The decode worker asks ``hello`` once per prefill incarnation, checks that the incarnation
  is the one named in the request's parameters (a restarted prefill is refused: its memory
  holds other requests), adds the peer and READs the blocks one-sidedly into its own
  registered KV tensors, one op per layer and run of consecutive blocks, under a deadline and
  a progress timeout. It then sends ``release``; the answer says whether the prefill still
  held the blocks when the read had finished, so blocks the prefill gave up (hold timeout)
  while a slow read was running are never used.

Nothing here imports vLLM.
"""

from __future__ import annotations

import base64
import json
import logging
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import kvbridge
from kvbridge import errors
from kvbridge.engine import READ, BatchError
from kvbridge.integrations._vllm_core import (Counters, KvLayout, PullResult, RankEndpoint,
                                              merge_runs)

# Under "vllm." so that vLLM's logging configuration (handlers, level, process prefix) applies.
log = logging.getLogger("vllm.kvbridge")

_MAX_FRAME = 16 << 20


# --------------------------------------------------------------------------------------------
# Side channel
# --------------------------------------------------------------------------------------------


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise errors.ProtocolError("side channel: connection closed mid-frame")
        buf += chunk
    return bytes(buf)


def _send_frame(sock: socket.socket, obj: Any) -> None:
    body = json.dumps(obj).encode()
    sock.sendall(struct.pack(">I", len(body)) + body)


def _recv_frame(sock: socket.socket) -> Any:
    (n,) = struct.unpack(">I", _recv_exact(sock, 4))
    if n > _MAX_FRAME:
        raise errors.ProtocolError(f"side channel: frame of {n} bytes")
    try:
        return json.loads(_recv_exact(sock, n))
    except ValueError as e:
        raise errors.ProtocolError(f"side channel: malformed frame ({e})") from None


def side_channel_call(endpoint: str, msg: dict, timeout_ms: int) -> dict:
    """One request to a side channel. The whole exchange, connect included, ends within
    ``timeout_ms`` (DeadlineExceededError, saying how far it got); a refused connection is
    PeerUnreachableError."""
    host, _, port = endpoint.rpartition(":")
    host = host.strip("[]")  # "[::1]:port"
    t0 = time.monotonic()
    deadline = t0 + timeout_ms / 1000.0
    steps: list[str] = []

    def took() -> str:
        return f"{(time.monotonic() - t0) * 1000.0:.0f} ms"

    try:
        sock = socket.create_connection((host, int(port)), timeout=timeout_ms / 1000.0)
    except socket.timeout:
        raise errors.DeadlineExceededError(
            f"side channel {endpoint}: no connection within {timeout_ms} ms") from None
    except OSError as e:
        raise errors.PeerUnreachableError(f"side channel {endpoint}: {e.strerror or e}") from None
    try:
        with sock:
            steps.append(f"connected after {took()}")
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            _send_frame(sock, msg)
            steps.append(f"sent after {took()}")
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            reply = _recv_frame(sock)
    except socket.timeout:
        raise errors.DeadlineExceededError(
            f"side channel {endpoint}: no answer within {timeout_ms} ms "
            f"({', '.join(steps)}; gave up after {took()})") from None
    except OSError as e:
        raise errors.PeerUnreachableError(f"side channel {endpoint}: {e.strerror or e}") from None
    if not isinstance(reply, dict):
        raise errors.ProtocolError(f"side channel {endpoint}: answer is not an object")
    if "error" in reply:
        raise errors.KvbError(f"side channel {endpoint}: {reply['error']}",
                              name=str(reply.get("code", "INTERNAL")))
    return reply


def _segments_of(layout: KvLayout, regions: Sequence[tuple[int, int, int]]) -> list:
    """For every layer and part: [segment, offset of block 0 in it, block stride, block
    bytes, blocks], from the registered (address, length, segment) regions."""
    out = []
    for parts in layout.parts:
        lp = []
        for p in parts:
            for addr, length, seg in regions:
                if addr <= p.base < addr + length:
                    lp.append([seg, p.base - addr, p.block_stride, p.block_bytes, p.num_blocks])
                    break
            else:
                raise errors.InternalError(f"layer part at {p.base:#x} is not registered")
        out.append(lp)
    return out


class PdServer:
    """The prefill side: serves hello/release and keeps track of held requests.

    A held request's blocks stay allocated in vLLM until ``take_finished()`` returns its id:
    when a decode released it, or when its hold ran out. A release that arrives before the
    worker learnt about the hold (the scheduler's metadata comes a step later) is remembered.

    The side channel is answered by a native thread (``kvbridge._C.PdSideChannel``) that never
    takes the GIL: the worker's Python threads can be busy for seconds (vLLM's loop spinning
    on its message queue on a loaded host) without delaying a decode's hello or release. The
    hello is built once, here: the KV tensors are registered before the server starts."""

    def __init__(self, engine: "kvbridge.TransferEngine", layout: KvLayout,
                 regions: Sequence[tuple[int, int, int]], host: str, port: int,
                 counters: Optional[Counters] = None):
        from kvbridge import _C

        self._counters = counters or Counters()
        self._id = engine.id
        hello = {
            "names": list(layout.names),
            "layers": _segments_of(layout, regions),
            "layout": layout.signature(),
            "node_id": self._id.node_id,
            "incarnation": f"{self._id.incarnation:#018x}",
            "descriptor": base64.b64encode(engine.descriptor()).decode(),
        }
        listen = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        # UNAVAILABLE naming the address when it cannot listen (port taken, bad host).
        self._native = _C.PdSideChannel(listen, json.dumps(hello), f"{self._id.incarnation:#018x}")
        self.endpoint = self._native.endpoint

    # -- the worker's side ---------------------------------------------------------------------
    def hold(self, requests: dict[str, float]) -> None:
        """Requests whose blocks the scheduler keeps for a decode: id -> seconds to hold."""
        self._native.hold([(rid, float(s)) for rid, s in requests.items()])

    def take_finished(self) -> set[str]:
        """Ids whose blocks may be freed now (released or expired); each is returned once."""
        done, released, expired = self._native.take_finished()
        if released or expired:
            self._counters.add(pd_requests_released=released, pd_requests_expired=expired)
        return set(done)

    @property
    def num_held(self) -> int:
        return self._native.num_held

    def stats(self) -> dict:
        """Side-channel exchanges answered and refused (malformed, timed out, closed early)."""
        return self._native.stats()

    def close(self) -> None:
        self._native.close()


# --------------------------------------------------------------------------------------------
# The decode side
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Peer:
    node_id: str
    incarnation: int
    layers: list  # per layer, per part: [segment, offset, stride, block bytes, blocks]


class PdPuller:
    """The decode side: pulls a request's blocks from a prefill rank into local blocks."""

    def __init__(self, engine: "kvbridge.TransferEngine", layout: KvLayout,
                 handshake_timeout_ms: int, deadline_ms: int, progress_timeout_ms: int):
        self._engine = engine
        self._layout = layout
        self._handshake_ms = handshake_timeout_ms
        self._deadline_ms = deadline_ms
        self._progress_ms = progress_timeout_ms
        self._lock = threading.Lock()
        self._peers: dict[tuple[str, int], _Peer] = {}

    def _peer(self, rank: RankEndpoint) -> _Peer:
        key = (rank.node_id, rank.incarnation)
        with self._lock:
            peer = self._peers.get(key)
        if peer is not None:
            return peer
        hello = side_channel_call(rank.endpoint, {"op": "hello"}, self._handshake_ms)
        try:
            node, inc = hello["node_id"], int(hello["incarnation"], 16)
            desc = base64.b64decode(hello["descriptor"])
            names, layers, sig = hello["names"], hello["layers"], hello["layout"]
        except (KeyError, TypeError, ValueError) as e:
            raise errors.ProtocolError(f"side channel {rank.endpoint}: malformed hello ({e})") \
                from None
        if (node, inc) != key:
            raise errors.StalePeerError(
                f"prefill at {rank.endpoint} is {node} incarnation {inc:#018x}, the request's "
                f"blocks were in {rank.node_id} incarnation {rank.incarnation:#018x} "
                "(restarted: its memory holds other data)")
        if sig != self._layout.signature() or list(names) != list(self._layout.names):
            raise errors.InvalidArgumentError(
                f"prefill at {rank.endpoint} has another KV layout ({sig} vs "
                f"{self._layout.signature()}): model, dtype or block geometry differ")
        got = self._engine.add_peer(desc)
        if (got.node_id, got.incarnation) != key:
            raise errors.StalePeerError(f"descriptor from {rank.endpoint} names {got}")
        peer = _Peer(node, inc, layers)
        with self._lock:
            self._peers[key] = peer
        return peer

    def forget(self, rank: RankEndpoint) -> None:
        with self._lock:
            self._peers.pop((rank.node_id, rank.incarnation), None)

    def ops(self, peer: _Peer, local_blocks: Sequence[int],
            remote_blocks: Sequence[int]) -> tuple[list[tuple], list[list[int]]]:
        """The READ ops for these blocks and, per op, the local blocks it fills."""
        ops: list[tuple] = []
        covers: list[list[int]] = []
        layout = self._layout
        for i, parts in enumerate(layout.parts):
            for j, lp in enumerate(parts):
                seg, off, rstride, rbytes, rnum = peer.layers[i][j]
                if rbytes != lp.block_bytes:
                    raise errors.InvalidArgumentError(
                        f"layer {layout.names[i]}: {rbytes} bytes per block there, "
                        f"{lp.block_bytes} here")
                dense = rstride == rbytes and lp.block_stride == lp.block_bytes
                runs = (merge_runs(local_blocks, remote_blocks) if dense
                        else [(lb, rb, 1) for lb, rb in zip(local_blocks, remote_blocks)])
                for lb, rb, n in runs:
                    if lb + n > lp.num_blocks or rb + n > rnum:
                        raise errors.OutOfBoundsError(
                            f"blocks {lb}+{n} (local) / {rb}+{n} (remote) past the KV cache")
                    ops.append((READ, lp.base + lb * lp.block_stride, n * lp.block_bytes,
                                peer.node_id, seg, off + rb * rstride))
                    covers.append(list(range(lb, lb + n)))
        return ops, covers

    def pull(self, rank: RankEndpoint, local_blocks: Sequence[int],
             remote_blocks: Sequence[int]) -> PullResult:
        """Reads remote_blocks[i] into local_blocks[i] for every layer; never raises."""
        every = set(local_blocks)
        try:
            peer = self._peer(rank)
            ops, covers = self.ops(peer, local_blocks, remote_blocks)
        except errors.KvbError as e:
            self.forget(rank)
            return PullResult(False, every, error=str(e))
        try:
            self._engine.transfer_raw(ops, deadline_ms=self._deadline_ms,
                                      progress_timeout_ms=self._progress_ms)
        except BatchError as e:
            self.forget(rank)
            bad: set = set()
            for st, cov in zip(e.op_status, covers):
                if not st.ok:
                    bad.update(cov)
            return PullResult(False, bad or every, error=str(e.error))
        except errors.KvbError as e:
            self.forget(rank)
            return PullResult(False, every, error=str(e))
        nbytes = sum(op[2] for op in ops)
        return PullResult(True, set(), blocks=len(local_blocks), bytes=nbytes)

    def release(self, rank: RankEndpoint, request_id: str) -> bool:
        """Tells the prefill it may free the request's blocks. True when it still held them
        (so a read that ended before this call saw the request's KV); raises KvbError when it
        cannot be asked."""
        reply = side_channel_call(rank.endpoint, {
            "op": "release", "request_id": request_id,
            "incarnation": f"{rank.incarnation:#018x}"}, self._handshake_ms)
        return bool(reply.get("held"))
