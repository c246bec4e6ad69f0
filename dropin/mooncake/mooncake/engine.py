"""``mooncake.engine`` answered by kvbridge: ``TransferEngine`` is
``kvbridge.compat.mooncake.TransferEngine`` (kvbridge's transfer engine, TCP)."""

from kvbridge.compat.mooncake import TransferEngine, TransferNotify, TransferOpcode

__all__ = ["TransferEngine", "TransferNotify", "TransferOpcode"]
