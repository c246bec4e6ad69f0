"""Test-only shims that let SGLang 0.5.23's HiCache run on a machine with no GPU.

Never part of the kvbridge package: SGLang's host KV pool always pins its memory with CUDA,
and its device<->host copy kernels come from sgl-kernel, which the CPU test venv cannot load
(its wheel needs libcuda). On CPU the sgl_kernel import in the host-pool modules is skipped,
so the names below are simply missing there. The shims:

* a no-op ``_cuda_host_register`` (pinning needs a CUDA driver);
* torch-native ``transfer_kv_direct`` (layer_first + ``--hicache-io-backend direct``) and
  ``transfer_kv_per_layer_direct_pf_lf`` / ``transfer_kv_all_layer_direct_lf_pf``
  (page_first_direct + direct), with the semantics of sgl-kernel's: host and device indices
  are token slots, pages of ``page_size`` consecutive slots;
* ``torch.cpu.Stream.synchronize`` as a no-op (SGLang's cache controller synchronizes its
  copy streams; torch's CPU stream has no such method);
* a 1 GiB host-memory reserve instead of SGLang's 10 GiB: SGLang refuses a host pool that
  does not fit in the machine's available RAM minus that reserve, which on a shared 24 GB
  test box running other suites is often negative.

Apply them in the engine process's ``__main__`` module, at import time (not under
``if __name__ == "__main__"``): SGLang starts its scheduler with multiprocessing's spawn,
which re-imports the main module in the child (as ``__mp_main__``), and the shims must be in
place there. A ``.pth`` file does not work for this (the child fails with KeyError: 'sglang').
"""

from __future__ import annotations

import torch

_APPLIED = False


def transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size):
    """dst[dst_indices] = src[src_indices] for every (src, dst) layer pair (token slots)."""
    si = src_indices.to(torch.int64)
    di = dst_indices.to(torch.int64)
    for src, dst in zip(src_layers, dst_layers):
        dst[di.to(dst.device)] = src[si.to(src.device)].to(dst.device)


def transfer_kv_per_layer_direct_pf_lf(src_ptrs, dst_ptrs, src_indices, dst_indices, layer_id,
                                       page_size):
    """Host page_first_direct buffers [page, layer, page_size, ...] -> device layer tensors."""
    si = src_indices.to(torch.int64)
    di = dst_indices.to(torch.int64)
    page, slot = si // page_size, si % page_size
    for src, dst in zip(src_ptrs, dst_ptrs):
        dst[di.to(dst.device)] = src[page, layer_id, slot].to(dst.device)


def transfer_kv_all_layer_direct_lf_pf(src_ptrs, dst_ptrs, src_indices, dst_indices, page_size):
    """Device layer tensors (all K layers, then all V layers; MLA: one list) -> host
    page_first_direct buffers."""
    si = src_indices.to(torch.int64)
    di = dst_indices.to(torch.int64)
    page, slot = di // page_size, di % page_size
    layers = len(src_ptrs) // len(dst_ptrs)
    for j, dst in enumerate(dst_ptrs):
        for layer in range(layers):
            src = src_ptrs[j * layers + layer]
            dst[page, layer, slot] = src[si.to(src.device)].to(dst.device)


def apply() -> None:
    """Installs the shims (idempotent). Only on a machine without CUDA."""
    global _APPLIED
    if _APPLIED or torch.cuda.is_available():
        return
    from sglang.srt.mem_cache.pool_host import base, common, mha, mla

    common._cuda_host_register = lambda *args, **kwargs: None
    base.HICACHE_HOST_MEMORY_RESERVE_BYTES = 1 << 30
    for module in (mha, mla):
        module.transfer_kv_direct = transfer_kv_direct
        module.transfer_kv_per_layer_direct_pf_lf = transfer_kv_per_layer_direct_pf_lf
        module.transfer_kv_all_layer_direct_lf_pf = transfer_kv_all_layer_direct_lf_pf
    if not hasattr(torch.cpu.Stream, "synchronize"):
        torch.cpu.Stream.synchronize = lambda self: None
    _APPLIED = True
