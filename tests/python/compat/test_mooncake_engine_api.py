"""One suite written against Mooncake's TransferEngine Python API, run against kvbridge's
compat class always, and against the real ``mooncake.engine`` when it is importable (run it
with .venv-mooncake/bin/python: scripts/test_mooncake_compat.sh). Two engines in this process,
peers named "host:port", remote memory by the peer's virtual addresses, as SGLang and vLLM use
it. Where Mooncake's behaviour is a bug its users reported (docs/mooncake.md), the test asserts
kvbridge's behaviour and says so."""

from __future__ import annotations

import ctypes
import importlib
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from conftest import freeze, python_env, read_line

ERR_INVALID_ARGUMENT = -1  # Mooncake's transfer engine error number


def _implementations():
    impls = [pytest.param("kvbridge", id="kvbridge")]
    try:
        importlib.import_module("mooncake.engine")
        impls.append(pytest.param("mooncake", id="mooncake"))
    except Exception as e:  # noqa: BLE001 - any import failure means "not here"
        impls.append(pytest.param("mooncake", id="mooncake", marks=pytest.mark.skip(
            reason=f"the real Mooncake wheel is not importable here ({type(e).__name__}: {e}); "
                   "scripts/test_mooncake_compat.sh runs it in .venv-mooncake")))
    return impls


def _engine_class(impl: str):
    if impl == "kvbridge":
        from kvbridge.compat._mooncake_engine import TransferEngine
    else:
        from mooncake.engine import TransferEngine
    return TransferEngine


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Buf:
    """Page-aligned host memory with an address, as engines get from torch or numpy."""

    def __init__(self, n: int, fill: int = 0):
        self.raw = ctypes.create_string_buffer(n + 4096)
        self.addr = (ctypes.addressof(self.raw) + 4095) & ~4095
        self.n = n
        ctypes.memset(self.addr, fill, n)

    def bytes(self, off: int = 0, n: int | None = None) -> bytes:
        return ctypes.string_at(self.addr + off, self.n - off if n is None else n)

    def fill(self, off: int, data: bytes) -> None:
        ctypes.memmove(self.addr + off, data, len(data))


@pytest.fixture(params=_implementations())
def pair(request):
    """(impl, server engine, its session "host:port", its 1 MiB buffer, client, client buf)."""
    cls = _engine_class(request.param)
    server, client = cls(), cls()
    assert server.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    assert client.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    session = f"127.0.0.1:{server.get_rpc_port()}"
    sbuf, cbuf = Buf(1 << 20), Buf(1 << 20)
    assert server.register_memory(sbuf.addr, sbuf.n) == 0
    assert client.register_memory(cbuf.addr, cbuf.n) == 0
    yield request.param, server, session, sbuf, client, cbuf
    for e in (client, server):
        if hasattr(e, "close"):
            e.close()


def test_initialize_and_rpc_port(pair):
    _, server, session, *_ = pair
    port = server.get_rpc_port()
    assert isinstance(port, int) and 0 < port < 65536
    assert session.endswith(f":{port}")


def test_sync_write_then_read_round_trip(pair):
    _, server, session, sbuf, client, cbuf = pair
    cbuf.fill(0, b"kvbridge" * 512)  # 4 KiB
    assert client.transfer_sync_write(session, cbuf.addr, sbuf.addr + 8192, 4096) == 0
    assert sbuf.bytes(8192, 4096) == b"kvbridge" * 512
    assert client.transfer_sync_read(session, cbuf.addr + 65536, sbuf.addr + 8192, 4096) == 0
    assert cbuf.bytes(65536, 4096) == b"kvbridge" * 512


