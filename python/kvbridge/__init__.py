"""kvbridge: moves and keeps LLM KV-cache pages.

Two jobs, one package (docs/python.md):

* :class:`TransferEngine` -- one-sided READ/WRITE between processes' registered memory
  (prefill/decode disaggregation), with incarnation checks, deadlines and circuit breakers.
* The KV-page store -- :class:`StoreClient`, :class:`Node`, :class:`Master` and the embedded
  :class:`Cluster` (``kvbridge.Cluster(nodes=3).client()``).

``kvbridge.ops`` (imported on first use; needs torch) holds the page gather/scatter kernels
as torch ops for SGLang and vLLM layouts. ``kvbridge.metrics`` (likewise; serving needs
prometheus_client) serves a store client's stats() on a Prometheus endpoint. Errors are
:class:`kvbridge.errors.KvbError` subclasses named after the status code. Options are
keywords mirroring ``KVBRIDGE_*``.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any


def _prefer_the_wheels_nccl() -> None:
    """torch's CUDA build loads the nvidia-nccl wheel's libnccl.so.2. A process whose first
    libnccl.so.2 is another one (the nccl plugin probing the system's, as it does when this
    Python's venv is not activated) cannot import torch after that ("undefined symbol"). When
    this Python has the wheel, the plugin is pointed at it, unless KVBRIDGE_NCCL_LIBRARY says
    otherwise (docs/transports/nccl.md)."""
    if os.environ.get("KVBRIDGE_NCCL_LIBRARY"):
        return
    for entry in sys.path:
        path = os.path.join(entry or ".", "nvidia", "nccl", "lib", "libnccl.so.2")
        if os.path.isfile(path):
            os.environ["KVBRIDGE_NCCL_LIBRARY"] = os.path.abspath(path)
            return


_prefer_the_wheels_nccl()

from kvbridge._native import _C  # noqa: E402 (after the NCCL choice above)
from kvbridge.engine import (READ, WRITE, BatchError, Op, PeerId,  # noqa: E402
                             TransferEngine, fetch_descriptor, raise_if_error)
from kvbridge.errors import KvbError, StatusCode  # noqa: E402
from kvbridge.store import (Cluster, GetResult, Master, Node, Replica,  # noqa: E402
                            ReplicasResult, StoreClient, cluster_status)

__version__ = "0.1.0"

Status = _C.Status

__all__ = [
    "__version__", "TransferEngine", "Op", "READ", "WRITE", "PeerId", "BatchError",
    "fetch_descriptor",
    "StoreClient", "Node", "Master", "Cluster", "GetResult", "Replica", "ReplicasResult",
    "cluster_status", "Status",
    "StatusCode", "KvbError", "raise_if_error", "errors", "ops", "metrics",
]


def __getattr__(name: str) -> Any:
    # kvbridge.ops imports torch (seconds); only when asked for, as kvbridge.metrics.
    if name in ("ops", "metrics"):
        return importlib.import_module(f"kvbridge.{name}")
    raise AttributeError(f"module 'kvbridge' has no attribute {name!r}")
