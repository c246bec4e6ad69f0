"""Torch ops that copy KV-cache pages between an engine's KV cache and kvbridge's host layouts.

Four ops, registered with ``torch.library`` in the ``kvbridge`` namespace, each with a CPU and
a CUDA implementation and a fake (meta) one, so they run eagerly, under ``torch.compile`` and
inside CUDA graphs::

    torch.ops.kvbridge.sglang_device_to_host    SGLang device pool -> host pool
    torch.ops.kvbridge.sglang_host_to_device    SGLang host pool   -> device pool
    torch.ops.kvbridge.vllm_blocks_to_pages     vLLM block tensors -> contiguous page buffer
    torch.ops.kvbridge.vllm_pages_to_blocks     contiguous page buffer -> vLLM block tensors

The functions of the same names below are the documented way to call them. Each op writes
its destination in place and returns nothing. Copies are byte-level, so every dtype works
(fp32, bf16, fp16, fp8, ...) as long as both sides have the same one. Index tensors are
int64 and 1-D; a negative index on either side skips that entry (nothing is read or written
for it). The destination's indices must not repeat; the source's may.

Where the copy runs: on the CPU when every tensor is on the CPU (threads: ``num_threads``,
0 lets the library pick); on the GPU when the engine-side tensors and the indices are on one
CUDA device, then the host-side tensor (SGLang ``host``, vLLM ``pages_buf``) may be on that
device or in pinned CPU memory, and the kernel is enqueued on
``torch.cuda.current_stream()`` without waiting. The GPU path does not read the indices on
the host: an index past the end of its side is skipped there, while the CPU path raises
:class:`~kvbridge.errors.OutOfBoundsError` and copies nothing.

Malformed arguments raise :class:`~kvbridge.errors.InvalidArgumentError` (a ``ValueError``)
naming the argument, before anything is copied. docs/ops.md has the whole story.

Example (SGLang HiCache backup of two pages of 4 tokens, page_first host layout)::

    import torch
    from kvbridge import ops

    L, H, D, P = 2, 8, 128, 4
    k = [torch.randn(64, H, D, dtype=torch.bfloat16) for _ in range(L)]
    v = [torch.randn(64, H, D, dtype=torch.bfloat16) for _ in range(L)]
    host = torch.empty(ops.sglang_host_shape("page_first", n_layers=L, total_slots=32,
                                             row_shape=(H, D), page_size=P),
                       dtype=torch.bfloat16)
    device_indices = torch.tensor([8, 9, 10, 11, 20, 21, 22, 23])  # pages 2 and 5
    host_indices = torch.arange(8)                                  # host pages 0 and 1
    ops.sglang_device_to_host(k, v, host, device_indices, host_indices,
                              layout="page_first", page_size=P)
"""

import inspect
import math
import threading
from typing import List, Optional, Sequence, Tuple, Union

import torch

from kvbridge import _C
from kvbridge.errors import InvalidArgumentError, OutOfBoundsError

__all__ = [
    "SGLANG_LAYOUTS",
    "KV_DIM_NONE",
    "KV_DIM_PACKED_LAST",
    "cuda_available",
    "sglang_device_to_host",
    "sglang_host_to_device",
    "sglang_host_shape",
    "vllm_blocks_to_pages",
    "vllm_pages_to_blocks",
    "vllm_page_shape",
]

#: SGLang host pool layouts (``HostKVCache`` ``layout``); MLA drops the leading 2.
#: ``layer_first (2, L, S, H, D)``, ``page_first (2, S, L, H, D)``,
#: ``page_first_direct (2, S // P, L, P, H, D)``.
SGLANG_LAYOUTS = ("layer_first", "page_first", "page_first_direct")
_LAYOUT_CODES = {
    "layer_first": _C.SGLANG_LAYER_FIRST,
    "page_first": _C.SGLANG_PAGE_FIRST,
    "page_first_direct": _C.SGLANG_PAGE_FIRST_DIRECT,
}

#: ``kv_dim`` for a vLLM tensor without K/V parts (MLA: one latent vector per token).
KV_DIM_NONE: int = _C.KV_DIM_NONE
#: ``kv_dim`` for a vLLM tensor whose last dimension holds K then V, ``(..., 2 * D)``.
KV_DIM_PACKED_LAST: int = _C.KV_DIM_PACKED_LAST

# The kernels address tensors by their strides, so torch.compile must hand them over as laid
# out by the caller (custom_op takes tags from torch 2.5 on).
_STRIDE_TAG = getattr(torch.Tag, "needs_exact_strides", torch.Tag.needs_fixed_stride_order)
_TAGS = ({"tags": (_STRIDE_TAG,)}
         if "tags" in inspect.signature(torch.library.custom_op).parameters else {})


