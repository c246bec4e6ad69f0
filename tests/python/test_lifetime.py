"""Native objects under concurrent use from Python: a storage node stopped while other threads
call it, memory deregistered while a transfer from it is still in flight. Run by `make asan`
under AddressSanitizer too, where a use after free is a report, not luck."""

from __future__ import annotations

import signal
import threading
import time

import numpy as np
import pytest

import kvbridge
from kvbridge import errors

from conftest import freeze, read_line, spawn_python


def test_stop_node_while_other_threads_use_it(cluster):
    stop = threading.Event()
    refused: list[str] = []
    unexpected: list[str] = []

    def use() -> None:
        while not stop.is_set():
            try:
                cluster.node_object_count(1)
                cluster.node_ids()
            except errors.UnavailableError as e:
                refused.append(str(e))
            except Exception as e:  # noqa: BLE001 - anything else is the bug
                unexpected.append(repr(e))

    users = [threading.Thread(target=use) for _ in range(4)]
    for t in users:
        t.start()
    time.sleep(0.2)
    cluster.stop_node(1)
    time.sleep(0.2)
    stop.set()
    for t in users:
        t.join()
    assert not unexpected, unexpected[:3]
    assert any("node 1 is stopped" in r for r in refused)
    with pytest.raises(errors.UnavailableError, match="node 1 is stopped"):
        cluster.node_object_count(1)
    with pytest.raises(errors.UnavailableError, match="node 1 is stopped"):
        cluster.stop_node(1)
    client = cluster.client()  # the others still serve
    client.put("after-stop", b"x" * 4096)
    assert client.get("after-stop") == b"x" * 4096


# The peer: registers 32 MiB and prints its descriptor and segment, then waits (to be frozen).
_PEER = r"""
import sys, numpy as np, kvbridge
e = kvbridge.TransferEngine(node_id="frozen-peer", listen="127.0.0.1:0")
buf = np.zeros(32 << 20, dtype=np.uint8)
seg = e.register(buf)
print(e.descriptor().hex(), seg, flush=True)
sys.stdin.readline()
"""


def test_deregister_cancels_a_transfer_from_the_memory():
    peer = spawn_python(_PEER)
    eng = None
    try:
        desc_hex, seg = read_line(peer).decode().split()
        seg = int(seg)
        eng = kvbridge.TransferEngine(node_id="dereg-client", listen="127.0.0.1:0")
        pid = eng.add_peer(bytes.fromhex(desc_hex)).node_id
        src = np.full(32 << 20, 7, dtype=np.uint8)
        local = eng.register(src)
        eng.transfer([kvbridge.Op(kvbridge.WRITE, src[:4096], pid, seg, 0)])  # lanes up
        freeze(peer.pid)  # the next write sticks once the socket buffers fill
        batch = eng.submit([kvbridge.Op(kvbridge.WRITE, src, pid, seg, 0)], deadline_ms=30000,
                           progress_timeout_ms=20000)
        time.sleep(0.3)
        assert eng.poll(batch) is None  # stuck
        t0 = time.monotonic()
        eng.deregister(local)
        assert time.monotonic() - t0 < 3.0, "deregister waited for the stuck transfer"
        with pytest.raises(kvbridge.BatchError) as info:
            while time.monotonic() - t0 < 5.0:
                if eng.poll(batch) is not None:
                    break
                time.sleep(0.01)
            else:
                pytest.fail("the transfer from the deregistered memory is still running")
        assert isinstance(info.value.error, errors.CancelledError), info.value.error
        del src  # back to the allocator: nothing may touch it now (ASan checks, `make asan`)
        peer.send_signal(signal.SIGCONT)
        time.sleep(0.3)
    finally:
        if eng is not None:
            eng.close()
        peer.kill()
        peer.wait()