def test_batch_sync_and_async(pair):
    _, server, session, sbuf, client, cbuf = pair
    for i in range(8):
        cbuf.fill(i * 16384, bytes([i + 1]) * 16384)
    locals_ = [cbuf.addr + i * 16384 for i in range(8)]
    remotes = [sbuf.addr + 524288 + i * 16384 for i in range(8)]
    assert client.batch_transfer_sync_write(session, locals_, remotes, [16384] * 8) == 0
    for i in range(8):
        assert sbuf.bytes(524288 + i * 16384, 16384) == bytes([i + 1]) * 16384
    back = [cbuf.addr + 262144 + i * 16384 for i in range(8)]
    assert client.batch_transfer_sync_read(session, back, remotes, [16384] * 8) == 0
    assert cbuf.bytes(262144, 8 * 16384) == b"".join(bytes([i + 1]) * 16384 for i in range(8))
    bid = client.batch_transfer_async_write(session, locals_[:2], remotes[:2], [16384] * 2)
    assert bid != 0
    assert client.get_batch_transfer_status([bid]) == 0
    tid = client.transfer_submit_write(session, cbuf.addr, sbuf.addr, 4096)
    assert tid > 0
    deadline = time.monotonic() + 10
    status = client.transfer_check_status(tid)
    while status == 0 and time.monotonic() < deadline:
        status = client.transfer_check_status(tid)
    assert status == 1


def _opcodes(impl: str):
    module = importlib.import_module(
        "mooncake.engine" if impl == "mooncake" else "kvbridge.compat.mooncake")
    return module.TransferOpcode.Read, module.TransferOpcode.Write


def test_the_other_calls_of_the_engine(pair):
    """The calls the other tests leave out, as Mooncake's callers make them: initialize_ext,
    registration in batches with a location, transfer_sync / batch_transfer_sync /
    batch_transfer_async with an opcode, send_probe, get_local_topology, get_notifies."""
    impl, server, session, sbuf, client, cbuf = pair
    read_op, write_op = _opcodes(impl)
    ext = _engine_class(impl)()
    assert ext.initialize_ext("127.0.0.1", "P2PHANDSHAKE", "tcp", "", "p2p") == 0
    a, b = Buf(65536, 7), Buf(65536, 9)
    assert ext.batch_register_memory([a.addr, b.addr], [a.n, b.n], "cpu:0") == 0
    assert ext.send_probe(session) == 0
    assert client.send_probe(f"127.0.0.1:{ext.get_rpc_port()}") == 0
    assert client.send_probe(f"127.0.0.1:{_free_port()}") != 0  # nobody there
    assert ext.transfer_sync(session, a.addr, sbuf.addr + 4096, 4096, write_op) == 0
    assert sbuf.bytes(4096, 4096) == bytes([7]) * 4096
    assert ext.transfer_sync(session, b.addr, sbuf.addr + 4096, 4096, read_op) == 0
    assert b.bytes(0, 4096) == bytes([7]) * 4096
    assert ext.batch_transfer_sync(session, [a.addr, a.addr + 8192], [sbuf.addr + 16384,
                                   sbuf.addr + 24576], [8192, 8192], write_op) == 0
    assert sbuf.bytes(16384, 16384) == bytes([7]) * 16384
    sbuf.fill(40960, b"async!" * 100)
    bid = ext.batch_transfer_async(session, [b.addr + 8192], [sbuf.addr + 40960], [600],
                                   read_op)
    rid = ext.batch_transfer_async_read(session, [b.addr + 16384], [sbuf.addr + 40960], [600])
    assert bid != 0 and rid != 0
    assert ext.get_batch_transfer_status([bid, rid]) == 0
    assert b.bytes(8192, 600) == b.bytes(16384, 600) == b"async!" * 100
    assert isinstance(ext.get_local_topology(), str)  # kvbridge: "{}" (no NICs to list)
    assert ext.get_notifies() == []
    assert ext.batch_unregister_memory([a.addr, b.addr]) == 0
    assert ext.unregister_memory(a.addr) != 0  # gone
    if hasattr(ext, "close"):
        ext.close()


