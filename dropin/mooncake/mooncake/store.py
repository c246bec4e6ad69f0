"""``mooncake.store`` answered by kvbridge: ``MooncakeDistributedStore`` is a client of a
kvbridge master (``master_server_addr`` / ``setup_dummy``'s ``server_address`` name a kvbridge
master, not a ``mooncake_master``)."""

from kvbridge.compat.mooncake import (Descriptor, DiskDescriptor, MemoryDescriptor,
                                      MooncakeDistributedStore, MooncakeHostMemAllocator,
                                      ReplicaDescriptor, ReplicateConfig, ReplicaStatus)

__all__ = ["MooncakeDistributedStore", "ReplicateConfig", "MooncakeHostMemAllocator",
           "ReplicaDescriptor", "ReplicaStatus", "MemoryDescriptor", "DiskDescriptor",
           "Descriptor"]
