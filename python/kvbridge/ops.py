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

Importing this module registers the four ops with torch's operator registry. The checks and
copies themselves live in ``kvbridge._page_copy``, which registers nothing: kvbridge's own
eager callers (the vLLM connector's host staging) use that and never touch the registry.

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
from typing import List, Optional, Sequence, Union

import torch

from kvbridge._page_copy import (KV_DIM_NONE, KV_DIM_PACKED_LAST, SGLANG_LAYOUTS, _as_list,
                                 _sglang_check, _sglang_copy, _vllm_check, _vllm_copy,
                                 cuda_available, sglang_host_shape, vllm_page_shape)

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

# The kernels address tensors by their strides, so torch.compile must hand them over as laid
# out by the caller (custom_op takes tags from torch 2.5 on).
_STRIDE_TAG = getattr(torch.Tag, "needs_exact_strides", torch.Tag.needs_fixed_stride_order)
_TAGS = ({"tags": (_STRIDE_TAG,)}
         if "tags" in inspect.signature(torch.library.custom_op).parameters else {})


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
