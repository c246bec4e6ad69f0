"""The prefill side of the vLLM connector's side channel (kvbridge.integrations._vllm_pd,
docs/vllm.md "Prefill/decode"), without vLLM: hello and release answered by the native
server, the hold/release rules, malformed requests, silent clients, and a prefill process
whose Python threads cannot run (the GIL held for seconds) still answering at once. Real
sockets and real TransferEngines; the pull itself is a real one-sided READ."""

from __future__ import annotations

import socket
import struct
import time

import pytest
import torch

import kvbridge
from kvbridge import errors
from kvbridge.integrations._vllm_core import Counters, RankEndpoint, layout_of
from kvbridge.integrations._vllm_pd import PdPuller, PdServer, side_channel_call

from conftest import read_line, spawn_python

BLOCKS = 8


def _kv(fill: float) -> dict:
    return {f"layer.{i}": torch.full((BLOCKS, 2, 4, 16), fill + i) for i in range(2)}


def _engine(node: str) -> kvbridge.TransferEngine:
    return kvbridge.TransferEngine(node_id=node, listen="127.0.0.1:0")


@pytest.fixture
def prefill():
    kv = _kv(1.0)
    layout = layout_of(kv, BLOCKS)
    eng = _engine("pd-prefill")
    segs = [(a, n, eng.register((a, n))) for a, n in layout.regions()]
    counters = Counters()
    server = PdServer(eng, layout, segs, "127.0.0.1", 0, counters)
    try:
        yield eng, server, counters, kv
    finally:
        server.close()
        eng.close()


def _raw(endpoint: str, payload: bytes, timeout: float = 3.0) -> bytes:
    host, _, port = endpoint.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(payload)
        head = b""
        while len(head) < 4:
            chunk = s.recv(4 - len(head))
            if not chunk:
                return head
            head += chunk
        (n,) = struct.unpack(">I", head)
        body = b""
        while len(body) < n:
            chunk = s.recv(n - len(body))
            if not chunk:
                break
            body += chunk
        return body


def _frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


def test_hello_and_a_pull_of_held_blocks_then_release(prefill):
    eng, server, counters, kv = prefill
    local_kv = _kv(100.0)
    layout = layout_of(local_kv, BLOCKS)
    dec = _engine("pd-decode")
    try:
        for a, n in layout.regions():
            dec.register((a, n))
        rank = RankEndpoint(server.endpoint, eng.id.node_id, eng.id.incarnation)
        puller = PdPuller(dec, layout, 3000, 5000, 2000)
        server.hold({"req-1": 30.0})
        assert server.num_held == 1
        got = puller.pull(rank, [0, 1, 5], [2, 3, 4])
        assert got.ok, got.error
        for i in range(2):
            for lb, rb in ((0, 2), (1, 3), (5, 4)):
                assert torch.equal(local_kv[f"layer.{i}"][lb], kv[f"layer.{i}"][rb])
            assert torch.all(local_kv[f"layer.{i}"][2] == 100.0 + i)  # not named: untouched
        assert puller.release(rank, "req-1") is True
        assert server.take_finished() == {"req-1"}
        assert server.take_finished() == set()  # each id once
        assert counters.snapshot()["pd_requests_released"] == 1
        # A second release of a freed request: not held any more (its blocks may be reused).
        assert puller.release(rank, "req-1") is False
    finally:
        dec.close()


def test_release_before_the_hold_is_known_and_expiry(prefill):
    eng, server, counters, _ = prefill
    rank = RankEndpoint(server.endpoint, eng.id.node_id, eng.id.incarnation)
    puller = PdPuller(_engine("pd-decode-2"), layout_of(_kv(0.0), BLOCKS), 3000, 5000, 2000)
    # The decode's release can come before the worker learnt the hold: still held.
    assert puller.release(rank, "early") is True
    assert server.take_finished() == set()
    server.hold({"early": 30.0, "short": 0.05})
    assert server.num_held == 1  # "early" finished at once, "short" held
    time.sleep(0.1)
    assert server.take_finished() == {"early", "short"}
    snap = counters.snapshot()
    assert snap["pd_requests_released"] == 1 and snap["pd_requests_expired"] == 1
    assert puller.release(rank, "short") is False  # expired: the decode must not use its read


def test_release_naming_another_incarnation_is_stale(prefill):
    eng, server, _, _ = prefill
    server.hold({"r": 30.0})
    other = RankEndpoint(server.endpoint, eng.id.node_id, eng.id.incarnation ^ 1)
    reply = side_channel_call(server.endpoint, {
        "op": "release", "request_id": "r", "incarnation": f"{other.incarnation:#018x}"}, 2000)
    assert reply == {"held": False, "stale": True}
    assert server.num_held == 1


def test_a_restarted_prefill_is_refused_by_identity(prefill):
    eng, server, _, _ = prefill
    layout = layout_of(_kv(0.0), BLOCKS)
    dec = _engine("pd-decode-3")
    try:
        puller = PdPuller(dec, layout, 3000, 5000, 2000)
        stale = RankEndpoint(server.endpoint, eng.id.node_id, eng.id.incarnation + 1)
        got = puller.pull(stale, [0], [0])
        assert not got.ok and "incarnation" in got.error
    finally:
        dec.close()