def test_batch_arguments_as_lists_or_tuples_and_memory_registered_later(pair):
    # kvbridge reads lists of plain ints natively and everything else through its general
    # path: both must move the same bytes and fail the same inputs.
    impl, server, session, sbuf, client, cbuf = pair
    zero_length = {}
    for kind in (list, tuple):
        cbuf.fill(0, bytes(range(256)) * 64)
        locals_ = kind(cbuf.addr + i * 4096 for i in range(4))
        remotes = kind(sbuf.addr + 65536 + i * 4096 for i in range(4))
        assert client.batch_transfer_sync_write(session, locals_, remotes, kind([4096] * 4)) == 0
        assert sbuf.bytes(65536, 16384) == cbuf.bytes(0, 16384)
        back = kind(cbuf.addr + 131072 + i * 4096 for i in range(4))
        assert client.batch_transfer_sync_read(session, back, remotes, kind([4096] * 4)) == 0
        assert cbuf.bytes(131072, 16384) == cbuf.bytes(0, 16384)
        # An unregistered local range fails the batch. A zero length: kvbridge refuses the
        # batch (ERR_INVALID_ARGUMENT), Mooncake moves the other ops; alike for both kinds.
        assert client.batch_transfer_sync_write(session, kind([cbuf.addr + (2 << 20)]),
                                                kind([sbuf.addr]), kind([64])) < 0
        zero_length[kind] = client.batch_transfer_sync_write(session, locals_, remotes,
                                                             kind([4096, 0, 4096, 4096]))
    assert zero_length[list] == zero_length[tuple]
    assert zero_length[list] == (0 if impl == "mooncake" else ERR_INVALID_ARGUMENT)
    # Memory the peer registers after this client first reached it is found.
    later = Buf(1 << 16)
    assert server.register_memory(later.addr, later.n) == 0
    assert client.batch_transfer_sync_write(session, [cbuf.addr], [later.addr + 512], [1024]) == 0
    assert later.bytes(512, 1024) == cbuf.bytes(0, 1024)
    assert server.unregister_memory(later.addr) == 0


def test_failures_return_negative_codes_quickly(pair):
    impl, server, session, sbuf, client, cbuf = pair
    # Remote range outside every registered buffer of the peer.
    t = time.monotonic()
    assert client.transfer_sync_write(session, cbuf.addr, sbuf.addr + (2 << 20), 4096) < 0
    # A peer nobody listens on.
    dead = f"127.0.0.1:{_free_port()}"
    assert client.transfer_sync_write(dead, cbuf.addr, sbuf.addr, 4096) < 0
    assert time.monotonic() - t < 10
    # Unregistering what was never registered.
    assert client.unregister_memory(cbuf.addr + 4096) != 0


def test_a_failed_submit_returns_the_zero_sentinel(pair):
    # Mooncake's callers check `batch_id != 0` before transfer_check_status; a negative code
    # would pass that check and be polled as if it were a batch.
    impl, server, session, sbuf, client, cbuf = pair
    dead = f"127.0.0.1:{_free_port()}"
    assert client.transfer_submit_write(dead, cbuf.addr, sbuf.addr, 4096) == 0
    assert client.batch_transfer_async_write(dead, [cbuf.addr], [sbuf.addr], [4096]) == 0
    tid = client.transfer_submit_write(session, cbuf.addr, sbuf.addr, 4096)  # still works
    assert tid != 0
    deadline = time.monotonic() + 10
    while (status := client.transfer_check_status(tid)) == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert status == 1


def test_managed_buffers_and_raw_bytes(pair):
    _, server, session, sbuf, client, cbuf = pair
    addr = client.allocate_managed_buffer(1 << 16)
    assert addr != 0
    assert client.write_bytes_to_buffer(addr, b"x" * 100, 100) == 0
    assert client.read_bytes_from_buffer(addr, 100) == b"x" * 100
    # Managed memory is registered: it can be the local side of a transfer.
    assert client.transfer_sync_write(session, addr, sbuf.addr, 100) == 0
    assert sbuf.bytes(0, 100) == b"x" * 100
    assert client.free_managed_buffer(addr, 1 << 16) == 0


