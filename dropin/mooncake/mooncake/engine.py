"""``mooncake.engine`` answered by kvbridge: ``TransferEngine`` is
``kvbridge.compat.mooncake.TransferEngine`` (kvbridge's transfer engine, TCP). Every public name
of Mooncake's ``mooncake.engine`` is here; one kvbridge cannot honour raises
``MooncakeNotSupportedError`` when used."""

from kvbridge.compat import _mooncake_engine
from kvbridge.compat._mooncake_engine import *  # noqa: F403 (mooncake.engine's names: __all__)

__all__ = list(_mooncake_engine.__all__)
