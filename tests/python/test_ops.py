"""kvbridge.ops against a pure-torch indexing oracle.

Every SGLang host layout x direction x dtype x MHA/MLA x page size, per-layer copies, vLLM
block layouts, odd shapes and skipped or repeated indices, on the CPU and (when one is
usable) on a CUDA GPU; every validation error; torch.compile and opcheck. The oracle works
on integer views of the tensors (the ops copy bytes), written from the engines' tensor shapes,
not from the library's strides.
"""

import pytest
import torch

from kvbridge import ops
from kvbridge.errors import InvalidArgumentError, KvbError, OutOfBoundsError

from conftest import need_cuda

CUDA_OK, CUDA_REASON = ops.cuda_available()

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn]
_BITS = {4: torch.int32, 2: torch.int16, 1: torch.int8}


@pytest.fixture(params=["cpu", "cuda"])
def device(request):
    if request.param == "cuda":
        need_cuda(CUDA_OK, f"no usable CUDA device: {CUDA_REASON}")
    return torch.device(request.param)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The same bytes as integers (same element size, so any strides work)."""
    return t.view(_BITS[t.element_size()])


def fill_(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    b = bits(t)
    info = torch.iinfo(b.dtype)
    b.copy_(torch.randint(info.min, info.max, tuple(t.shape), generator=gen, dtype=b.dtype))
    return t


def rand(shape, dtype, device, gen) -> torch.Tensor:
    return fill_(torch.empty(shape, dtype=dtype, device=device), gen)


def host_tensor(shape, dtype, device, gen) -> torch.Tensor:
    """A host-side buffer: pinned CPU memory for the GPU path."""
    t = rand(shape, dtype, "cpu", gen)
    return t.pin_memory() if device.type == "cuda" else t


def same(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    return torch.equal(bits(actual).cpu(), expected)


def slots_of(pages: torch.Tensor, page_size: int) -> torch.Tensor:
    """Page indices -> SGLang token slots (a negative page: page_size negative slots)."""
    slots = pages[:, None] * page_size + torch.arange(page_size)
    return torch.where(pages[:, None] < 0, -1, slots).reshape(-1)


def page_pairs(n_src, n_dst, n, gen, *, repeat_src=False, skip_src=(), skip_dst=()):
    dst = torch.randperm(n_dst, generator=gen)[:n]
    if repeat_src:
        src = torch.randint(0, n_src, (n,), generator=gen)
        src[-1] = src[0]
    else:
        src = torch.randperm(n_src, generator=gen)[:n]
    src[list(skip_src)] = -1
    dst[list(skip_dst)] = -1
    return src, dst


# ---- SGLang --------------------------------------------------------------------------------


def host_index(host, layout, page_size, mla, kv, layer, slots):
    """(tensor, index) addressing `slots` of one layer and K/V part of an SGLang host pool."""
    h = host if mla else host[kv]
    if layout == "layer_first":  # (L, S, ...)
        return h, (layer, slots)
    if layout == "page_first":  # (S, L, ...)
        return h, (slots, layer)
    return h, (slots // page_size, layer, slots % page_size)  # (S / P, L, P, ...)


def sglang_oracle(k, v, host, dslots, hslots, layout, page_size, layer, to_host):
    """Expected (k, v, host) as integer CPU tensors."""
    k = [bits(t).cpu().clone() for t in k]
    v = [bits(t).cpu().clone() for t in v]
    host = bits(host).cpu().clone()
    mla = not v
    keep = (dslots >= 0) & (hslots >= 0)
    ds, hs = dslots[keep], hslots[keep]
    layers = range(len(k)) if layer is None else [layer]
    for kv, part in enumerate([k] if mla else [k, v]):
        for layer_i in layers:
            h, idx = host_index(host, layout, page_size, mla, kv, layer_i, hs)
            if to_host:
                h[idx] = part[layer_i][ds]
            else:
                part[layer_i][ds] = h[idx]
    return k, v, host


def run_sglang(device, *, layout, to_host, dtype, mla, page_size, row_shape=(3, 5),
               n_layers=3, dev_pages=6, host_pages=5, n=4, layer=None, repeat_src=False,
               skip_src=(), skip_dst=(), seed=0):
    gen = torch.Generator().manual_seed(seed)
    dev_slots = dev_pages * page_size
    k = [rand((dev_slots, *row_shape), dtype, device, gen) for _ in range(n_layers)]
    v = [] if mla else [rand((dev_slots, *row_shape), dtype, device, gen) for _ in range(n_layers)]
    shape = ops.sglang_host_shape(layout, n_layers=n_layers, total_slots=host_pages * page_size,
                                  row_shape=row_shape, page_size=page_size, mla=mla)
    host = host_tensor(shape, dtype, device, gen)
    if to_host:
        dpages, hpages = page_pairs(dev_pages, host_pages, n, gen, repeat_src=repeat_src,
                                    skip_src=skip_src, skip_dst=skip_dst)
    else:
        hpages, dpages = page_pairs(host_pages, dev_pages, n, gen, repeat_src=repeat_src,
                                    skip_src=skip_src, skip_dst=skip_dst)
    dslots, hslots = slots_of(dpages, page_size), slots_of(hpages, page_size)
    want_k, want_v, want_host = sglang_oracle(k, v, host, dslots, hslots, layout, page_size,
                                              layer, to_host)
    fn = ops.sglang_device_to_host if to_host else ops.sglang_host_to_device
    fn(k, v, host, dslots.to(device), hslots.to(device), layout=layout, page_size=page_size,
       layer=layer)
    if device.type == "cuda":
        torch.cuda.synchronize()
    assert same(host, want_host)
    assert all(same(a, b) for a, b in zip(k, want_k))
    assert all(same(a, b) for a, b in zip(v, want_v))


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("to_host", [True, False], ids=["d2h", "h2d"])
@pytest.mark.parametrize("layout", ops.SGLANG_LAYOUTS)
def test_sglang_all_layers(device, layout, to_host, dtype, mla, page_size):
    run_sglang(device, layout=layout, to_host=to_host, dtype=dtype, mla=mla,
               page_size=page_size, skip_src=(1,))


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("to_host", [True, False], ids=["d2h", "h2d"])
@pytest.mark.parametrize("layout", ops.SGLANG_LAYOUTS)
@pytest.mark.parametrize("layer", [0, 2])
def test_sglang_one_layer(device, layout, to_host, mla, layer):
    run_sglang(device, layout=layout, to_host=to_host, dtype=torch.bfloat16, mla=mla,
               page_size=2, layer=layer)


ODD_CASES = {
    "page_size_7": dict(page_size=7),
    "one_page": dict(page_size=3, n=1),
    "row_1x1_fp8": dict(dtype=torch.float8_e4m3fn, row_shape=(1, 1), page_size=5),
    "big_rows": dict(row_shape=(8, 64), page_size=16, n_layers=2),
    "one_layer": dict(n_layers=1, page_size=2),
    "all_pages": dict(page_size=2, dev_pages=5, host_pages=5, n=5),
    "repeated_src": dict(page_size=2, repeat_src=True),
    "repeated_src_p1": dict(page_size=1, repeat_src=True, dev_pages=9, host_pages=9, n=9),
    "skip_dst": dict(page_size=2, skip_dst=(0, 2)),
    "skip_both": dict(page_size=4, skip_src=(0,), skip_dst=(0, 3)),
    "skip_all": dict(page_size=2, skip_src=(0, 1, 2, 3)),
    "empty": dict(page_size=2, n=0),
    "mla_2d_rows": dict(mla=True, row_shape=(7,), page_size=3),
}


@pytest.mark.parametrize("to_host", [True, False], ids=["d2h", "h2d"])
@pytest.mark.parametrize("layout", ops.SGLANG_LAYOUTS)
@pytest.mark.parametrize("case", list(ODD_CASES))
def test_sglang_odd_shapes(device, case, layout, to_host):
    kw = dict(dtype=torch.float16, mla=False)
    kw.update(ODD_CASES[case])
    run_sglang(device, layout=layout, to_host=to_host, seed=len(case), **kw)


def test_sglang_round_trip(device):
    """Device -> host -> another device pool gives back the same pages (bf16, page_first)."""
    gen = torch.Generator().manual_seed(7)
    L, P, row = 4, 8, (2, 16)
    k = [rand((64, *row), torch.bfloat16, device, gen) for _ in range(L)]
    v = [rand((64, *row), torch.bfloat16, device, gen) for _ in range(L)]
    host = host_tensor(ops.sglang_host_shape("page_first", n_layers=L, total_slots=32,
                                             row_shape=row, page_size=P), torch.bfloat16,
                       device, gen)
    dslots = slots_of(torch.tensor([7, 2, 5]), P).to(device)
    hslots = slots_of(torch.tensor([0, 3, 1]), P).to(device)
    ops.sglang_device_to_host(k, v, host, dslots, hslots, layout="page_first", page_size=P)
    k2 = [torch.zeros_like(t) for t in k]
    v2 = [torch.zeros_like(t) for t in v]
    ops.sglang_host_to_device(k2, v2, host, dslots, hslots, layout="page_first", page_size=P)
    for a, b in zip(k + v, k2 + v2):
        assert torch.equal(bits(a)[dslots], bits(b)[dslots])


def test_sglang_many_layers(device):
    """More layer pointers than a kernel launch carries (CUDA: the table goes to the GPU)."""
    run_sglang(device, layout="layer_first", to_host=True, dtype=torch.float16, mla=False,
               page_size=2, row_shape=(1, 3), n_layers=230, dev_pages=3, host_pages=3, n=2)
    run_sglang(device, layout="page_first", to_host=False, dtype=torch.float16, mla=False,
               page_size=2, row_shape=(1, 3), n_layers=230, dev_pages=3, host_pages=3, n=2,
               layer=229)


def test_cuda_graph_capture():
    """The CUDA ops record into a CUDA graph; a replay copies the indices current then."""
    need_cuda(CUDA_OK, f"no usable CUDA device: {CUDA_REASON}")
    gen = torch.Generator().manual_seed(11)
    dev, P, L = torch.device("cuda"), 4, 3
    k = [rand((32, 2, 8), torch.bfloat16, dev, gen) for _ in range(L)]
    v = [rand((32, 2, 8), torch.bfloat16, dev, gen) for _ in range(L)]
    host = host_tensor(ops.sglang_host_shape("page_first", n_layers=L, total_slots=16,
                                             row_shape=(2, 8), page_size=P), torch.bfloat16,
                       dev, gen)
    dslots = slots_of(torch.tensor([1, 6]), P).to(dev)
    hslots = slots_of(torch.tensor([3, 0]), P).to(dev)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the graph
        ops.sglang_device_to_host(k, v, host, dslots, hslots, layout="page_first", page_size=P)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.sglang_device_to_host(k, v, host, dslots, hslots, layout="page_first", page_size=P)
    dslots.copy_(slots_of(torch.tensor([7, 2]), P).to(dev))
    want_k, want_v, want_host = sglang_oracle(k, v, host, dslots.cpu(), hslots.cpu(),
                                              "page_first", P, None, True)
    graph.replay()
    torch.cuda.synchronize()
    assert same(host, want_host)


# ---- vLLM ----------------------------------------------------------------------------------

B, BS, H, D, L = 5, 4, 2, 6, 3


def _permuted(physical, order):
    return lambda dtype, device, gen: rand(physical, dtype, device, gen).permute(*order)


def _sliced(physical, index):
    return lambda dtype, device, gen: rand(physical, dtype, device, gen)[index]


# name: (make one layer tensor, kv_dim, block_dim, layer_dim, per-layer tensors?)
VLLM_LAYOUTS = {
    "flash_attn": (lambda dt, dev, g: rand((2, B, BS, H, D), dt, dev, g), 0, 1, None),
    "flashinfer": (lambda dt, dev, g: rand((B, 2, BS, H, D), dt, dev, g), 1, 0, None),
    "flash_attn_hnd": (_permuted((2, B, H, BS, D), (0, 1, 3, 2, 4)), 0, 1, None),
    "flashinfer_hnd": (_permuted((B, 2, H, BS, D), (0, 1, 3, 2, 4)), 1, 0, None),
    "packed_kv": (lambda dt, dev, g: rand((B, H, BS, 2 * D), dt, dev, g),
                  ops.KV_DIM_PACKED_LAST, 0, None),
    "mla": (lambda dt, dev, g: rand((B, BS, 9), dt, dev, g), ops.KV_DIM_NONE, 0, None),
    "padded_head_dim": (_sliced((B, 2, BS, H, D + 3), (Ellipsis, slice(0, D))), 1, 0, None),
    "odd_row": (lambda dt, dev, g: rand((B, 2, 3, 1, 5), dt, dev, g), 1, 0, None),
    "cross_layer": (lambda dt, dev, g: rand((B, L, 2, BS, H, D), dt, dev, g), 2, 0, 1),
    "cross_layer_lbhnc": (lambda dt, dev, g: rand((L, B, H, BS, 7), dt, dev, g),
                          ops.KV_DIM_NONE, 1, 0),
}


def vllm_positions(t, kv_dim, block_dim, layer_dim):
    """(blocks, layers, n_kv, elems): logical flat positions in t of each block's elements in
    t's memory order (the order the page buffer holds them in)."""
    idx = torch.empty_strided(tuple(t.shape), t.stride(), dtype=torch.int64)
    idx.copy_(torch.arange(t.numel()).view(tuple(t.shape)))
    kv = kv_dim
    if kv_dim == ops.KV_DIM_PACKED_LAST:
        idx = idx.unflatten(-1, (2, t.shape[-1] // 2))
        kv = idx.dim() - 2
    lead = [block_dim] + ([layer_dim] if layer_dim is not None else []) + ([kv] if kv >= 0 else [])
    rest = sorted((d for d in range(idx.dim()) if d not in lead), key=lambda d: -idx.stride(d))
    n_layers = idx.shape[layer_dim] if layer_dim is not None else 1
    n_kv = idx.shape[kv] if kv >= 0 else 1
    return idx.permute(*lead, *rest).reshape(idx.shape[block_dim], n_layers, n_kv, -1)


def vllm_oracle(layers, pages, block_ids, page_ids, kv_dim, block_dim, layer_dim, to_pages):
    """Expected (layers, pages) as integer CPU tensors, layers in logical (contiguous) order."""
    flat = [bits(t).cpu().contiguous().view(-1).clone() for t in layers]
    pages = bits(pages).cpu().clone()
    pos = vllm_positions(layers[0], kv_dim, block_dim, layer_dim)
    keep = (block_ids >= 0) & (page_ids >= 0)
    b, p = block_ids[keep], page_ids[keep]
    out = pages.view(pages.shape[0], -1, pos.shape[2], pos.shape[3])
    if layer_dim is not None:
        if to_pages:
            out[p] = flat[0][pos[b]]
        else:
            flat[0][pos[b]] = out[p]
    else:
        for li, f in enumerate(flat):
            if to_pages:
                out[p, li] = f[pos[b, 0]]
            else:
                f[pos[b, 0]] = out[p, li]
    return [f.view(tuple(layers[0].shape)) for f in flat], pages


def run_vllm(device, name, *, to_pages, dtype, n=3, n_pages=4, repeat_src=False, skip_src=(),
             skip_dst=(), seed=0, pinned_pages=False):
    gen = torch.Generator().manual_seed(seed)
    make, kv_dim, block_dim, layer_dim = VLLM_LAYOUTS[name]
    layers = [make(dtype, device, gen) for _ in range(1 if layer_dim is not None else L)]
    page_shape = ops.vllm_page_shape(layers, kv_dim=kv_dim, block_dim=block_dim,
                                     layer_dim=layer_dim)
    if pinned_pages:
        pages = host_tensor((n_pages, *page_shape), dtype, device, gen)
    else:
        pages = rand((n_pages, *page_shape), dtype, device, gen)
    n_blocks = layers[0].shape[block_dim]
    if to_pages:
        block_ids, page_ids = page_pairs(n_blocks, n_pages, n, gen, repeat_src=repeat_src,
                                         skip_src=skip_src, skip_dst=skip_dst)
    else:
        page_ids, block_ids = page_pairs(n_pages, n_blocks, n, gen, repeat_src=repeat_src,
                                         skip_src=skip_src, skip_dst=skip_dst)
    want_layers, want_pages = vllm_oracle(layers, pages, block_ids, page_ids, kv_dim, block_dim,
                                          layer_dim, to_pages)
    strides = [t.stride() for t in layers]
    fn = ops.vllm_blocks_to_pages if to_pages else ops.vllm_pages_to_blocks
    arg = layers[0] if layer_dim is not None else layers
    fn(arg, pages, block_ids.to(device), page_ids.to(device), kv_dim=kv_dim,
       block_dim=block_dim, layer_dim=layer_dim)
    if device.type == "cuda":
        torch.cuda.synchronize()
    assert same(pages, want_pages)
    assert all(same(a, b) for a, b in zip(layers, want_layers))
    assert [t.stride() for t in layers] == strides


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("to_pages", [True, False], ids=["pack", "unpack"])
@pytest.mark.parametrize("name", list(VLLM_LAYOUTS))
def test_vllm_layouts(device, name, to_pages, dtype):
    run_vllm(device, name, to_pages=to_pages, dtype=dtype, skip_dst=(1,))


@pytest.mark.parametrize("to_pages", [True, False], ids=["pack", "unpack"])
@pytest.mark.parametrize("case", ["one_page", "repeated_src", "skip_all", "empty", "all_blocks",
                                  "pinned_pages"])
def test_vllm_odd_cases(device, case, to_pages):
    kw = {"one_page": dict(n=1, n_pages=1),
          "repeated_src": dict(repeat_src=True),
          "skip_all": dict(skip_src=(0, 1, 2)),
          "empty": dict(n=0),
          "all_blocks": dict(n=4, n_pages=5),
          "pinned_pages": dict(pinned_pages=True)}[case]
    run_vllm(device, "flashinfer_hnd", to_pages=to_pages, dtype=torch.bfloat16, **kw)


# ---- Errors --------------------------------------------------------------------------------


def sglang_args(**over):
    """Valid CPU arguments for an MHA page_first copy of 2 pages of 2 slots; `over` replaces."""
    a = dict(k_layers=[torch.zeros(8, 2, 4) for _ in range(3)],
             v_layers=[torch.zeros(8, 2, 4) for _ in range(3)],
             host=torch.zeros(2, 6, 3, 2, 4),
             device_indices=torch.tensor([2, 3, 6, 7]),
             host_indices=torch.tensor([0, 1, 4, 5]),
             layout="page_first", page_size=2)
    a.update(over)
    return a


def call_sglang(to_host=True, **over):
    a = sglang_args(**over)
    fn = ops.sglang_device_to_host if to_host else ops.sglang_host_to_device
    kw = {k: a.pop(k) for k in ("layout", "page_size", "layer") if k in a}
    fn(a["k_layers"], a["v_layers"], a["host"], a["device_indices"], a["host_indices"], **kw)


SGLANG_ERRORS = {
    "host_dtype": (dict(host=torch.zeros(2, 6, 3, 2, 4, dtype=torch.float16)), "host has dtype"),
    "layer_dtype": (dict(v_layers=[torch.zeros(8, 2, 4)] * 2 + [torch.zeros(8, 2, 4).half()]),
                    "v_layers[2] has dtype"),
    "layer_shape": (dict(v_layers=[torch.zeros(8, 2, 4)] * 2 + [torch.zeros(8, 4, 2)]),
                    "v_layers[2] has shape"),
    "v_count": (dict(v_layers=[torch.zeros(8, 2, 4)] * 2), "v_layers has 2 tensors"),
    "no_layers": (dict(k_layers=[], v_layers=[]), "k_layers is empty"),
    "layer_ndim": (dict(k_layers=[torch.zeros(8)] * 3, v_layers=[torch.zeros(8)] * 3),
                   "k_layers[0] has shape"),
    "host_ndim": (dict(host=torch.zeros(2, 6, 3, 8)), "host has 4 dimensions"),
    "host_layers": (dict(host=torch.zeros(2, 6, 4, 2, 4)), "host has shape"),
    "host_rows": (dict(host=torch.zeros(2, 6, 3, 4, 2)), "host has shape"),
    "host_kv": (dict(host=torch.zeros(3, 6, 3, 2, 4)), "host has shape"),
    "host_slots": (dict(host=torch.zeros(2, 5, 3, 2, 4)), "not a multiple of page_size"),
    "direct_page_size": (dict(layout="page_first_direct", host=torch.zeros(2, 2, 3, 3, 2, 4)),
                         "host has shape"),
    "layout": (dict(layout="token_first"), "layout is 'token_first'"),
    "page_size": (dict(page_size=0), "page_size is 0"),
    "index_dtype": (dict(device_indices=torch.tensor([2, 3, 6, 7], dtype=torch.int32)),
                    "device_indices has dtype torch.int32"),
    "index_ndim": (dict(host_indices=torch.tensor([[0, 1], [4, 5]])), "host_indices has shape"),
    "index_count": (dict(host_indices=torch.tensor([0, 1])), "but host_indices has 2"),
    "whole_pages": (dict(device_indices=torch.tensor([2, 3, 6]), host_indices=torch.tensor(
        [0, 1, 4])), "device_indices has 3 slots"),
    "index_device": (dict(host_indices=torch.zeros(4, dtype=torch.int64, device="meta")),
                     "host_indices is on meta"),
    "host_device": (dict(host=torch.zeros(2, 6, 3, 2, 4, device="meta")), "host is on meta"),
    "k_contiguous": (dict(k_layers=[torch.zeros(8, 4, 2).transpose(1, 2)] * 3),
                     "k_layers[0] is not contiguous"),
    "host_contiguous": (dict(host=torch.zeros(2, 3, 6, 2, 4).transpose(1, 2)),
                        "host is not contiguous"),
    "layer": (dict(layer=3), "layer is 3"),
    "unaligned_slots": (dict(device_indices=torch.tensor([3, 4, 6, 7])), "device_indices:"),
    "broken_page": (dict(host_indices=torch.tensor([0, 2, 4, 5])), "host_indices:"),
}


@pytest.mark.parametrize("to_host", [True, False], ids=["d2h", "h2d"])
@pytest.mark.parametrize("case", list(SGLANG_ERRORS))
def test_sglang_errors(case, to_host):
    over, text = SGLANG_ERRORS[case]
    with pytest.raises(InvalidArgumentError) as info:
        call_sglang(to_host, **over)
    assert text in str(info.value)
    assert isinstance(info.value, ValueError) and isinstance(info.value, KvbError)
    assert info.value.name == "INVALID_ARGUMENT"


@pytest.mark.parametrize("to_host", [True, False], ids=["d2h", "h2d"])
@pytest.mark.parametrize("side", ["device_indices", "host_indices"])
def test_sglang_index_out_of_range(to_host, side):
    """A page past the end of its side: OutOfBoundsError naming the argument, nothing copied."""
    a = sglang_args(k_layers=[torch.ones(8, 2, 4) for _ in range(3)],
                    v_layers=[torch.ones(8, 2, 4) for _ in range(3)],
                    host=torch.full((2, 6, 3, 2, 4), 2.0))
    a[side] = torch.tensor([0, 1, 8, 9]) if side == "device_indices" else torch.tensor(
        [0, 1, 6, 7])
    before = [t.clone() for t in a["k_layers"] + a["v_layers"] + [a["host"]]]
    with pytest.raises(OutOfBoundsError) as info:
        call_sglang(to_host, **a)
    assert side in str(info.value)
    after = a["k_layers"] + a["v_layers"] + [a["host"]]
    assert all(torch.equal(x, y) for x, y in zip(before, after))


def vllm_args(**over):
    a = dict(layers=[torch.zeros(5, 2, 4, 2, 6) for _ in range(3)],
             pages_buf=torch.zeros(4, 3, 2, 48),
             block_ids=torch.tensor([0, 3]), page_ids=torch.tensor([1, 2]),
             kv_dim=1, block_dim=0)
    a.update(over)
    return a


def call_vllm(to_pages=True, **over):
    a = vllm_args(**over)
    fn = ops.vllm_blocks_to_pages if to_pages else ops.vllm_pages_to_blocks
    fn(a.pop("layers"), a.pop("pages_buf"), a.pop("block_ids"), a.pop("page_ids"), **a)


VLLM_ERRORS = {
    "pages_dtype": (dict(pages_buf=torch.zeros(4, 3, 2, 48, dtype=torch.bfloat16)),
                    "pages_buf has dtype"),
    "pages_shape": (dict(pages_buf=torch.zeros(4, 3, 2, 47)), "pages_buf has shape"),
    "pages_contiguous": (dict(pages_buf=torch.zeros(48, 3, 2, 4).permute(3, 1, 2, 0)),
                         "pages_buf is not contiguous"),
    "layer_strides": (dict(layers=[torch.zeros(5, 2, 4, 2, 6)] * 2
                           + [torch.zeros(5, 2, 2, 4, 6).transpose(2, 3)]),
                      "layers[2] has strides"),
    "layer_dtype": (dict(layers=[torch.zeros(5, 2, 4, 2, 6), torch.zeros(5, 2, 4, 2, 6).half()]),
                    "layers[1] has dtype"),
    "no_layers": (dict(layers=[]), "layers is empty"),
    "block_dim": (dict(block_dim=5), "block_dim is 5"),
    "negative_block_dim": (dict(block_dim=-5), "block_dim is -5"),
    "kv_dim": (dict(kv_dim=7), "kv_dim is 7"),
    "same_dims": (dict(kv_dim=0), "must be different"),
    "packed_odd": (dict(layers=[torch.zeros(5, 2, 4, 2, 5)], kv_dim=ops.KV_DIM_PACKED_LAST,
                        pages_buf=torch.zeros(4, 1, 2, 40)), "KV_DIM_PACKED_LAST"),
    "cross_layer_list": (dict(layer_dim=2), "layer_dim is set"),
    "ids_dtype": (dict(block_ids=torch.tensor([0, 3], dtype=torch.int32)),
                  "block_ids has dtype torch.int32"),
    "ids_count": (dict(page_ids=torch.tensor([1])), "but page_ids has 1"),
    "ids_device": (dict(page_ids=torch.zeros(2, dtype=torch.int64, device="meta")),
                   "page_ids is on meta"),
    # Rows of D inside heads of stride D + 1 inside tokens of a stride that doesn't continue
    # them: not rows of one stride, refused by the library.
    "not_rows": (dict(layers=[torch.zeros(5, 2, 4, 3, 7)[:, :, :, :2, :6]] * 3),
                 "layers: kvb_vllm_block_side"),
}


@pytest.mark.parametrize("to_pages", [True, False], ids=["pack", "unpack"])
@pytest.mark.parametrize("case", list(VLLM_ERRORS))
def test_vllm_errors(case, to_pages):
    over, text = VLLM_ERRORS[case]
    with pytest.raises(InvalidArgumentError) as info:
        call_vllm(to_pages, **over)
    assert text in str(info.value)


@pytest.mark.parametrize("to_pages", [True, False], ids=["pack", "unpack"])
@pytest.mark.parametrize("side", ["block_ids", "page_ids"])
def test_vllm_index_out_of_range(to_pages, side):
    a = vllm_args(layers=[torch.ones(5, 2, 4, 2, 6) for _ in range(3)],
                  pages_buf=torch.full((4, 3, 2, 48), 2.0))
    a[side] = torch.tensor([0, 5]) if side == "block_ids" else torch.tensor([1, 4])
    before = [t.clone() for t in a["layers"] + [a["pages_buf"]]]
    with pytest.raises(OutOfBoundsError) as info:
        call_vllm(to_pages, **a)
    assert side in str(info.value)
    assert all(torch.equal(x, y) for x, y in zip(before, a["layers"] + [a["pages_buf"]]))


def test_cuda_available_reason():
    ok, reason = ops.cuda_available()
    assert isinstance(ok, bool) and isinstance(reason, str)
    assert ok == (reason == "")


# ---- torch.compile and opcheck -------------------------------------------------------------


def test_compile_sglang():
    gen = torch.Generator().manual_seed(3)
    k = [rand((8, 2, 4), torch.bfloat16, "cpu", gen) for _ in range(2)]
    v = [rand((8, 2, 4), torch.bfloat16, "cpu", gen) for _ in range(2)]
    host = torch.zeros(2, 3, 2, 2, 2, 4, dtype=torch.bfloat16)  # page_first_direct, 6 slots
    di, hi = torch.tensor([2, 3, 6, 7]), torch.tensor([4, 5, 0, 1])

    @torch.compile(fullgraph=True, backend="aot_eager")
    def backup_then_load(k, v, host, k2, v2):
        ops.sglang_device_to_host(k, v, host, di, hi, layout="page_first_direct", page_size=2)
        ops.sglang_host_to_device(k2, v2, host, di, hi, layout="page_first_direct", page_size=2)

    k2 = [torch.zeros_like(t) for t in k]
    v2 = [torch.zeros_like(t) for t in v]
    backup_then_load(k, v, host, k2, v2)
    want_k, want_v, want_host = sglang_oracle(k, v, torch.zeros_like(host), di, hi,
                                              "page_first_direct", 2, None, True)
    assert same(host, want_host)
    for a, b in zip(k + v, k2 + v2):
        assert torch.equal(bits(a)[di], bits(b)[di])
        assert not bits(b)[[0, 1, 4, 5]].any()


def test_compile_vllm():
    gen = torch.Generator().manual_seed(4)
    layers = [rand((5, 2, 4, 2, 6), torch.float16, "cpu", gen) for _ in range(2)]
    pages = torch.zeros(3, 2, 2, 48, dtype=torch.float16)
    blocks, page_ids = torch.tensor([4, 0, 2]), torch.tensor([0, 1, -1])

    @torch.compile(fullgraph=True, backend="aot_eager")
    def pack(layers, pages):
        ops.vllm_blocks_to_pages(layers, pages, blocks, page_ids, kv_dim=1, block_dim=0)
        return pages.sum()

    pack(layers, pages)
    _, want = vllm_oracle(layers, torch.zeros_like(pages), blocks, page_ids, 1, 0, None, True)
    assert same(pages, want)


def _opcheck_cases():
    gen = torch.Generator().manual_seed(5)
    k = [rand((8, 2, 4), torch.float32, "cpu", gen) for _ in range(2)]
    v = [rand((8, 2, 4), torch.float32, "cpu", gen) for _ in range(2)]
    host = rand((2, 2, 6, 2, 4), torch.float32, "cpu", gen)
    di, hi = torch.tensor([2, 3, 6, 7]), torch.tensor([4, 5, 0, 1])
    layers = [rand((5, 4, 2, 12), torch.float32, "cpu", gen) for _ in range(2)]
    pages = rand((3, 2, 2, 48), torch.float32, "cpu", gen)
    ids = torch.tensor([4, 0, 2]), torch.tensor([2, 1, 0])
    kb = torch.ops.kvbridge
    return {
        "sglang_device_to_host": (kb.sglang_device_to_host.default,
                                  (k, v, host, di, hi, "layer_first", 2, None, 0)),
        "sglang_device_to_host_layer": (kb.sglang_device_to_host.default,
                                        (k, [], host[0], di, hi, "layer_first", 2, 1, 0)),
        "sglang_host_to_device": (kb.sglang_host_to_device.default,
                                  (k, v, host, di, hi, "layer_first", 2, None, 0)),
        "sglang_host_to_device_mla": (kb.sglang_host_to_device.default,
                                      (k, [], host[1], di, hi, "layer_first", 2, None, 0)),
        "vllm_blocks_to_pages": (kb.vllm_blocks_to_pages.default,
                                 (layers, pages, *ids, ops.KV_DIM_PACKED_LAST, 0, None, 0)),
        "vllm_pages_to_blocks": (kb.vllm_pages_to_blocks.default,
                                 (layers, pages, *ids, ops.KV_DIM_PACKED_LAST, 0, None, 0)),
    }


@pytest.mark.parametrize("case", list(_opcheck_cases()))
def test_opcheck(case):
    op, args = _opcheck_cases()[case]
    torch.library.opcheck(op, args)


def test_the_eager_copies_register_no_torch_op():
    """kvbridge._page_copy (the vLLM connector's host staging) copies like the registered ops
    and leaves torch's operator registry alone: a vLLM worker that stages never registers ops
    it does not call."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import json, sys, torch
        from kvbridge import _page_copy
        from kvbridge.integrations._vllm_core import layout_of
        from kvbridge.integrations._vllm_stage import Stager
        g = torch.Generator().manual_seed(3)
        kv = {f"l{i}": torch.randn(6, 2, 4, 8, generator=g) for i in range(2)}
        st = Stager(kv, layout_of(kv, 6), staging_bytes=3 * 2 * 2 * 4 * 8 * 4)
        st.gather([4, 0, 2], [2, 0, 1])
        back = {n: torch.zeros_like(t) for n, t in kv.items()}
        st.layers = [back[n] for n in sorted(back)]
        st.scatter([2, 0, 1], [4, 0, 2])
        same = all(torch.equal(back[n][b], kv[n][b]) for n in kv for b in (0, 2, 4))
        print(json.dumps({"same": same, "ops_module": "kvbridge.ops" in sys.modules,
                          "registered": hasattr(torch.ops.kvbridge, "vllm_blocks_to_pages")}))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    import json

    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"same": True, "ops_module": False, "registered": False}
    # The registered op and the eager copy move the same bytes.
    g = torch.Generator().manual_seed(4)
    layers = [torch.randn(5, 2, 4, 8, generator=g) for _ in range(2)]
    pages_a = torch.zeros(3, *ops.vllm_page_shape(layers, kv_dim=1, block_dim=0))
    pages_b = torch.zeros_like(pages_a)
    blocks, pages = torch.tensor([3, 1, 4]), torch.tensor([0, 2, 1])
    ops.vllm_blocks_to_pages(layers, pages_a, blocks, pages, kv_dim=1, block_dim=0)
    from kvbridge import _page_copy

    _page_copy.vllm_blocks_to_pages(layers, pages_b, blocks, pages, kv_dim=1, block_dim=0)
    assert torch.equal(pages_a, pages_b) and pages_a.abs().sum() > 0