def test_first_buffer_address_of_a_peer(pair):
    impl, server, session, sbuf, client, cbuf = pair
    assert client.get_first_buffer_address(session) == sbuf.addr


def test_get_engine_gives_the_engine_to_share(pair):
    # SGLang's shared PD engine hands get_engine() to MooncakeDistributedStore.setup(engine=)
    # (HiCache reusing the PD engine); kvbridge gives the kvbridge.TransferEngine behind it.
    impl, server, session, *_ = pair
    native = server.get_engine()
    assert native is not None
    if impl == "kvbridge":
        import kvbridge
        assert isinstance(native, kvbridge.TransferEngine)
        assert native.handshake_endpoint.endswith(f":{server.get_rpc_port()}")
        with pytest.raises(RuntimeError):
            _engine_class(impl)().get_engine()  # not initialized


def test_restarted_peer_on_the_same_port_is_never_written_by_old_addresses(pair):
    """kvbridge's behaviour, not Mooncake's (seeds 000 and 002: a reused port or a restarted
    peer keeps receiving traffic meant for the old process): the old peer's addresses fail with
    a negative code and nothing lands in the new process; after that the new incarnation is
    reached by its own addresses."""
    impl, server, session, sbuf, client, cbuf = pair
    if impl == "mooncake":
        pytest.skip("asserts kvbridge's incarnation rule, which Mooncake does not have")
    cls = _engine_class(impl)
    port = _free_port()
    first = cls()
    assert first.initialize(f"127.0.0.1:{port}", "P2PHANDSHAKE", "tcp", "") == 0
    old = Buf(1 << 16)
    assert first.register_memory(old.addr, old.n) == 0
    target = f"127.0.0.1:{port}"
    assert client.transfer_sync_write(target, cbuf.addr, old.addr, 4096) == 0
    first.close()
    second = cls()
    assert second.initialize(f"127.0.0.1:{port}", "P2PHANDSHAKE", "tcp", "") == 0
    new = Buf(1 << 16, fill=0x5A)
    assert second.register_memory(new.addr, new.n) == 0
    cbuf.fill(0, b"\x11" * 4096)
    assert client.transfer_sync_write(target, cbuf.addr, old.addr, 4096) < 0  # stale
    assert new.bytes() == b"\x5a" * new.n
    assert client.transfer_sync_write(target, cbuf.addr, new.addr, 4096) == 0  # re-handshaked
    assert new.bytes(0, 4096) == b"\x11" * 4096
    second.close()


_PEER = """
import ctypes, importlib, sys
cls = importlib.import_module(sys.argv[1]).TransferEngine
engine = cls()
assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
raw = ctypes.create_string_buffer((1 << 20) + 4096)
addr = (ctypes.addressof(raw) + 4095) & ~4095
assert engine.register_memory(addr, 1 << 20) == 0
print(f"127.0.0.1:{engine.get_rpc_port()} {addr}", flush=True)
sys.stdin.read()
"""


