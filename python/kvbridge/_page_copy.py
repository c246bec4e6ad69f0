"""The page copies behind kvbridge.ops, without registering anything with torch.

Argument checks and the calls into the native kernels, for the registered ops of
:mod:`kvbridge.ops` and for callers that copy eagerly and must not touch torch's operator
registry: importing this module defines no torch op (the vLLM connector's host staging uses it
directly, docs/vllm.md). Errors are those of :mod:`kvbridge.ops`.
"""

import math
import threading
from typing import List, Optional, Sequence, Tuple, Union

import torch

from kvbridge import _C
from kvbridge.errors import InvalidArgumentError, OutOfBoundsError


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


# ---- Eager copies for kvbridge's own callers ----------------------------------------------


def vllm_blocks_to_pages(layers: List[torch.Tensor], pages_buf: torch.Tensor,
                         block_ids: torch.Tensor, page_ids: torch.Tensor, *, kv_dim: int,
                         block_dim: int) -> None:
    """kvbridge.ops.vllm_blocks_to_pages, eagerly (no torch op; enqueued on the current
    stream on the GPU)."""
    _vllm_copy("vllm_blocks_to_pages", True, layers, pages_buf, block_ids, page_ids, kv_dim,
               block_dim, None, 0)


def vllm_pages_to_blocks(layers: List[torch.Tensor], pages_buf: torch.Tensor,
                         block_ids: torch.Tensor, page_ids: torch.Tensor, *, kv_dim: int,
                         block_dim: int) -> None:
    """kvbridge.ops.vllm_pages_to_blocks, eagerly (no torch op)."""
    _vllm_copy("vllm_pages_to_blocks", False, layers, pages_buf, block_ids, page_ids, kv_dim,
               block_dim, None, 0)
