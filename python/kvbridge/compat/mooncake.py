"""Mooncake's Python API on kvbridge: ``from kvbridge.compat.mooncake import TransferEngine,
MooncakeDistributedStore`` where code had ``from mooncake.engine import TransferEngine`` and
``from mooncake.store import MooncakeDistributedStore`` (docs/mooncake.md: every method, what is
supported and what differs). Every public name of Mooncake's ``mooncake.engine`` and
``mooncake.store`` is here."""

from kvbridge.compat import _mooncake_engine, _mooncake_store
from kvbridge.compat._mooncake_engine import *  # noqa: F403 (mooncake.engine's names: __all__)
from kvbridge.compat._mooncake_store import *  # noqa: F403 (mooncake.store's names: __all__)

__all__ = [*_mooncake_engine.__all__, *_mooncake_store.__all__]
