"""GPU KV registered in place by the vLLM connector (docs/vllm.md "GPUs"), without vLLM and
without a GPU: kvbridge.integrations._vllm_core.register_device_kv with real TransferEngines, a
real store cluster and the connector's own side channel (PdServer / PdPuller), over "device
memory" of the fake CUDA driver of the build tree (tests/fakes/fake_cuda.cc), guarded so that
any CPU access to it by kvbridge kills the child. vLLM's KV tensors cannot be made without a
GPU; a stand-in with the attributes layout_of and kv_device read of one takes their place
(tests/python/test_store_device.py explains the driver set-up, which this file shares)."""

from __future__ import annotations

from test_store_device import FAKE_CUDA, FAKE_PRELUDE, PRELUDE, needs_fake_driver, run_child

KV_PRELUDE = r'''
from kvbridge.integrations._vllm_core import (Counters, RankEndpoint, kv_device, layout_of,
                                              register_device_kv)
from kvbridge.integrations._vllm_pd import PdPuller, PdServer

BLOCKS, SHAPE, ELEM = 8, (8, 2, 4, 16), 4  # [blocks, 2 (K|V), heads, head size] of float32
LAYER_BYTES = 8 * 2 * 4 * 16 * ELEM

class KvTensorDouble(CudaTensorDouble):
    """A contiguous float32 KV tensor of SHAPE on a CUDA device, as layout_of reads one."""
    dtype = "torch.float32"
    def __init__(self, address, device):
        super().__init__(address, LAYER_BYTES // ELEM, device)
        self.shape = SHAPE
    def stride(self):
        out, acc = [], 1
        for n in reversed(SHAPE):
            out.insert(0, acc)
            acc *= n
        return tuple(out)
    def element_size(self): return ELEM

KvTensorDouble.__module__ = "torch.test_double"

def kv_on(device, n_layers=2):
    """{layer name: tensor double} over one allocation of device memory, and its host view."""
    base, view = device_alloc(device, n_layers * LAYER_BYTES) if "device_alloc" in globals() \
        else (0x7f0000000000 + device * (1 << 30), 0)
    return {f"layer.{i}": KvTensorDouble(base + i * LAYER_BYTES, device)
            for i in range(n_layers)}, base, view
'''


def test_device_kv_is_registered_in_place_and_pulled_and_stored():
    needs_fake_driver()
    run_child(FAKE_PRELUDE + KV_PRELUDE + r'''
prefill_kv, p_base, p_view = kv_on(0)
decode_kv, d_base, d_view = kv_on(1)
assert kv_device(prefill_kv) == 0 and kv_device(decode_kv) == 1
total = 2 * LAYER_BYTES
payload = os.urandom(total)
ctypes.memmove(p_view, payload, total)
ctypes.memset(d_view, 0xEE, total)
p_layout, d_layout = layout_of(prefill_kv, BLOCKS), layout_of(decode_kv, BLOCKS)
block_bytes = LAYER_BYTES // BLOCKS

with kvbridge.Cluster(nodes=2, dram_bytes_per_node=32 << 20) as cluster:
    store = cluster.client()
    prefill = kvbridge.TransferEngine(node_id="dev-prefill", listen="127.0.0.1:0")
    decode = kvbridge.TransferEngine(node_id="dev-decode", listen="127.0.0.1:0")
    segs = register_device_kv(p_layout, 0, prefill, store)
    assert [(a, n) for a, n, _ in segs] == p_layout.regions() and all(s >= 0 for *_, s in segs)
    register_device_kv(d_layout, 1, decode, None)

    # Prefill/decode: the decode pulls prefill blocks 2, 3, 4 into its blocks 0, 1, 5.
    server = PdServer(prefill, p_layout, segs, "127.0.0.1", 0, Counters())
    try:
        server.hold({"req-1": 30.0})
        rank = RankEndpoint(server.endpoint, prefill.id.node_id, prefill.id.incarnation)
        got = PdPuller(decode, d_layout, 3000, 5000, 2000).pull(rank, [0, 1, 5], [2, 3, 4])
        assert got.ok, got.error
    finally:
        server.close()
    for layer in range(2):
        for lb, rb in ((0, 2), (1, 3), (5, 4)):
            want = payload[layer * LAYER_BYTES + rb * block_bytes:][:block_bytes]
            have = ctypes.string_at(d_view + layer * LAYER_BYTES + lb * block_bytes, block_bytes)
            assert have == want, (layer, lb, rb)
        untouched = ctypes.string_at(d_view + layer * LAYER_BYTES + 2 * block_bytes, block_bytes)
        assert untouched == b"\xee" * block_bytes

    # The store: blocks saved from device memory and loaded back into other blocks of it.
    pieces = [p_layout.block_pieces(b) for b in (6, 7)]
    failed = store.batch_put_from_ptrs(["k6", "k7"], [a for a, _ in pieces],
                                       [n for _, n in pieces])
    assert failed == {}, failed
    ctypes.memset(p_view, 0, total)
    pieces = [p_layout.block_pieces(b) for b in (0, 1)]
    sizes, failed = store.batch_get_into_ptrs(["k7", "k6"], [a for a, _ in pieces],
                                              [n for _, n in pieces])
    assert failed == {} and sizes == [2 * block_bytes] * 2, (sizes, failed)
    for layer in range(2):
        for lb, sb in ((0, 7), (1, 6)):
            want = payload[layer * LAYER_BYTES + sb * block_bytes:][:block_bytes]
            assert ctypes.string_at(p_view + layer * LAYER_BYTES + lb * block_bytes,
                                    block_bytes) == want, (layer, lb, sb)
    decode.close()
    prefill.close()
print("CHILD OK")
''', {"KVBRIDGE_CUDA_DRIVER": str(FAKE_CUDA)})


