"""TransferEngine from Python against a peer in another process (real TCP on loopback):
round trips, and the failure paths a user meets: kill -9, SIGSTOP, restart on the same port,
bad input."""

from __future__ import annotations

import os
import signal
import time
import zlib

import pytest
import torch

import kvbridge
from kvbridge import errors
from conftest import free_port, freeze, need_cuda, read_line, spawn_python

PEER = r"""
import sys, zlib, kvbridge
eng = kvbridge.TransferEngine(node_id="py-peer", listen=sys.argv[1])
buf = bytearray(bytes(range(256)) * 4096)  # 1 MiB, known pattern
seg = eng.register(buf)
print(eng.descriptor().hex(), seg, flush=True)
for line in sys.stdin:
    if line.strip() == "crc":
        print(zlib.crc32(buf), flush=True)
"""


def start_peer(port: int):
    proc = spawn_python(PEER, f"127.0.0.1:{port}")
    desc_hex, seg = read_line(proc).decode().split()
    return proc, bytes.fromhex(desc_hex), int(seg)


def peer_crc(proc) -> int:
    proc.stdin.write(b"crc\n")
    proc.stdin.flush()
    return int(read_line(proc))


@pytest.fixture
def peer():
    proc, desc, seg = start_peer(free_port())
    yield proc, desc, seg
    proc.kill()
    proc.wait()


def engine(**kw):
    kw.setdefault("node_id", "py-local")
    kw.setdefault("progress_timeout_ms", 1000)
    kw.setdefault("breaker_failures", 3)
    return kvbridge.TransferEngine(**kw)


def test_read_write_roundtrip(peer):
    proc, desc, seg = peer
    with engine() as eng:
        assert eng.add_peer(desc).node_id == "py-peer"
        local = torch.zeros(1 << 20, dtype=torch.uint8)
        eng.register(local)
        eng.read(local, "py-peer", seg)
        assert bytes(local[:512].numpy()) == bytes(range(256)) * 2
        # WRITE a block, then READ it back, as a batch of several ops.
        local[:4096] = 42
        ops = [kvbridge.Op(kvbridge.WRITE, local[:4096], "py-peer", seg, 8192)]
        assert all(s.ok for s in eng.transfer(ops))
        back = local[4096:8192]
        batch = eng.submit([kvbridge.Op(kvbridge.READ, back, "py-peer", seg, 8192)])
        result = None
        deadline = time.monotonic() + 5
        while result is None and time.monotonic() < deadline:
            result = eng.poll(batch)
        assert result is not None and result[0].ok
        assert bool((back == 42).all())
        expected = bytearray(bytes(range(256)) * 4096)
        expected[8192:12288] = b"\x2a" * 4096
        assert peer_crc(proc) == zlib.crc32(expected)
        stats = eng.transport_stats("tcp")
        assert stats["bytes_read"] >= (1 << 20)
        # Host memory only: nothing went through device staging.
        assert stats["device_regions_staged"] == 0
        assert stats["device_bytes_staged"] == 0
        assert eng.peer_health("py-peer")["breaker"] == "closed"


def test_bad_input_errors(peer):
    proc, desc, seg = peer
    with engine() as eng:
        eng.add_peer(desc)
        unregistered = bytearray(64)
        with pytest.raises(errors.NotRegisteredError):
            eng.read(unregistered, "py-peer", seg)
        local = bytearray(1 << 16)
        eng.register(local)
        with pytest.raises(errors.OutOfBoundsError):
            eng.read((kvbridge._buffers.region(local, writable=True).address, 4096), "py-peer",
                     seg, (1 << 20) - 100)
        with pytest.raises(kvbridge.BatchError) as e:
            eng.transfer([kvbridge.Op(kvbridge.READ, local, "py-peer", seg, 0),
                          kvbridge.Op(kvbridge.READ, local, "nobody", seg, 0)])
        assert [s.name for s in e.value.op_status][1] == "NOT_FOUND"
        assert isinstance(e.value.error, errors.NotFoundError)
        with pytest.raises(errors.InvalidArgumentError):
            eng.add_peer(b"not a descriptor")
        with pytest.raises(errors.InvalidArgumentError, match="length 999999"):
            eng.read(local, "py-peer", seg, length=999999)
        with pytest.raises(errors.AlreadyExistsError):
            eng.register(local)
        with pytest.raises(TypeError, match="progress_timout_ms"):
            kvbridge.TransferEngine(progress_timout_ms=5)
    with pytest.raises(errors.UnavailableError, match="closed"):
        eng.descriptor()


