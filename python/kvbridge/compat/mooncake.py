"""Mooncake's Python API on kvbridge: ``from kvbridge.compat.mooncake import TransferEngine,
MooncakeDistributedStore`` where code had ``from mooncake.engine import TransferEngine`` and
``from mooncake.store import MooncakeDistributedStore`` (docs/mooncake.md: every method, what is
supported and what differs)."""

from kvbridge.compat._mooncake_engine import TransferEngine, TransferNotify, TransferOpcode
from kvbridge.compat._mooncake_store import (Descriptor, DiskDescriptor, MemoryDescriptor,
                                             MooncakeDistributedStore, MooncakeHostMemAllocator,
                                             ReplicaDescriptor, ReplicateConfig, ReplicaStatus)

__all__ = ["TransferEngine", "TransferNotify", "TransferOpcode", "MooncakeDistributedStore",
           "ReplicateConfig", "ReplicaDescriptor", "ReplicaStatus", "MemoryDescriptor",
           "DiskDescriptor", "Descriptor", "MooncakeHostMemAllocator"]
