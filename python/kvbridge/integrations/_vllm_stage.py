"""Staging of vLLM KV blocks through host pages, for KV tensors kvbridge cannot register.

kvbridge's transfer engine and store register host memory only; KV tensors on a GPU are
therefore copied, a batch of blocks at a time, into pinned host pages with kvbridge's page
kernels (``vllm_blocks_to_pages`` / ``vllm_pages_to_blocks``, called eagerly through
``kvbridge._page_copy``: the worker never registers the ``kvbridge.ops`` torch ops, see
docs/vllm.md "Known issues"), and the pages are what kvbridge moves. A page holds one block
of every layer (and K/V part) in the layers' memory order: byte for byte what the in-place
path moves, so staged and in-place instances share store objects and pull from each other.

``Stager.host_layout`` describes the pages as a KvLayout whose "blocks" are pages, so the
store and pull code is the same for both paths; only page ids replace block ids, with a
gather before a save and a scatter after a load. Nothing here imports vLLM.
"""

from __future__ import annotations

import threading
import time
from typing import Optional, Sequence

import torch

from kvbridge import errors
from kvbridge.integrations._vllm_core import KvLayout, LayerPart


class Stager:
    """Pinned host pages for one worker's KV tensors, with a page allocator."""

    def __init__(self, kv_caches: dict, layout: KvLayout, staging_bytes: int):
        from kvbridge import _page_copy as ops

        self._ops = ops
        self.layers = [kv_caches[n] for n in layout.names]
        t = self.layers[0]
        nparts = len(layout.parts[0])
        if nparts == 1:
            self.kv_dim, self.block_dim = ops.KV_DIM_NONE, 0
        elif nparts == 2 and t.shape[0] == 2:
            self.kv_dim, self.block_dim = 0, 1
        else:
            raise errors.UnsupportedError(
                f"staging: KV tensors of shape {tuple(t.shape)} ({nparts} parts per block)")
        if self.block_dim == 0 and t.shape[0] != layout.num_blocks:
            raise errors.UnsupportedError(f"staging: KV tensors of shape {tuple(t.shape)}")
        page_shape = ops.vllm_page_shape(self.layers, kv_dim=self.kv_dim, block_dim=self.block_dim)
        page_bytes = layout.bytes_per_block
        n = max(1, staging_bytes // page_bytes)
        self.pages = torch.empty((n, *page_shape), dtype=t.dtype, pin_memory=t.is_cuda)
        self.device = t.device
        base = self.pages.data_ptr()
        parts, off = [], 0
        for lp in layout.parts:
            row = []
            for p in lp:
                row.append(LayerPart(base + off, page_bytes, p.block_bytes, n))
                off += p.block_bytes
            parts.append(tuple(row))
        if off != page_bytes or self.pages[0].numel() * self.pages.element_size() != page_bytes:
            raise errors.InternalError("staging: page size does not match the layout")
        self.host_layout = KvLayout(layout.names, tuple(parts), layout.dtype)
        self.num_pages = n
        self._free = list(range(n))
        self._cond = threading.Condition()

    def region(self) -> tuple[int, int]:
        return self.pages.data_ptr(), self.pages.numel() * self.pages.element_size()

    # -- pages ---------------------------------------------------------------------------------
    def take(self, n: int, timeout_s: float) -> Optional[list[int]]:
        """Up to n free pages (at least one), waiting at most timeout_s; None on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not self._free:
                left = deadline - time.monotonic()
                if left <= 0 or not self._cond.wait(left):
                    if not self._free:
                        return None
            k = min(n, len(self._free))
            got, self._free = self._free[:k], self._free[k:]
            return got

    def give(self, pages: Sequence[int]) -> None:
        with self._cond:
            self._free.extend(pages)
            self._cond.notify_all()

    # -- copies --------------------------------------------------------------------------------
    def _ids(self, ids: Sequence[int]) -> torch.Tensor:
        return torch.tensor(list(ids), dtype=torch.int64, device=self.device)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def gather(self, block_ids: Sequence[int], page_ids: Sequence[int]) -> None:
        """KV blocks -> pages; returns when the pages hold them."""
        self._ops.vllm_blocks_to_pages(self.layers, self.pages, self._ids(block_ids),
                                       self._ids(page_ids), kv_dim=self.kv_dim,
                                       block_dim=self.block_dim)
        self._sync()

    def scatter(self, page_ids: Sequence[int], block_ids: Sequence[int]) -> None:
        """Pages -> KV blocks; returns when the blocks hold them."""
        self._ops.vllm_pages_to_blocks(self.layers, self.pages, self._ids(block_ids),
                                       self._ids(page_ids), kv_dim=self.kv_dim,
                                       block_dim=self.block_dim)
        self._sync()
