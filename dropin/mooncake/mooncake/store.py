"""``mooncake.store`` answered by kvbridge: ``MooncakeDistributedStore`` is a client of a
kvbridge master (``master_server_addr`` / ``setup_dummy``'s ``server_address`` name a kvbridge
master, not a ``mooncake_master``). Every public name of Mooncake's ``mooncake.store`` is here;
one kvbridge cannot honour raises ``MooncakeNotSupportedError`` when used."""

from kvbridge.compat import _mooncake_store
from kvbridge.compat._mooncake_store import *  # noqa: F403 (mooncake.store's names: __all__)

__all__ = list(_mooncake_store.__all__)