def test_batch_bounds_are_keywords_and_named_when_passed(peer):
    """max_ops_per_batch, max_inflight_batches and tcp_max_queued_slices_per_peer reach the
    engine and its tcp transport from Python; past them the errors name the limit."""
    proc, desc, seg = peer
    with engine(max_ops_per_batch=4, max_inflight_batches=2, max_unpolled_batches=2,
                tcp_slice_bytes=1024, tcp_max_queued_slices_per_peer=64) as eng:
        eng.add_peer(desc)
        local = bytearray(1 << 16)
        eng.register(local)
        base = kvbridge._buffers.region(local, writable=True).address
        tiny = [kvbridge.Op(kvbridge.WRITE, (base + i, 1), "py-peer", seg, i) for i in range(5)]
        with pytest.raises(errors.InvalidArgumentError,
                           match=r"5 ops exceed max_ops_per_batch \(4\)"):
            eng.submit(tiny)
        assert all(s.ok for s in eng.transfer(tiny[:4]))
        freeze(proc.pid)  # nothing sent to the peer finishes now
        pending = []
        try:
            pending.append(eng.submit(tiny[:4]))  # 4 slices queued
            big = eng.submit([kvbridge.Op(kvbridge.WRITE, local, "py-peer", seg, 0)])  # 64 more
            with pytest.raises(kvbridge.BatchError) as e:
                eng.poll(big)
            assert isinstance(e.value.error, errors.BackpressureError)
            assert "tcp.max_queued_slices_per_peer (64)" in str(e.value.error)
            pending.append(eng.submit(tiny[:4]))
            with pytest.raises(errors.BackpressureError, match="max_inflight_batches = 2"):
                eng.submit(tiny[:4])
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        for b in pending:
            result = None
            deadline = time.monotonic() + 10
            while result is None and time.monotonic() < deadline:
                try:
                    result = eng.poll(b)
                except kvbridge.BatchError as err:  # a progress timeout while frozen
                    result = err
            assert result is not None


def test_raw_tuple_ops_round_trip_and_refuse_bad_input(peer):
    proc, desc, seg = peer
    with engine() as eng:
        eng.add_peer(desc)
        local = torch.zeros(1 << 16, dtype=torch.uint8)
        eng.register(local)
        base = local.data_ptr()
        # 16 x 4 KiB READs as raw tuples, then one WRITE back through submit_raw + wait.
        ops = [(kvbridge.READ, base + i * 4096, 4096, "py-peer", seg, i * 4096) for i in range(16)]
        assert all(s.ok for s in eng.transfer_raw(ops))
        assert bytes(local[:512].numpy()) == bytes(range(256)) * 2
        local[:4096] = 7
        bid = eng.submit_raw([(kvbridge.WRITE, base, 4096, "py-peer", seg, 65536)])
        assert all(s.ok for s in eng.wait(bid))
        expected = bytearray(bytes(range(256)) * 4096)
        expected[65536:69632] = b"\x07" * 4096
        assert peer_crc(proc) == zlib.crc32(expected)
        # The engine still checks the local range: one past the registered tensor refuses the
        # batch, naming the op.
        with pytest.raises(errors.NotRegisteredError, match="op 1"):
            eng.transfer_raw([(kvbridge.READ, base, 4096, "py-peer", seg, 0),
                              (kvbridge.READ, base + (1 << 16), 4096, "py-peer", seg, 0)])
        with pytest.raises(errors.InvalidArgumentError, match="opcode 9"):
            eng.transfer_raw([(9, base, 4096, "py-peer", seg, 0)])
        with pytest.raises(TypeError):
            eng.transfer_raw([(kvbridge.READ, "not an address", 4096, "py-peer", seg, 0)])


