"""kvbridge's Mooncake drop-in: this ``mooncake`` package is NOT Mooncake.

It replaces the real Mooncake Python package (``mooncake-transfer-engine``) and answers
``mooncake.engine`` and ``mooncake.store`` with kvbridge's Mooncake-compatible classes
(``kvbridge.compat.mooncake``), over kvbridge's TCP transport. Installed from kvbridge's
``dropin/mooncake`` directory, as the distribution ``kvbridge-mooncake-dropin``; what is
supported and what differs: kvbridge's docs/mooncake.md ("Drop-in package").
"""

try:
    import kvbridge as _kvbridge  # noqa: F401
    from kvbridge.compat import mooncake as _compat  # noqa: F401 (checks it imports)
except ImportError as e:  # pragma: no cover - depends on the installation
    raise ImportError(
        "this 'mooncake' package is kvbridge's drop-in (distribution kvbridge-mooncake-dropin) "
        "and needs kvbridge importable (install kvbridge, or put its build's python/ directory "
        f"on PYTHONPATH): {e}") from e

__version__ = "0.1.0+kvbridge"
#: Tells code (and people) which implementation answers ``import mooncake``.
IMPLEMENTATION = "kvbridge"
__all__ = ["engine", "store", "IMPLEMENTATION"]
