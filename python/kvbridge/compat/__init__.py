"""Drop-in replacements for other systems' Python APIs, implemented on kvbridge.

``kvbridge.compat.mooncake`` has Mooncake's ``TransferEngine``, ``MooncakeDistributedStore``
and ``ReplicateConfig`` (docs/mooncake.md: what is supported and what differs).
"""