@pytest.mark.parametrize("impl", _implementations())
def test_frozen_peer_fails_the_batch_in_seconds_and_is_reached_again(impl):
    """Seed 000 (a replica that stops answering degrades every SGLang client): a peer stopped
    with SIGSTOP keeps its connections open and answers nothing. kvbridge fails a batch to it
    after its progress timeout (2 s) with a negative code, other peers unaffected, and moves
    bytes to it again once it runs. Mooncake's batch waits for its transfer timeout (30 s and
    more)."""
    module = "mooncake.engine" if impl == "mooncake" else "kvbridge.compat.mooncake"
    peer = subprocess.Popen([sys.executable, "-c", _PEER, module], env=python_env(),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL)
    cls = _engine_class(impl)
    client = cls()
    frozen = False
    try:
        session, remote = read_line(peer).decode().split()
        remote = int(remote)
        assert client.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        buf = Buf(1 << 20, fill=7)
        assert client.register_memory(buf.addr, buf.n) == 0
        srcs = [buf.addr + i * 65536 for i in range(8)]
        dsts = [remote + i * 65536 for i in range(8)]
        assert client.batch_transfer_sync_write(session, srcs, dsts, [65536] * 8) == 0
        out: dict = {}

        def write() -> None:
            t = time.monotonic()
            out["rc"] = client.batch_transfer_sync_write(session, srcs, dsts, [65536] * 8)
            out["s"] = time.monotonic() - t

        freeze(peer.pid)
        frozen = True
        worker = threading.Thread(target=write, daemon=True)
        worker.start()
        worker.join(10)
        hung = worker.is_alive()
        peer.send_signal(signal.SIGCONT)
        frozen = False
        worker.join(120)
        if impl == "mooncake" and hung:
            pytest.xfail("Mooncake bug (seed 000): a batch to a frozen peer was still blocked "
                         f"after 10 s; it returned {out} once the peer ran again")
        assert not hung, f"a batch to a frozen peer still blocked after 10 s: {out}"
        assert out["rc"] < 0 and out["s"] < 8, out
        # Running again, the peer is reached again (a new connection; no blacklist).
        deadline = time.monotonic() + 10
        rc = client.batch_transfer_sync_write(session, srcs, dsts, [65536] * 8)
        while rc != 0 and time.monotonic() < deadline:
            time.sleep(0.2)
            rc = client.batch_transfer_sync_write(session, srcs, dsts, [65536] * 8)
        assert rc == 0, "the peer was not reached again after it resumed"
    finally:
        if frozen:
            peer.send_signal(signal.SIGCONT)
        peer.kill()
        peer.wait()
        if hasattr(client, "close"):
            client.close()


# Every public method of the wheel's TransferEngine (0.3.13.post1, the non-CUDA build); in
# .venv-mooncake the test checks this list against the wheel itself.
MOONCAKE_ENGINE_METHODS = sorted("""
allocate_managed_buffer batch_register_memory batch_transfer_async batch_transfer_async_read
batch_transfer_async_write batch_transfer_sync batch_transfer_sync_read
batch_transfer_sync_write batch_unregister_memory free_managed_buffer
get_batch_transfer_status get_engine get_engine_ptr get_first_buffer_address
get_local_topology get_notifies get_rpc_port initialize initialize_ext read_bytes_from_buffer
register_memory send_probe transfer_check_status transfer_submit_write transfer_sync
transfer_sync_read transfer_sync_write unregister_memory warmup_efa_segment
write_bytes_to_buffer""".split())


def test_every_engine_method_is_in_the_docs_table():
    import re
    from pathlib import Path

    from kvbridge.compat.mooncake import TransferEngine

    text = (Path(__file__).resolve().parents[3] / "docs" / "mooncake.md").read_text()
    body = text[text.index("## TransferEngine"):text.index("**Return codes**")]
    table = {}
    for line in body.splitlines():
        cells = [c.strip() for c in line.split("|")]
        if len(cells) >= 4 and cells[1].startswith("`"):
            for name in re.findall(r"`([a-z_][a-z0-9_]*)[`(]", cells[1]):
                table[name] = cells[2]
    missing = [m for m in MOONCAKE_ENGINE_METHODS if m not in table]
    assert not missing, f"docs/mooncake.md's TransferEngine table lacks {missing}"
    for method in MOONCAKE_ENGINE_METHODS:
        # yes and stubs answer; no: present, raising MooncakeNotSupportedError; not yet: absent.
        assert table[method] in ("yes", "stubs", "no", "not yet"), (method, table[method])
        assert hasattr(TransferEngine, method) == (table[method] != "not yet"), method
    try:
        real = importlib.import_module("mooncake.engine").TransferEngine
    except ImportError:
        return
    public = sorted(m for m in dir(real) if not m.startswith("_") and m != "TransferOpcode")
    assert public == MOONCAKE_ENGINE_METHODS, "the wheel's methods changed: update the list"