def cuda_available() -> Tuple[bool, str]:
    """Whether the CUDA ops can run in this process: ``(True, "")`` or ``(False, reason)``."""
    usable, reason = _C.cuda_kernels_available()
    if not usable:
        return False, f"kvbridge kernels: {reason}"
    if not torch.cuda.is_available():
        return False, "torch.cuda.is_available() is False (no CUDA device visible to torch)"
    return True, ""


# ---- Argument checks (shapes, dtypes, devices only: they also run on fake tensors) --------


def _fail(op: str, message: str) -> None:
    raise InvalidArgumentError(f"{op}: {message}")


def _shape(t: torch.Tensor) -> Tuple[int, ...]:
    return tuple(t.shape)


def _check_same(op: str, named: List[Tuple[str, torch.Tensor]], contiguous: bool) -> None:
    """Every tensor has the first one's shape and dtype (and strides, when not contiguous)."""
    ref_name, ref = named[0]
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            _fail(op, f"{name} is a {type(t).__name__}, not a torch.Tensor")
        if t.dtype != ref.dtype:
            _fail(op, f"{name} has dtype {t.dtype} but {ref_name} has {ref.dtype}; all the "
                      "engine's layer tensors must have one dtype")
        if _shape(t) != _shape(ref):
            _fail(op, f"{name} has shape {_shape(t)} but {ref_name} has {_shape(ref)}")
        if contiguous:
            if not t.is_contiguous():
                _fail(op, f"{name} is not contiguous (strides {t.stride()}); SGLang's per-layer "
                          "buffers are dense (slots, H, D) tensors")
        elif t.stride() != ref.stride():
            _fail(op, f"{name} has strides {t.stride()} but {ref_name} has {ref.stride()}; "
                      "all layers must share one layout")


def _check_indices(op: str, a: Tuple[str, torch.Tensor], b: Tuple[str, torch.Tensor],
                   page_size: int) -> None:
    for name, idx in (a, b):
        if not isinstance(idx, torch.Tensor):
            _fail(op, f"{name} is a {type(idx).__name__}, not a torch.Tensor")
        if idx.dtype != torch.int64:
            _fail(op, f"{name} has dtype {idx.dtype}; indices must be torch.int64")
        if idx.dim() != 1:
            _fail(op, f"{name} has shape {_shape(idx)}; indices must be 1-D")
    if a[1].numel() != b[1].numel():
        _fail(op, f"{a[0]} has {a[1].numel()} entries but {b[0]} has {b[1].numel()}; "
                  "they are pairs")
    if a[1].numel() % page_size != 0:
        _fail(op, f"{a[0]} has {a[1].numel()} slots, not a whole number of pages of "
                  f"page_size {page_size}")


def _check_placement(op: str, engine: List[Tuple[str, torch.Tensor]],
                     host: Tuple[str, torch.Tensor], real: bool) -> bool:
    """Checks devices; True when the copy runs on CUDA.

    CPU: every tensor on the CPU. CUDA: the engine-side tensors and the indices on one CUDA
    device, the host-side tensor on that device or in pinned CPU memory (checked only on real
    tensors).
    """
    ref_name, ref = engine[0]
    dev = ref.device
    if dev.type not in ("cpu", "cuda"):
        _fail(op, f"{ref_name} is on {dev}; kvbridge ops run on cpu or cuda tensors")
    for name, t in engine[1:]:
        if t.device != dev:
            _fail(op, f"{name} is on {t.device} but {ref_name} is on {dev}; the engine's "
                      "tensors and both index tensors must be on one device")
    host_name, h = host
    if dev.type == "cpu":
        if h.device.type != "cpu":
            _fail(op, f"{host_name} is on {h.device} but {ref_name} is on the CPU")
        return False
    if h.device == dev:
        return True
    if h.device.type != "cpu":
        _fail(op, f"{host_name} is on {h.device}; with {ref_name} on {dev} it must be on {dev} "
                  "or in pinned CPU memory")
    # Not re-checked while a CUDA graph is being captured (the warm-up call checked it): a
    # pointer-attribute query is not a call to make inside a capture.
    if real and not torch.cuda.is_current_stream_capturing() and not h.is_pinned():
        _fail(op, f"{host_name} is in pageable CPU memory; the GPU can only reach pinned "
                  f"memory (allocate it with pin_memory=True) or memory on {dev}")
    return True