def test_killed_peer_fails_fast_then_breaker_opens(peer):
    proc, desc, seg = peer
    with engine() as eng:
        eng.add_peer(desc)
        local = bytearray(1 << 20)
        eng.register(local)
        eng.read(local, "py-peer", seg)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        for _ in range(3):
            t = time.monotonic()
            with pytest.raises((errors.PeerUnreachableError, errors.ProgressTimeoutError)):
                eng.read(local, "py-peer", seg, deadline_ms=20000)
            assert time.monotonic() - t < 3
        t = time.monotonic()
        with pytest.raises(errors.PeerUnreachableError):
            eng.read(local, "py-peer", seg)
        assert time.monotonic() - t < 0.1  # breaker open: no network attempt
        assert eng.peer_health("py-peer")["breaker"] in ("open", "half_open")


def test_frozen_peer_is_a_progress_timeout_not_a_hang(peer):
    proc, desc, seg = peer
    with engine() as eng:
        eng.add_peer(desc)
        local = bytearray(1 << 20)
        eng.register(local)
        eng.read(local, "py-peer", seg)
        freeze(proc.pid)
        try:
            t = time.monotonic()
            with pytest.raises(errors.ProgressTimeoutError):
                eng.read(local, "py-peer", seg, deadline_ms=20000)
            assert time.monotonic() - t < 5
        finally:
            os.kill(proc.pid, signal.SIGCONT)


def test_restarted_peer_on_same_port_is_stale_until_readded():
    port = free_port()
    proc, desc, seg = start_peer(port)
    try:
        with engine() as eng:
            eng.add_peer(desc)
            local = bytearray(4096)
            eng.register(local)
            eng.read(local, "py-peer", seg)
            proc.kill()
            proc.wait()
            proc, desc2, seg2 = start_peer(port)
            before = peer_crc(proc)
            local[:] = b"\x55" * 4096
            with pytest.raises(errors.StalePeerError):
                eng.write(local, "py-peer", seg, 0)
            assert peer_crc(proc) == before  # nothing landed in the new process
            new_id = eng.add_peer(desc2)
            assert new_id.incarnation != 0
            eng.write(local, "py-peer", seg2, 0)
            assert peer_crc(proc) != before
    finally:
        proc.kill()
        proc.wait()


def test_cuda_tensors_move_between_engines():
    """On a GPU: CUDA tensors register as device memory and move between two engines (over
    tcp's pinned staging), both ways; tests/gpu has the same against the fake driver."""
    need_cuda(torch.cuda.is_available(), "no CUDA device on this machine")
    with engine(node_id="py-gpu-a") as a, engine(node_id="py-gpu-b") as b:
        src = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
        dst = torch.zeros(1 << 20, dtype=torch.float32, device="cuda")
        back = torch.zeros(1 << 20, dtype=torch.float32, device="cuda")
        a.register(src)
        a.register(back)
        seg = b.register(dst)
        a.add_peer(b.descriptor())
        torch.cuda.synchronize()
        a.write(src, "py-gpu-b", seg, 0)
        assert torch.equal(dst, src)
        a.read(back, "py-gpu-b", seg, 0)
        assert torch.equal(back, src)


def test_multipath_options_reach_the_engine_options_and_bools_are_typed():
    from kvbridge import options
    opts = options.engine_options({"path_failover": False, "path_failover_writes": False,
                                   "failover_min_budget_ms": 7})
    assert opts.path_failover is False
    assert opts.path_failover_writes is False
    assert opts.failover_min_budget_ms == 7
    with pytest.raises(errors.InvalidArgumentError, match="failover_min_budget_ms=True"):
        options.engine_options({"failover_min_budget_ms": True})
    kvbridge.TransferEngine(path_failover=False).close()


def test_an_opt_in_transport_is_used_only_when_named():
    """ucx declares KVB_TCAP_OPT_IN: a default engine leaves it out, a named one uses it."""
    try:
        named = kvbridge.TransferEngine(transports=["tcp", "ucx"])
    except errors.UnavailableError as e:
        pytest.skip(f"the ucx transport is not available in this build: {e}")
    try:
        assert named.transports == ["tcp", "ucx"]
    finally:
        named.close()
    default = kvbridge.TransferEngine()
    try:
        assert "ucx" not in default.transports and "tcp" in default.transports
    finally:
        default.close()