# Every public name of mooncake.engine in the wheel (0.3.13.post1, non-CUDA); in
# .venv-mooncake the test checks this list against the wheel itself.
MOONCAKE_ENGINE_NAMES = sorted("""
CoroRPCInterface InnerTransferEngine Read ReceivedData ReceivedTensor RpcInterface SUPPORT_CUDA
SUPPORT_EFA SUPPORT_HIP SUPPORT_INTRA_NVLINK SUPPORT_MNNVL SUPPORT_MUSA SharedSegment
TransferEngine TransferNotify TransferOpcode Write create_rpc_client create_rpc_server""".split())


def _dropin_engine_module():
    """dropin/mooncake/mooncake/engine.py under another name (it imports only kvbridge)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "kvbridge_dropin_mooncake_engine",
        Path(__file__).resolve().parents[3] / "dropin" / "mooncake" / "mooncake" / "engine.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_public_name_of_mooncake_engine_is_exported():
    import kvbridge.compat.mooncake as compat

    for module in (compat, _dropin_engine_module()):
        missing = [n for n in MOONCAKE_ENGINE_NAMES if not hasattr(module, n)]
        assert not missing, f"{module.__name__} lacks {missing}"
        assert set(MOONCAKE_ENGINE_NAMES) <= set(module.__all__)
    opcode = compat.TransferOpcode
    assert (compat.Read, compat.Write) == (opcode.Read, opcode.Write) == (0, 1)
    assert compat.TransferEngine.TransferOpcode is opcode
    assert opcode.READ is opcode.Read and opcode.WRITE is opcode.Write  # kvbridge's spellings
    assert compat.SharedSegment.supported() is False
    for call in (compat.RpcInterface, compat.CoroRPCInterface, compat.create_rpc_client,
                 compat.create_rpc_server, compat.ReceivedData, compat.ReceivedTensor,
                 compat.InnerTransferEngine, lambda: compat.SharedSegment.create("s", 1, 1, 0)):
        with pytest.raises(compat.MooncakeNotSupportedError, match="docs/mooncake.md"):
            call()
    try:
        real = importlib.import_module("mooncake.engine")
    except ImportError:
        return
    assert sorted(n for n in dir(real) if not n.startswith("_")) == MOONCAKE_ENGINE_NAMES
    assert {n: int(m) for n, m in real.TransferOpcode.__members__.items()} == \
        {"Read": 0, "Write": 1}
    for flag in (n for n in MOONCAKE_ENGINE_NAMES if n.startswith("SUPPORT_")):
        assert getattr(real, flag) is False and getattr(compat, flag) is False, flag


def test_the_engine_pointer_and_efa_warmup_are_named_errors(pair):
    impl, server, session, *_ = pair
    if impl == "kvbridge":
        from kvbridge.compat.mooncake import MooncakeNotSupportedError

        with pytest.raises(MooncakeNotSupportedError, match="get_engine"):
            server.get_engine_ptr()
        with pytest.raises(MooncakeNotSupportedError, match="EFA"):
            server.warmup_efa_segment(session)
    else:
        assert server.get_engine_ptr() != 0  # the C++ engine's address
        assert isinstance(server.warmup_efa_segment(session), int)  # no EFA here: an error code


def test_every_engine_method_that_answers_is_called_in_this_suite():
    """The suite runs against both implementations, so a call made here is compared."""
    import re
    from pathlib import Path

    from kvbridge.compat.mooncake import TransferEngine

    source = Path(__file__).read_text()
    answered = [m for m in MOONCAKE_ENGINE_METHODS if hasattr(TransferEngine, m)]
    uncalled = [m for m in answered if not re.search(rf"\.{m}\(", source)]
    assert not uncalled, f"no test calls {uncalled}"
