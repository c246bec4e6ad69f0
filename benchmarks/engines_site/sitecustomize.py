"""BENCHMARK-ONLY start-up code of `benchmarks/run engines` (benchmarks/bench_engines.py).

bench_engines.py puts this directory first on PYTHONPATH of every vLLM instance it starts, so
every process vLLM spawns (engine core, worker) runs it before any of its own code. It does
nothing unless ``KVB_BENCH_ENGINES=1``, and it imports nothing heavy itself: each patch runs
right after the module it patches is first imported (a post-import hook on ``sys.meta_path``).

* ``torch``: ``torch.accelerator.current_device_index`` answers 0 when CUDA is unavailable
  (vLLM's ``MooncakeConnectorWorker.__init__`` asks it; PyPI's torch, a CUDA build, raises
  without a driver). The same patch as tests/engines/cpu_sitecustomize, kept separate so that
  the benchmark does not depend on test-only code.
* Timers, one JSON line per call appended to ``$KVB_BENCH_XFER_LOG`` (``api``, ``pid``,
  ``t0`` wall-clock start, ``s`` seconds, ``bytes``, ``ops``, ``rc``):

  - ``mooncake.engine.TransferEngine.batch_transfer_sync_write``: the one synchronous call in
    which vLLM's stock MooncakeConnector (prefill worker, ``_send_blocks``) pushes a batch of
    KV blocks into the decode's cache. The same wrapper whether ``mooncake`` is the real wheel
    or kvbridge's drop-in (whose class is kvbridge.compat's).
  - ``kvbridge.engine.TransferEngine.transfer_raw`` when called from
    ``kvbridge.integrations._vllm_pd.PdPuller.pull``: the one synchronous READ batch in which
    kvbridge's connector (decode worker) pulls a request's KV blocks (api ``transfer_raw``);
    the whole ``PdPuller.pull`` (op list built, peer descriptor looked up, READ) as ``pull``;
    and ``PdPuller.release`` (the side-channel round trip after the read) as ``release``.
"""

import json
import os
import sys
import threading
import time

_ENABLED = os.environ.get("KVB_BENCH_ENGINES") == "1"
_LOG = os.environ.get("KVB_BENCH_XFER_LOG")
_local = threading.local()


def _warn(msg):
    sys.stderr.write(f"[kvbridge bench sitecustomize pid {os.getpid()}] {msg}\n")


def _record(api, t0, seconds, nbytes, ops, rc):
    if not _LOG:
        return
    line = json.dumps({"api": api, "pid": os.getpid(), "t0": t0, "s": seconds,
                       "bytes": int(nbytes), "ops": int(ops), "rc": rc}) + "\n"
    try:
        fd = os.open(_LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())  # one write of a short line: not interleaved
        finally:
            os.close(fd)
    except OSError as e:
        _warn(f"cannot append to {_LOG}: {e!r}")


def _patch_torch(torch):
    if torch.cuda.is_available():
        return
    torch.accelerator.current_device_index = lambda: 0


def _patch_mooncake_engine(module):
    cls = module.TransferEngine
    orig = cls.batch_transfer_sync_write

    def batch_transfer_sync_write(self, target_hostname, buffers, peer_buffer_addresses,
                                  lengths):
        wall, t = time.time(), time.perf_counter()
        rc = orig(self, target_hostname, buffers, peer_buffer_addresses, lengths)
        s = time.perf_counter() - t
        _record("batch_transfer_sync_write", wall, s, sum(lengths), len(lengths), rc)
        return rc

    batch_transfer_sync_write.__doc__ = orig.__doc__
    cls.batch_transfer_sync_write = batch_transfer_sync_write


def _patch_vllm_pd(module):
    from kvbridge.engine import TransferEngine

    raw = TransferEngine.transfer_raw

    def transfer_raw(self, ops, *args, **kwargs):
        if not getattr(_local, "in_pull", False):
            return raw(self, ops, *args, **kwargs)
        wall, t = time.time(), time.perf_counter()
        rc = "ok"
        try:
            return raw(self, ops, *args, **kwargs)
        except BaseException as e:
            rc = type(e).__name__
            raise
        finally:
            _record("transfer_raw", wall, time.perf_counter() - t,
                    sum(op[2] for op in ops), len(ops), rc)

    transfer_raw.__doc__ = raw.__doc__
    TransferEngine.transfer_raw = transfer_raw

    puller = module.PdPuller
    pull, release = puller.pull, puller.release

    def timed_pull(self, rank, local_blocks, remote_blocks):
        wall, t = time.time(), time.perf_counter()
        _local.in_pull = True
        try:
            res = pull(self, rank, local_blocks, remote_blocks)
        finally:
            _local.in_pull = False
        _record("pull", wall, time.perf_counter() - t, res.bytes, len(local_blocks),
                "ok" if res.ok else res.error[:200])
        return res

    def timed_release(self, rank, request_id):
        wall, t = time.time(), time.perf_counter()
        rc = "ok"
        try:
            return release(self, rank, request_id)
        except BaseException as e:
            rc = type(e).__name__
            raise
        finally:
            _record("release", wall, time.perf_counter() - t, 0, 0, rc)

    puller.pull, puller.release = timed_pull, timed_release


_HOOKS = {}
if _ENABLED:
    _HOOKS.update({"torch": _patch_torch,
                   "mooncake.engine": _patch_mooncake_engine,
                   "kvbridge.integrations._vllm_pd": _patch_vllm_pd})


if _HOOKS:
    from post_import_hooks import install  # tests/engines, on PYTHONPATH

    install(_HOOKS, _warn)
