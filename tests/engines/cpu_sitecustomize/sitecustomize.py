"""TEST-ONLY patches that let the stock engines' Mooncake paths run on a CPU-only machine
(tests/engines/test_dropin_*.py). Nothing outside the tests uses this directory.

The test puts this directory on PYTHONPATH of every engine role, so every process the engines
spawn (vLLM's engine core and workers, SGLang's scheduler) runs it at startup, before any of
its code. It does nothing unless ``KVBRIDGE_TEST_CPU_PATCHES=1``, and it imports nothing heavy
itself: each patch runs right after the module it patches is first imported (a post-import
hook on ``sys.meta_path``). The patches, and why each is needed here:

* ``torch``: ``torch.accelerator.current_device_index`` answers 0 when CUDA is unavailable.
  vLLM's ``MooncakeConnectorWorker.__init__`` asks it, and PyPI's torch (a CUDA build) raises
  "Found no NVIDIA driver" on a machine without one. ``torch.cpu.Stream.synchronize`` becomes
  a no-op where it is missing (SGLang's HiCache controller syncs its streams).
* ``sglang.srt.mem_cache.pool_host.common``: ``_cuda_host_register`` (cudaHostRegister of the
  HiCache host pool, always pinned) becomes a no-op.
* ``sglang.srt.mem_cache.pool_host.mha``: the two page_first_direct copies of the ``direct`` IO
  backend, which SGLang imports from sgl_kernel only on CUDA/ROCm, get torch-indexing versions
  (the Mooncake HiCache backend needs a page-first host layout for MHA models).
* ``sglang.srt.disaggregation.mooncake.conn``: ``MooncakeKVSender.supports_host_tensor_indices``
  is False, so SGLang's prefill scheduler computes the page indices it sends on the host
  instead of copying them into pinned memory behind a ``torch.cuda.Event`` (PD on CPU).

With ``KVBRIDGE_TEST_STATS_DIR`` set, each kvbridge-backed Mooncake ``TransferEngine`` also
writes its kvbridge TCP transport counters (``transport_stats("tcp")``: bytes written/read by
this side) to ``<dir>/engine-<pid>-<n>.json`` after every sync transfer call, so that a test
can show bytes moved inside processes it does not control.
"""

import itertools
import json
import os
import sys

_ENABLED = os.environ.get("KVBRIDGE_TEST_CPU_PATCHES") == "1"
_STATS_DIR = os.environ.get("KVBRIDGE_TEST_STATS_DIR")


def _warn(msg):
    sys.stderr.write(f"[kvbridge test sitecustomize pid {os.getpid()}] {msg}\n")


# -- torch ------------------------------------------------------------------------------------
def _patch_torch(torch):
    if torch.cuda.is_available():
        return
    torch.accelerator.current_device_index = lambda: 0
    stream = getattr(getattr(torch, "cpu", None), "Stream", None)
    if stream is not None and not hasattr(stream, "synchronize"):
        stream.synchronize = lambda self: None


# -- SGLang HiCache host pool -----------------------------------------------------------------
def _patch_sglang_pool_common(common):
    common._cuda_host_register = lambda buffer, registration_granularity_bytes=None: None


def _rows(t, leading):
    """View of t keeping its first `leading` dims and flattening the rest into one."""
    return t.view(*t.shape[:leading], -1)


def _transfer_kv_per_layer_direct_pf_lf(src_ptrs, dst_ptrs, src_indices, dst_indices,
                                        layer_id, page_size):
    """Host page_first_direct [page, layer, slot, ...] -> one device layer [token, ...]."""
    import torch

    si = src_indices.to("cpu", torch.int64)
    di = dst_indices.to("cpu", torch.int64)
    pages, slots = si // page_size, si % page_size
    for src, dst in zip(src_ptrs, dst_ptrs):
        _rows(dst, 1)[di] = _rows(src, 3)[pages, layer_id, slots]


def _transfer_kv_all_layer_direct_lf_pf(src_ptrs, dst_ptrs, src_indices, dst_indices, page_size):
    """Device layers [K_0..K_{L-1}, V_0..V_{L-1}] [token, ...] -> host page_first_direct."""
    import torch

    si = src_indices.to("cpu", torch.int64)
    di = dst_indices.to("cpu", torch.int64)
    pages, slots = di // page_size, di % page_size
    layers = len(src_ptrs) // len(dst_ptrs)
    for which, dst in enumerate(dst_ptrs):
        host = _rows(dst, 3)
        for layer in range(layers):
            src = src_ptrs[which * layers + layer]
            host[pages, layer, slots] = src.reshape(src.shape[0], -1)[si]


def _patch_sglang_pool_mha(mha):
    for name, fn in (("transfer_kv_per_layer_direct_pf_lf", _transfer_kv_per_layer_direct_pf_lf),
                     ("transfer_kv_all_layer_direct_lf_pf", _transfer_kv_all_layer_direct_lf_pf)):
        if not hasattr(mha, name):
            setattr(mha, name, fn)


# -- SGLang PD ---------------------------------------------------------------------------------
def _patch_sglang_mooncake_conn(conn):
    # The prefill scheduler hands a Mooncake sender its page indices as a pinned host tensor
    # plus a torch.cuda.Event when the sender says it takes them; off CUDA it then computes
    # them on the spot (kv_to_page_indices), which is the same list.
    conn.MooncakeKVSender.supports_host_tensor_indices = False


# -- kvbridge counters out of processes the engines spawn --------------------------------------
_engine_ids = itertools.count()


def _patch_kvbridge_mooncake_engine(module):
    cls = module.TransferEngine

    def dump(self):
        try:
            eng = self._eng
            if eng is None:
                return
            if not hasattr(self, "_test_stats_path"):
                self._test_stats_path = os.path.join(
                    _STATS_DIR, f"engine-{os.getpid()}-{next(_engine_ids)}.json")
                self._test_calls = 0
            self._test_calls += 1
            stats = dict(eng.transport_stats("tcp"))
            mooncake = sys.modules.get("mooncake")  # the drop-in, when the engine imported it
            stats.update(pid=os.getpid(), executable=sys.executable, calls=self._test_calls,
                         session=f"{self._hostname}:{self.get_rpc_port()}",
                         mooncake_file=getattr(mooncake, "__file__", None),
                         mooncake_impl=getattr(mooncake, "IMPLEMENTATION", None))
            tmp = self._test_stats_path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(stats, f)
            os.replace(tmp, self._test_stats_path)
        except Exception as e:  # never break the engine over a test counter
            _warn(f"stats dump failed: {e!r}")

    def wrap(name):
        orig = getattr(cls, name)

        def call(self, *args, **kwargs):
            rc = orig(self, *args, **kwargs)
            dump(self)
            return rc

        call.__name__ = name
        call.__doc__ = orig.__doc__
        setattr(cls, name, call)

    for name in ("transfer_sync_write", "transfer_sync", "batch_transfer_sync_write",
                 "batch_transfer_sync"):
        wrap(name)


_HOOKS = {}
if _ENABLED:
    _HOOKS.update({
        "torch": _patch_torch,
        "sglang.srt.mem_cache.pool_host.common": _patch_sglang_pool_common,
        "sglang.srt.mem_cache.pool_host.mha": _patch_sglang_pool_mha,
        "sglang.srt.disaggregation.mooncake.conn": _patch_sglang_mooncake_conn,
    })
if _STATS_DIR:
    _HOOKS["kvbridge.compat._mooncake_engine"] = _patch_kvbridge_mooncake_engine


if _HOOKS:
    from post_import_hooks import install  # tests/engines, on PYTHONPATH

    install(_HOOKS, _warn)
