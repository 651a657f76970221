"""kvselect: KV-cache-aware worker selection, embedded in Python.

``kvselect.SelectionService`` is a drop-in for Dynamo 1.6.1's
``dynamo._core.SelectionService`` (same constructor keywords, methods,
return shapes and exceptions), driven in-process by the native engine with
the GIL released while it works. See ``python/README.md`` and
``python/tests/REFERENCE_NOTES.md`` for the contract.
"""

from kvselect._native import (
    SelectionCacheConfig,
    SelectionService,
    SelectionServiceError,
)

try:  # the native module may export its own version string
    from kvselect._native import __version__ as __version__
except ImportError:  # pragma: no cover - depends on the native build
    try:
        from importlib.metadata import version as _version

        __version__ = _version("kvselect")
    except Exception:  # not installed as a distribution (e.g. in-tree build)
        __version__ = "0.0.0"

__all__ = [
    "SelectionService",
    "SelectionCacheConfig",
    "SelectionServiceError",
    "__version__",
]