def test_without_a_driver_device_kv_is_refused_naming_why():
    """What device_kv=auto falls back from: without a CUDA driver the engine refuses device
    memory (UnsupportedError) and so does the store (UnavailableError), each naming why."""
    run_child(PRELUDE + KV_PRELUDE + r'''
kv, base, _ = kv_on(0)
layout = layout_of(kv, BLOCKS)
engine = kvbridge.TransferEngine(node_id="dev-none", listen="127.0.0.1:0")
with kvbridge.Cluster(nodes=1, dram_bytes_per_node=16 << 20) as cluster:
    store = cluster.client()
    try:
        register_device_kv(layout, 0, None, store)
        raise SystemExit("the store took device memory without a driver")
    except errors.UnavailableError as e:
        assert "libcuda" in str(e) or "CUDA" in str(e), e
    try:
        register_device_kv(layout, 0, engine, store)
        raise SystemExit("the engine took device memory without a driver")
    except errors.UnsupportedError as e:
        assert "CUDA memory" in str(e), e
engine.close()
print("CHILD OK")
''', {"KVBRIDGE_CUDA_DRIVER": "/nonexistent/libcuda.so.1"})


def test_a_failed_registration_is_undone():
    """All or nothing: the engine took the regions, the store refused one (it overlaps a buffer
    already registered there), and the engine's registrations are undone."""
    needs_fake_driver()
    run_child(FAKE_PRELUDE + KV_PRELUDE + r'''
kv, base, _ = kv_on(0)
layout = layout_of(kv, BLOCKS)
engine = kvbridge.TransferEngine(node_id="dev-undo", listen="127.0.0.1:0")
with kvbridge.Cluster(nodes=1, dram_bytes_per_node=16 << 20) as cluster:
    store = cluster.client()
    store.register_buffer(CudaTensorDouble(base + 4096, 4096, 0))
    try:
        register_device_kv(layout, 0, engine, store)
        raise SystemExit("an overlapping store registration was accepted")
    except errors.AlreadyExistsError:
        pass
    # The engine holds none of the regions: registering them again succeeds.
    segs = register_device_kv(layout, 0, engine, None)
    assert len(segs) == len(layout.regions())
engine.close()
print("CHILD OK")
''', {"KVBRIDGE_CUDA_DRIVER": str(FAKE_CUDA)})


def test_device_kv_on_a_real_gpu():
    """The first test on real CUDA tensors (benchmarks/gpu_check.sh, stage python-gpu): a decode
    pulls prefill blocks device to device, and blocks go through the store and back."""
    import torch

    import kvbridge
    from kvbridge.integrations._vllm_core import (Counters, RankEndpoint, kv_device, layout_of,
                                                  register_device_kv)
    from kvbridge.integrations._vllm_pd import PdPuller, PdServer

    from conftest import need_cuda

    need_cuda(torch.cuda.is_available(), "no CUDA device on this machine")
    blocks = 8

    def kv(seed: float) -> dict:
        return {f"layer.{i}": torch.full((blocks, 2, 4, 16), seed + i, device="cuda")
                for i in range(2)}

    prefill_kv, decode_kv = kv(1.0), kv(100.0)
    assert kv_device(prefill_kv) == 0
    p_layout, d_layout = layout_of(prefill_kv, blocks), layout_of(decode_kv, blocks)
    with kvbridge.Cluster(nodes=1, dram_bytes_per_node=32 << 20) as cluster:
        store = cluster.client()
        prefill = kvbridge.TransferEngine(node_id="gpu-prefill", listen="127.0.0.1:0")
        decode = kvbridge.TransferEngine(node_id="gpu-decode", listen="127.0.0.1:0")
        segs = register_device_kv(p_layout, 0, prefill, store)
        register_device_kv(d_layout, 0, decode, None)
        torch.cuda.synchronize()
        server = PdServer(prefill, p_layout, segs, "127.0.0.1", 0, Counters())
        try:
            server.hold({"req": 30.0})
            rank = RankEndpoint(server.endpoint, prefill.id.node_id, prefill.id.incarnation)
            got = PdPuller(decode, d_layout, 3000, 5000, 2000).pull(rank, [0, 1, 5], [2, 3, 4])
            assert got.ok, got.error
        finally:
            server.close()
        for i in range(2):
            for lb, rb in ((0, 2), (1, 3), (5, 4)):
                assert torch.equal(decode_kv[f"layer.{i}"][lb], prefill_kv[f"layer.{i}"][rb])
            assert torch.all(decode_kv[f"layer.{i}"][2] == 100.0 + i)
        pieces = [p_layout.block_pieces(b) for b in (6, 7)]
        assert store.batch_put_from_ptrs(["g6", "g7"], [a for a, _ in pieces],
                                         [n for _, n in pieces]) == {}
        want = {i: prefill_kv[f"layer.{i}"][6:8].clone() for i in range(2)}
        for t in prefill_kv.values():
            t.zero_()
        torch.cuda.synchronize()
        pieces = [p_layout.block_pieces(b) for b in (0, 1)]
        sizes, failed = store.batch_get_into_ptrs(["g6", "g7"], [a for a, _ in pieces],
                                                  [n for _, n in pieces])
        assert failed == {}, failed
        for i in range(2):
            assert torch.equal(prefill_kv[f"layer.{i}"][0:2], want[i])
        decode.close()
        prefill.close()
