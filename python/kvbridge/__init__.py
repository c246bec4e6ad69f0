"""kvbridge Python package (placeholder).

The Python front of kvbridge -- ``TransferEngine``, ``Store``, ``Node``, ``Master``, the page
ops and the SGLang / vLLM / Mooncake-compatible integrations -- arrives with a later issue.
Today this package holds only its version; the C++ library (``make build``) is the usable part.
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