@pytest.mark.parametrize("payload, code, words", [
    (_frame(b"not json"), "PROTOCOL", "malformed request"),
    (_frame(b'{"op": "hello"} x'), "PROTOCOL", "trailing bytes"),
    (_frame(b'{"op": {"nested": 1}}'), "PROTOCOL", "not a string"),
    (_frame(b'{"op": "fly"}'), "INVALID_ARGUMENT", "unknown op"),
    (_frame(b'{"op": "release", "incarnation": "0x1"}'), "INVALID_ARGUMENT", "request_id"),
    (struct.pack(">I", 1 << 30), "PROTOCOL", "bytes (at most"),
])
def test_bad_requests_get_a_named_error_and_change_nothing(prefill, payload, code, words):
    eng, server, _, _ = prefill
    server.hold({"r": 30.0})
    import json

    reply = json.loads(_raw(server.endpoint, payload))
    assert reply["code"] == code and words in reply["error"], reply
    assert server.num_held == 1
    assert side_channel_call(server.endpoint, {"op": "hello"}, 2000)["node_id"] == eng.id.node_id


def test_escaped_request_ids_round_trip(prefill):
    eng, server, _, _ = prefill
    rid = 'cmpl-"quoted"\\back\u00e9\U0001f600'
    server.hold({rid: 30.0})
    reply = side_channel_call(server.endpoint, {
        "op": "release", "request_id": rid,
        "incarnation": f"{eng.id.incarnation:#018x}"}, 2000)  # json.dumps escapes to ASCII
    assert reply == {"held": True}
    assert server.take_finished() == {rid}


def test_silent_connections_delay_no_one(prefill):
    _, server, _, _ = prefill
    host, _, port = server.endpoint.rpartition(":")
    silent = [socket.create_connection((host, int(port))) for _ in range(50)]
    try:
        t = time.monotonic()
        side_channel_call(server.endpoint, {"op": "hello"}, 2000)
        assert time.monotonic() - t < 0.5
    finally:
        for s in silent:
            s.close()
    time.sleep(2.5)  # each silent exchange ends at its own 2 s bound
    assert server.stats()["rejected"] >= 50


def test_a_taken_port_is_a_named_error(prefill):
    _, server, _, _ = prefill
    port = int(server.endpoint.rpartition(":")[2])
    kv = _kv(0.0)
    layout = layout_of(kv, BLOCKS)
    eng = _engine("pd-second")
    try:
        segs = [(a, n, eng.register((a, n))) for a, n in layout.regions()]
        with pytest.raises(errors.UnavailableError, match=f"side channel 127.0.0.1:{port}"):
            PdServer(eng, layout, segs, "127.0.0.1", port)
    finally:
        eng.close()


def test_closed_server_refuses_calls(prefill):
    _, server, _, _ = prefill
    endpoint = server.endpoint
    server.close()
    with pytest.raises(errors.UnavailableError, match="closed"):
        server.hold({"r": 1.0})
    with pytest.raises(errors.PeerUnreachableError):
        side_channel_call(endpoint, {"op": "hello"}, 1000)


_BUSY_PREFILL = r"""
import sys, time, torch, kvbridge
from kvbridge.integrations._vllm_core import layout_of
from kvbridge.integrations._vllm_pd import PdServer
kv = {"layer.0": torch.zeros((8, 2, 4, 16))}
layout = layout_of(kv, 8)
eng = kvbridge.TransferEngine(node_id="pd-busy", listen="127.0.0.1:0")
segs = [(a, n, eng.register((a, n))) for a, n in layout.regions()]
server = PdServer(eng, layout, segs, "127.0.0.1", 0)
server.hold({"r": 60.0})
print(server.endpoint, flush=True)
sys.stdin.readline()
# Hold the GIL for 4 s: with a switch interval this long no other Python thread runs.
sys.setswitchinterval(1000)
print("busy", flush=True)
end = time.monotonic() + 4
while time.monotonic() < end:
    pass
sys.setswitchinterval(0.005)
print("done", flush=True)
sys.stdin.readline()
"""


def test_a_prefill_whose_python_threads_cannot_run_still_answers():
    """The failure seen with four vLLM instances on two cores: the prefill worker's main
    thread held the GIL (vLLM's message-queue loop) and a side channel served by a Python
    thread answered seconds late. Here the child spins with the GIL for 4 s; hello and release
    must be answered meanwhile."""
    child = spawn_python(_BUSY_PREFILL)
    try:
        endpoint = read_line(child).decode().strip()
        child.stdin.write(b"go\n")
        child.stdin.flush()
        assert read_line(child).strip() == b"busy"
        t = time.monotonic()
        hello = side_channel_call(endpoint, {"op": "hello"}, 3000)
        reply = side_channel_call(endpoint, {
            "op": "release", "request_id": "r", "incarnation": hello["incarnation"]}, 3000)
        took = time.monotonic() - t
        assert reply == {"held": True}
        assert took < 1.0, f"answered after {took:.2f} s while the GIL was held"
        assert child.poll() is None
        assert read_line(child).strip() == b"done"  # the spin really lasted past the calls
    finally:
        child.kill()
        child.wait()
