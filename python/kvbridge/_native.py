"""Loads the native extension with an error that says what to do when it is missing."""

from __future__ import annotations

try:
    from kvbridge import _C  # noqa: F401  (the pybind11 module built from csrc/bindings)
except ImportError as e:  # pragma: no cover - exercised only on a broken install
    raise ImportError(
        "kvbridge's native extension (kvbridge._C) could not be loaded: "
        f"{e}. Install the package with `pip install .` from the kvbridge source tree, or put "
        "<build>/python on PYTHONPATH after `make build` (docs/python.md)."
    ) from e

__all__ = ["_C"]
