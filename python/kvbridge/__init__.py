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
from typing import Any

from kvbridge._native import _C
from kvbridge.engine import (READ, WRITE, BatchError, Op, PeerId, TransferEngine, fetch_descriptor,
                             raise_if_error)
from kvbridge.errors import KvbError, StatusCode
from kvbridge.store import (Cluster, GetResult, Master, Node, Replica, ReplicasResult, StoreClient,
                            cluster_status)

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
