"""The rest of the public names of Mooncake's ``mooncake.store`` (wheel 0.3.13.post1), so that
code importing them loads on kvbridge.

* Enums and plain data holders (``SoftPinAction``, ``TaskStatus``, ``QueryTaskResponse``,
  ``TensorParallelism``, ...) behave as Mooncake's: same members, values and field defaults.
* What kvbridge cannot honour (Mooncake's buffer pools, Engram tables, NVMe-oF registration,
  NUMA binding, the allocator function addresses) still exists and raises
  :class:`MooncakeNotSupportedError` when constructed or called, naming the reason.

docs/mooncake.md lists every name and what it does here.
"""

from __future__ import annotations

import enum
from typing import Any, NoReturn

from kvbridge.errors import UnsupportedError

__all__ = ["MooncakeNotSupportedError", "SoftPinAction", "TaskStatus", "TaskType",
           "ObjectDataType", "QueryTaskResponse", "ParallelAxis", "TensorParallelism",
           "ReadTarget", "EngramStoreConfig", "EngramStore", "BufferPool", "BufferLease",
           "BufferLeaseView", "RegisteredBufferPool", "RegisteredBufferLease",
           "RegisteredBufferLeaseView", "MooncakeDistributedNoFRegister", "bind_to_numa_node",
           "get_alloc_func_addr", "get_free_func_addr"]


class MooncakeNotSupportedError(UnsupportedError, NotImplementedError):
    """A Mooncake name kvbridge keeps, so that code importing it loads, but cannot honour. Also
    a ``NotImplementedError``, for code that catches that."""


def not_supported(what: str, why: str) -> NoReturn:
    raise MooncakeNotSupportedError(f"{what} is not supported by kvbridge's Mooncake layer: "
                                    f"{why} (docs/mooncake.md)")


class _PybindEnum(enum.IntEnum):
    """An enum printed as pybind11 prints Mooncake's (``SoftPinAction.PRESERVE``)."""

    def __str__(self) -> str:
        return f"{type(self).__name__}.{self.name}"


class SoftPinAction(_PybindEnum):
    """What a put does to an existing object's soft pin (``ReplicateConfig.soft_pin_action``)."""

    PRESERVE = 0
    ENABLE = 1
    DISABLE = 2


class TaskStatus(_PybindEnum):
    """The state of a copy or move task (``query_task``)."""

    PENDING = 0
    PROCESSING = 1
    FAILED = 2
    SUCCESS = 3


class TaskType(_PybindEnum):
    REPLICA_COPY = 0
    REPLICA_MOVE = 1


class ObjectDataType(_PybindEnum):
    """What an object holds (``ReplicateConfig.data_type``): a hint Mooncake's master keeps."""

    UNKNOWN = 0
    KVCACHE = 1
    TENSOR = 2
    WEIGHT = 3
    SAMPLE = 4
    ACTIVATION = 5
    GRADIENT = 6
    OPTIMIZER_STATE = 7
    METADATA = 8
    GENERAL = 9


class QueryTaskResponse:
    """Response structure for QueryTask operation (Mooncake's fields and defaults)."""

    def __init__(self) -> None:
        self.id: Any = (0, 0)
        self.type = TaskType.REPLICA_COPY
        self.status = TaskStatus.PENDING
        self.created_at_ms_epoch = 0
        self.last_updated_at_ms_epoch = 0
        self.assigned_client: Any = (0, 0)
        self.message = ""


class ParallelAxis:
    """One axis of a tensor's parallel layout (Mooncake's tensor API)."""

    def __init__(self) -> None:
        self.kind = ""
        self.rank = 0
        self.size = 1
        self.split_dim: Any = None
        self.expert_id: Any = None
        self.stage_id: Any = None


class TensorParallelism:
    def __init__(self) -> None:
        self.axes: list = []


class ReadTarget:
    def __init__(self) -> None:
        self.mode = "as_stored"
        self.parallelism: Any = None


class EngramStoreConfig:
    def __init__(self) -> None:
        self.embedding_dim = 64
        self.table_vocab_sizes = [1024]


class EngramStore:
    """Mooncake's Engram embedding tables over the store."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        not_supported("EngramStore", "kvbridge has no Engram embedding tables")


class BufferPool:
    """Mooncake's pool of registered buffers handed out as leases."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        not_supported("BufferPool", "kvbridge has no registered-buffer pool; register memory "
                      "with register_buffer")


class BufferLease:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        not_supported("BufferLease", "leases come from BufferPool, which kvbridge has not")


class BufferLeaseView:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        not_supported("BufferLeaseView", "leases come from BufferPool, which kvbridge has not")


# Mooncake's other names for the same classes.
RegisteredBufferPool = BufferPool
RegisteredBufferLease = BufferLease
RegisteredBufferLeaseView = BufferLeaseView


class MooncakeDistributedNoFRegister:
    """Mooncake's registration of NVMe-oF segments."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        not_supported("MooncakeDistributedNoFRegister", "kvbridge has no NVMe-oF segments; its "
                      "SSD tier is node-local (setup's enable_ssd_offload)")


def bind_to_numa_node(node: int) -> NoReturn:
    not_supported("bind_to_numa_node", "kvbridge sets no NUMA policy for the caller's thread")


def get_alloc_func_addr() -> NoReturn:
    not_supported("get_alloc_func_addr", "kvbridge has no allocator for torch's "
                  "CUDAPluggableAllocator")


def get_free_func_addr() -> NoReturn:
    not_supported("get_free_func_addr", "kvbridge has no allocator for torch's "
                  "CUDAPluggableAllocator")