def sglang_host_shape(layout: str, *, n_layers: int, total_slots: int,
                      row_shape: Sequence[int], page_size: int = 1,
                      mla: bool = False) -> Tuple[int, ...]:
    """The shape of an SGLang host pool (what ``HostKVCache`` allocates).

    ``row_shape`` is one token's shape in one layer, ``(H, D)`` (MLA: ``(1, C)``), and
    ``total_slots`` (S) a multiple of ``page_size`` (P):

    * ``layer_first``: ``(2, L, S, *row_shape)``
    * ``page_first``: ``(2, S, L, *row_shape)``
    * ``page_first_direct``: ``(2, S // P, L, P, *row_shape)``

    MLA (``mla=True``) drops the leading 2.
    """
    if layout not in _LAYOUT_CODES:
        _fail("sglang_host_shape", f"layout is {layout!r}; expected one of {SGLANG_LAYOUTS}")
    if page_size < 1 or total_slots % page_size != 0:
        _fail("sglang_host_shape",
              f"total_slots ({total_slots}) must be a multiple of page_size ({page_size} >= 1)")
    pre = () if mla else (2,)
    if layout == "layer_first":
        body = (n_layers, total_slots)
    elif layout == "page_first":
        body = (total_slots, n_layers)
    else:
        body = (total_slots // page_size, n_layers, page_size)
    return pre + body + tuple(row_shape)


def _host_shape_text(layout: str, mla: bool, n_layers: int, page_size: int,
                     row_shape: Tuple[int, ...]) -> str:
    pre = "" if mla else "2, "
    row = ", ".join(str(x) for x in row_shape)
    body = {"layer_first": f"L={n_layers}, S",
            "page_first": f"S, L={n_layers}",
            "page_first_direct": f"S // P, L={n_layers}, P={page_size}"}[layout]
    return f"({pre}{body}, {row})"


class _SglangGeometry:
    __slots__ = ("n_layers", "n_kv", "device_slots", "host_slots", "row_bytes")

    def __init__(self, n_layers, n_kv, device_slots, host_slots, row_bytes):
        self.n_layers = n_layers
        self.n_kv = n_kv
        self.device_slots = device_slots
        self.host_slots = host_slots
        self.row_bytes = row_bytes


def _sglang_check(op: str, k_layers: List[torch.Tensor], v_layers: List[torch.Tensor],
                  host: torch.Tensor, device_indices: torch.Tensor, host_indices: torch.Tensor,
                  layout: str, page_size: int, layer: Optional[int],
                  real: bool) -> Tuple[_SglangGeometry, bool]:
    """Validates an SGLang copy's arguments; returns its geometry and whether it runs on CUDA."""
    if layout not in _LAYOUT_CODES:
        _fail(op, f"layout is {layout!r}; expected one of {SGLANG_LAYOUTS}")
    if page_size < 1:
        _fail(op, f"page_size is {page_size}; it must be >= 1")
    if len(k_layers) == 0:
        _fail(op, "k_layers is empty; pass one (slots, H, D) tensor per layer")
    mla = len(v_layers) == 0
    if not mla and len(v_layers) != len(k_layers):
        _fail(op, f"v_layers has {len(v_layers)} tensors but k_layers has {len(k_layers)}; pass "
                  "one V tensor per layer (or none for MLA)")
    named = [(f"k_layers[{i}]", t) for i, t in enumerate(k_layers)]
    named += [(f"v_layers[{i}]", t) for i, t in enumerate(v_layers)]
    _check_same(op, named, contiguous=True)
    ref = k_layers[0]
    if ref.dim() < 2:
        _fail(op, f"k_layers[0] has shape {_shape(ref)}; per-layer buffers are (slots, H, D) "
                  "(MLA: (slots, 1, C)), at least 2-D")
    n_layers = len(k_layers)
    row_shape = _shape(ref)[1:]
    if not isinstance(host, torch.Tensor):
        _fail(op, f"host is a {type(host).__name__}, not a torch.Tensor")
    if host.dtype != ref.dtype:
        _fail(op, f"host has dtype {host.dtype} but k_layers[0] has {ref.dtype}; the copy moves "
                  "bytes, so both sides must have one dtype")
    if not host.is_contiguous():
        _fail(op, f"host is not contiguous (strides {host.stride()}); host pools are dense")
    expected = _host_shape_text(layout, mla, n_layers, page_size, row_shape)
    n_pre = 0 if mla else 1
    n_body = 3 if layout == "page_first_direct" else 2
    hs = _shape(host)
    if host.dim() != n_pre + n_body + len(row_shape):
        _fail(op, f"host has {host.dim()} dimensions {hs}; layout {layout!r} "
                  f"({'MLA' if mla else 'MHA'}) needs {n_pre + n_body + len(row_shape)}: "
                  f"{expected}")
    body = hs[n_pre:n_pre + n_body]
    if layout == "layer_first":
        host_layers, host_slots = body
    elif layout == "page_first":
        host_slots, host_layers = body
    else:
        host_pages, host_layers, host_page_size = body
        host_slots = host_pages * host_page_size
    bad = (not mla and hs[0] != 2) or host_layers != n_layers or hs[n_pre + n_body:] != row_shape
    if layout == "page_first_direct" and host_page_size != page_size:
        bad = True
    if bad:
        _fail(op, f"host has shape {hs}; layout {layout!r} with {n_layers} layers, rows of "
                  f"{row_shape} and page_size {page_size} needs {expected}")
    if host_slots % page_size != 0:
        _fail(op, f"host holds {host_slots} slots, not a multiple of page_size {page_size}")
    _check_indices(op, ("device_indices", device_indices), ("host_indices", host_indices),
                   page_size)
    if layer is not None and not 0 <= layer < n_layers:
        _fail(op, f"layer is {layer}; it must be in [0, {n_layers}) or None for all layers")
    cuda = _check_placement(
        op, named + [("device_indices", device_indices), ("host_indices", host_indices)],
        ("host", host), real)
    geometry = _SglangGeometry(n_layers, 1 if mla else 2, _shape(ref)[0], host_slots,
                               math.prod(row_shape) * ref.element_size())
    return geometry, cuda


def vllm_page_shape(layers: Union[torch.Tensor, Sequence[torch.Tensor]], *, kv_dim: int,
                    block_dim: int, layer_dim: Optional[int] = None) -> Tuple[int, int, int]:
    """One page of the page buffer for these block tensors: ``(n_layers, n_kv, block_elems)``.

    ``block_elems`` is the number of elements of one block of one layer and one K/V part.
    Allocate the buffer as ``torch.empty((num_pages, *vllm_page_shape(...)), dtype=...)``.
    """
    layers = _as_list(layers)
    n_layers, n_kv, block_elems = _vllm_check_tensors("vllm_page_shape", layers, kv_dim,
                                                      block_dim, layer_dim)
    return n_layers, n_kv, block_elems


def _as_list(layers) -> List[torch.Tensor]:
    return [layers] if isinstance(layers, torch.Tensor) else list(layers)


def _vllm_check_tensors(op: str, layers: List[torch.Tensor], kv_dim: int, block_dim: int,
                        layer_dim: Optional[int]) -> Tuple[int, int, int]:
    if len(layers) == 0:
        _fail(op, "layers is empty; pass one block tensor per layer (or one cross-layer tensor)")
    named = [(f"layers[{i}]", t) for i, t in enumerate(layers)]
    _check_same(op, named, contiguous=False)
    ref = layers[0]
    nd = ref.dim()
    if not 1 <= nd <= 8:
        _fail(op, f"layers[0] has {nd} dimensions; 1 to 8 are supported")

    def in_range(name: str, d: int) -> None:
        if not 0 <= d < nd:
            _fail(op, f"{name} is {d}; it must be a dimension of the {nd}-d layer tensors "
                      f"(0..{nd - 1}, no negative indexing)")

    in_range("block_dim", block_dim)
    if layer_dim is not None:
        in_range("layer_dim", layer_dim)
        if len(layers) != 1:
            _fail(op, f"layer_dim is set (a cross-layer tensor) but layers has {len(layers)} "
                      "tensors; pass the one cross-layer tensor")
    packed = kv_dim == KV_DIM_PACKED_LAST
    if kv_dim not in (KV_DIM_NONE, KV_DIM_PACKED_LAST):
        in_range("kv_dim", kv_dim)
    dims = [d for d in (block_dim, kv_dim, layer_dim) if d is not None and d >= 0]
    if len(set(dims)) != len(dims):
        _fail(op, f"block_dim ({block_dim}), kv_dim ({kv_dim}) and layer_dim ({layer_dim}) "
                  "must be different dimensions")
    shape = _shape(ref)
    if packed and (nd - 1 in (block_dim, layer_dim) or shape[-1] % 2 != 0):
        _fail(op, f"kv_dim is KV_DIM_PACKED_LAST but the last dimension ({shape[-1]} elements) "
                  "is not an even, per-token dimension")
    n_kv = 2 if packed else (shape[kv_dim] if kv_dim >= 0 else 1)
    n_layers = shape[layer_dim] if layer_dim is not None else len(layers)
    outer = shape[block_dim] * n_kv * (shape[layer_dim] if layer_dim is not None else 1)
    return n_layers, n_kv, ref.numel() // outer


def _vllm_check(op: str, layers: List[torch.Tensor], pages_buf: torch.Tensor,
                block_ids: torch.Tensor, page_ids: torch.Tensor, kv_dim: int, block_dim: int,
                layer_dim: Optional[int], real: bool) -> Tuple[int, int, bool]:
    """Validates a vLLM copy's arguments; returns (n_layers, n_kv, on CUDA)."""
    n_layers, n_kv, block_elems = _vllm_check_tensors(op, layers, kv_dim, block_dim, layer_dim)
    ref = layers[0]
    if not isinstance(pages_buf, torch.Tensor):
        _fail(op, f"pages_buf is a {type(pages_buf).__name__}, not a torch.Tensor")
    if pages_buf.dtype != ref.dtype:
        _fail(op, f"pages_buf has dtype {pages_buf.dtype} but layers[0] has {ref.dtype}; the copy "
                  "moves bytes, so both sides must have one dtype")
    if not pages_buf.is_contiguous():
        _fail(op, f"pages_buf is not contiguous (strides {pages_buf.stride()})")
    page_elems = n_layers * n_kv * block_elems
    if pages_buf.dim() < 1 or math.prod(_shape(pages_buf)[1:]) != page_elems:
        _fail(op, f"pages_buf has shape {_shape(pages_buf)}; it must be (num_pages, {n_layers}, "
                  f"{n_kv}, {block_elems}) (or any contiguous shape with {page_elems} elements "
                  "per page)")
    _check_indices(op, ("block_ids", block_ids), ("page_ids", page_ids), 1)
    cuda = _check_placement(
        op, [(f"layers[{i}]", t) for i, t in enumerate(layers)]
        + [("block_ids", block_ids), ("page_ids", page_ids)], ("pages_buf", pages_buf), real)
    return n_layers, n_kv, cuda


# ---- Running a copy ---------------------------------------------------------------------

# GPU-readable copies of layer tables too large to travel in the kernel's arguments, keyed by
# device and content, so a table is uploaded once (before CUDA-graph capture, by a warm-up
# call). Never evicted: a captured graph keeps the table's address, and an engine has one or
# two sets of KV-cache tensors (8 bytes a layer).
_DEVICE_TABLES: dict = {}
_DEVICE_TABLES_LOCK = threading.Lock()


def _device_table(op: str, ptrs: List[int], device: torch.device) -> int:
    key = (device.index, tuple(ptrs))
    with _DEVICE_TABLES_LOCK:
        table = _DEVICE_TABLES.get(key)
    if table is None:
        if torch.cuda.is_current_stream_capturing():
            raise InvalidArgumentError(
                f"{op}: the {len(ptrs)} layer pointers exceed the {_C.CUDA_INLINE_PTRS} a kernel "
                "launch carries, so they are uploaded to the GPU once per distinct set of layer "
                "tensors; that cannot happen during CUDA-graph capture: call the op once before "
                "capturing (warm-up)")
        table = torch.tensor(ptrs, dtype=torch.int64, device=device)
        with _DEVICE_TABLES_LOCK:
            table = _DEVICE_TABLES.setdefault(key, table)
    return table.data_ptr()


def _slots_to_pages(op: str, name: str, slots: torch.Tensor, page_size: int,
                    cuda: bool) -> torch.Tensor:
    """SGLang token slots -> page indices (slot // page_size of each page's first slot)."""
    if page_size == 1:
        return slots.contiguous()
    if cuda:
        # On the GPU, without a host sync: trusts that slots come in whole, aligned pages.
        first = slots[::page_size]
        return torch.where(first < 0, -1, torch.div(first, page_size, rounding_mode="floor"))
    slots = slots.contiguous()
    pages = torch.empty(slots.numel() // page_size, dtype=torch.int64)
    try:
        _C.sglang_slots_to_pages(slots.data_ptr(), slots.numel(), page_size, pages.data_ptr())
    except InvalidArgumentError as e:
        raise InvalidArgumentError(f"{op}: {name}: {e.message}") from None
    return pages


def _page_copy(op: str, src, dst, src_pages: torch.Tensor, dst_pages: torch.Tensor,
               src_name: str, dst_name: str, device: Optional[torch.device],
               num_threads: int) -> None:
    n = src_pages.numel()
    if n == 0:
        return
    try:
        if device is None:
            _C.page_copy(src, dst, src_pages.data_ptr(), dst_pages.data_ptr(), n, False, 0,
                         num_threads)
        else:
            with torch.cuda.device(device):
                stream = torch.cuda.current_stream(device).cuda_stream
                _C.page_copy(src, dst, src_pages.data_ptr(), dst_pages.data_ptr(), n, True, stream,
                             0)
    except OutOfBoundsError as e:
        name = src_name if "src_pages[" in e.message else dst_name
        raise OutOfBoundsError(f"{op}: {name} names a page past the end of its side; nothing was "
                               f"copied ({e.message})") from None
    except InvalidArgumentError as e:
        raise InvalidArgumentError(f"{op}: {e.message}") from None


def _sglang_copy(op: str, to_host: bool, k_layers: List[torch.Tensor],
                 v_layers: List[torch.Tensor], host: torch.Tensor, device_indices: torch.Tensor,
                 host_indices: torch.Tensor, layout: str, page_size: int, layer: Optional[int],
                 num_threads: int) -> None:
    g, cuda = _sglang_check(op, k_layers, v_layers, host, device_indices, host_indices, layout,
                            page_size, layer, real=True)
    device = k_layers[0].device if cuda else None
    ptrs = [t.data_ptr() for t in k_layers] + [t.data_ptr() for t in v_layers]
    table = 0
    if cuda and g.n_kv * (1 if layer is not None else g.n_layers) > _C.CUDA_INLINE_PTRS:
        table = _device_table(op, ptrs, device)
    try:
        dev_side = _C.sglang_device_side(ptrs, table, g.n_layers, g.n_kv, g.device_slots,
                                         page_size, g.row_bytes)
        host_side = _C.sglang_host_side(_LAYOUT_CODES[layout], host.data_ptr(), g.n_layers,
                                        g.n_kv, g.host_slots, page_size, g.row_bytes)
        if layer is not None:
            dev_side = dev_side.select_layer(layer)
            host_side = host_side.select_layer(layer)
    except InvalidArgumentError as e:
        raise InvalidArgumentError(f"{op}: {e.message}") from None
    dev_pages = _slots_to_pages(op, "device_indices", device_indices, page_size, cuda)
    host_pages = _slots_to_pages(op, "host_indices", host_indices, page_size, cuda)
    if to_host:
        _page_copy(op, dev_side, host_side, dev_pages, host_pages, "device_indices",
                   "host_indices", device, num_threads)
    else:
        _page_copy(op, host_side, dev_side, host_pages, dev_pages, "host_indices",
                   "device_indices", device, num_threads)


def _vllm_copy(op: str, to_pages: bool, layers: List[torch.Tensor], pages_buf: torch.Tensor,
               block_ids: torch.Tensor, page_ids: torch.Tensor, kv_dim: int, block_dim: int,
               layer_dim: Optional[int], num_threads: int) -> None:
    n_layers, n_kv, cuda = _vllm_check(op, layers, pages_buf, block_ids, page_ids, kv_dim,
                                       block_dim, layer_dim, real=True)
    device = layers[0].device if cuda else None
    ref = layers[0]
    if layer_dim is None:
        base, ptrs = 0, [t.data_ptr() for t in layers]
    else:
        base, ptrs = ref.data_ptr(), []
    table = 0
    if cuda and ptrs and n_kv * n_layers > _C.CUDA_INLINE_PTRS:
        table = _device_table(op, ptrs, device)
    try:
        block_side = _C.vllm_block_side(
            list(ref.shape), list(ref.stride()), ref.element_size(), block_dim, kv_dim,
            _C.LAYER_DIM_NONE if layer_dim is None else layer_dim, base, ptrs, table, n_layers)
    except InvalidArgumentError as e:
        raise InvalidArgumentError(f"{op}: layers: {e.message}") from None
    if block_ids.numel() == 0:
        return
    try:
        page_side = _C.page_buffer_side(block_side.geometry, pages_buf.data_ptr(),
                                        pages_buf.shape[0])
    except InvalidArgumentError as e:
        raise InvalidArgumentError(f"{op}: pages_buf: {e.message}") from None
    blocks, pages = block_ids.contiguous(), page_ids.contiguous()
    if to_pages:
        _page_copy(op, block_side, page_side, blocks, pages, "block_ids", "page_ids", device,
                   num_threads)
    else:
        _page_copy(op, page_side, block_side, pages, blocks, "page_ids", "block_ids", device,
                   num_threads)


# ---- The registered ops -----------------------------------------------------------------
# One Python body serves both device types: it tells the CPU and CUDA paths apart by the
# tensors' devices (_check_placement).


@torch.library.custom_op("kvbridge::sglang_device_to_host", mutates_args=("host",),
                         device_types=("cpu", "cuda"), **_TAGS)
def _sglang_device_to_host_op(k_layers: List[torch.Tensor], v_layers: List[torch.Tensor],
                              host: torch.Tensor, device_indices: torch.Tensor,
                              host_indices: torch.Tensor, layout: str, page_size: int,
                              layer: Optional[int], num_threads: int) -> None:
    _sglang_copy("sglang_device_to_host", True, k_layers, v_layers, host, device_indices,
                 host_indices, layout, page_size, layer, num_threads)


@torch.library.custom_op("kvbridge::sglang_host_to_device", mutates_args=("k_layers", "v_layers"),
                         device_types=("cpu", "cuda"), **_TAGS)
def _sglang_host_to_device_op(k_layers: List[torch.Tensor], v_layers: List[torch.Tensor],
                              host: torch.Tensor, device_indices: torch.Tensor,
                              host_indices: torch.Tensor, layout: str, page_size: int,
                              layer: Optional[int], num_threads: int) -> None:
    _sglang_copy("sglang_host_to_device", False, k_layers, v_layers, host, device_indices,
                 host_indices, layout, page_size, layer, num_threads)


@torch.library.custom_op("kvbridge::vllm_blocks_to_pages", mutates_args=("pages_buf",),
                         device_types=("cpu", "cuda"), **_TAGS)
def _vllm_blocks_to_pages_op(layers: List[torch.Tensor], pages_buf: torch.Tensor,
                             block_ids: torch.Tensor, page_ids: torch.Tensor, kv_dim: int,
                             block_dim: int, layer_dim: Optional[int], num_threads: int) -> None:
    _vllm_copy("vllm_blocks_to_pages", True, layers, pages_buf, block_ids, page_ids, kv_dim,
               block_dim, layer_dim, num_threads)


@torch.library.custom_op("kvbridge::vllm_pages_to_blocks", mutates_args=("layers",),
                         device_types=("cpu", "cuda"), **_TAGS)
def _vllm_pages_to_blocks_op(layers: List[torch.Tensor], pages_buf: torch.Tensor,
                             block_ids: torch.Tensor, page_ids: torch.Tensor, kv_dim: int,
                             block_dim: int, layer_dim: Optional[int], num_threads: int) -> None:
    _vllm_copy("vllm_pages_to_blocks", False, layers, pages_buf, block_ids, page_ids, kv_dim,
               block_dim, layer_dim, num_threads)


def _sglang_fake(op: str):
    def fake(k_layers, v_layers, host, device_indices, host_indices, layout, page_size, layer,
             num_threads) -> None:
        _sglang_check(op, k_layers, v_layers, host, device_indices, host_indices, layout,
                      page_size, layer, real=False)
    return fake


def _vllm_fake(op: str):
    def fake(layers, pages_buf, block_ids, page_ids, kv_dim, block_dim, layer_dim,
             num_threads) -> None:
        _vllm_check(op, layers, pages_buf, block_ids, page_ids, kv_dim, block_dim, layer_dim,
                    real=False)
    return fake


_sglang_device_to_host_op.register_fake(_sglang_fake("sglang_device_to_host"))
_sglang_host_to_device_op.register_fake(_sglang_fake("sglang_host_to_device"))
_vllm_blocks_to_pages_op.register_fake(_vllm_fake("vllm_blocks_to_pages"))
_vllm_pages_to_blocks_op.register_fake(_vllm_fake("vllm_pages_to_blocks"))


# ---- The user API -------------------------------------------------------------------------


def sglang_device_to_host(k_layers: Sequence[torch.Tensor],
                          v_layers: Optional[Sequence[torch.Tensor]], host: torch.Tensor,
                          device_indices: torch.Tensor, host_indices: torch.Tensor, *,
                          layout: str, page_size: int = 1, layer: Optional[int] = None,
                          num_threads: int = 0) -> None:
    """Copies pages of SGLang's device KV pool into a host pool (HiCache backup).

    Args:
        k_layers: L tensors of shape ``(slots, H, D)``, one per layer, contiguous, one dtype
            (MLA: the ``kv_buffer`` layers, ``(slots, 1, C)``).
        v_layers: L tensors like ``k_layers`` (the V parts), or ``None`` / ``[]`` for MLA.
        host: the host pool, contiguous, the layers' dtype, shaped by ``layout`` with
            S = host slots and P = ``page_size`` (:func:`sglang_host_shape` computes it):
            ``layer_first (2, L, S, H, D)``, ``page_first (2, S, L, H, D)`` or
            ``page_first_direct (2, S // P, L, P, H, D)``; MLA drops the leading 2.
            Written in place.
        device_indices: int64 ``(n,)``, device token slots, as SGLang passes them.
        host_indices: int64 ``(n,)``, host token slots; entry i pairs with
            ``device_indices[i]``. With ``page_size`` > 1 both are whole pages: each run of
            ``page_size`` entries is the consecutive slots of one page, starting at a multiple
            of ``page_size`` (checked on the CPU; on the GPU only each page's first slot is
            read). A negative slot (a whole page of them) skips that page.
        layout: ``"layer_first"``, ``"page_first"`` or ``"page_first_direct"``.
        page_size: tokens per page (P).
        layer: copy only this layer (SGLang's per-layer transfer), or ``None`` for all.
        num_threads: CPU threads (0: the library picks); ignored on the GPU.

    Runs on the CPU when every tensor is on the CPU, else on the layers' CUDA device, with the
    indices there too and ``host`` there or in pinned memory, enqueued on the current stream.
    """
    torch.ops.kvbridge.sglang_device_to_host(list(k_layers), list(v_layers or []), host,
                                             device_indices, host_indices, layout, page_size,
                                             layer, num_threads)


def sglang_host_to_device(k_layers: Sequence[torch.Tensor],
                          v_layers: Optional[Sequence[torch.Tensor]], host: torch.Tensor,
                          device_indices: torch.Tensor, host_indices: torch.Tensor, *,
                          layout: str, page_size: int = 1, layer: Optional[int] = None,
                          num_threads: int = 0) -> None:
    """Copies pages of an SGLang host pool into the device KV pool (HiCache load).

    The arguments are those of :func:`sglang_device_to_host` (same order, same shapes); here
    ``host`` is read and the ``k_layers`` / ``v_layers`` tensors are written in place, page
    ``host_indices[i]`` going to ``device_indices[i]``. ``device_indices`` must not repeat a
    page; ``host_indices`` may.
    """
    torch.ops.kvbridge.sglang_host_to_device(list(k_layers), list(v_layers or []), host,
                                             device_indices, host_indices, layout, page_size,
                                             layer, num_threads)


def vllm_blocks_to_pages(layers: Union[torch.Tensor, Sequence[torch.Tensor]],
                         pages_buf: torch.Tensor, block_ids: torch.Tensor,
                         page_ids: torch.Tensor, *, kv_dim: int, block_dim: int,
                         layer_dim: Optional[int] = None, num_threads: int = 0) -> None:
    """Packs vLLM KV-cache blocks into a contiguous page buffer (e.g. for a connector).

    Args:
        layers: the per-layer KV-cache tensors (one dtype, one shape, one set of strides), or
            one cross-layer tensor (with ``layer_dim``). Any layout described by shape and
            strides, for example FlashAttention ``(2, num_blocks, block_size, H, D)``
            (``kv_dim=0, block_dim=1``), FlashInfer ``(num_blocks, 2, block_size, H, D)``
            (``kv_dim=1, block_dim=0``), their HND orders as permuted views, packed K|V
            ``(num_blocks, H, block_size, 2 * D)`` (``kv_dim=KV_DIM_PACKED_LAST``), MLA
            ``(num_blocks, block_size, C)`` (``kv_dim=KV_DIM_NONE``), cross-layer
            ``(num_blocks, L, 2, block_size, H, D)`` (``layer_dim=1``). One block of one
            layer and K/V part must be rows of one stride (padded head dims are).
        pages_buf: contiguous ``(num_pages, n_layers, n_kv, block_elems)``
            (:func:`vllm_page_shape`; any contiguous shape with as many elements per page
            works), the layers' dtype. Page p holds, per layer and K/V part, the block's
            elements in the tensor's memory order. Written in place.
        block_ids: int64 ``(n,)`` vLLM block ids (indices along ``block_dim``).
        page_ids: int64 ``(n,)`` pages of ``pages_buf``; block ``block_ids[i]`` goes to page
            ``page_ids[i]``. A negative id on either side skips the entry; page_ids must not
            repeat.
        kv_dim, block_dim, layer_dim: dimensions of the layer tensors, non-negative;
            ``kv_dim`` may be :data:`KV_DIM_NONE` or :data:`KV_DIM_PACKED_LAST`.
        num_threads: CPU threads (0: the library picks); ignored on the GPU.
    """
    torch.ops.kvbridge.vllm_blocks_to_pages(_as_list(layers), pages_buf, block_ids, page_ids,
                                            kv_dim, block_dim, layer_dim, num_threads)


def vllm_pages_to_blocks(layers: Union[torch.Tensor, Sequence[torch.Tensor]],
                         pages_buf: torch.Tensor, block_ids: torch.Tensor,
                         page_ids: torch.Tensor, *, kv_dim: int, block_dim: int,
                         layer_dim: Optional[int] = None, num_threads: int = 0) -> None:
    """Unpacks a contiguous page buffer into vLLM KV-cache blocks.

    The arguments are those of :func:`vllm_blocks_to_pages` (same order, same shapes); here
    ``pages_buf`` is read and the layer tensors are written in place, page ``page_ids[i]``
    going to block ``block_ids[i]``. ``block_ids`` must not repeat; ``page_ids`` may.
    """
    torch.ops.kvbridge.vllm_pages_to_blocks(_as_list(layers), pages_buf, block_ids, page_ids,
                                            kv_dim, block_dim, layer_dim, num_threads)
