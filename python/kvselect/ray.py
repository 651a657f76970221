"""Use kvselect as the selection service of Ray Serve LLM's KV-aware router.

Ray 2.58+ builds one ``KVTokenTracker``
(``ray.llm._internal.serve.routing_policies.kv_aware.kv_token_tracker``) in
each LLMRouter ingress replica. Its ``_create_selection_service`` method does
``from dynamo.llm import SelectionService`` and stores
``SelectionService(indexer_threads=...)`` in ``self._svc``; there is no
setting to choose another class. Ray's own CPU tests substitute the service
by overriding that method in a ``KVTokenTracker`` subclass (and by wrapping
``tracker._svc``). :func:`install` does the same on the class itself, so every
tracker created afterwards in this process owns a
``kvselect.SelectionService``. Dynamo need not be installed, and
``dynamo.llm`` is left untouched when it is.

The tracker lives in the ingress replica's process, so the patch must run
there. The supported way is Ray's worker setup hook, which runs in every
worker process of the job before any task or actor::

    ray.init(runtime_env={"worker_process_setup_hook": "kvselect.ray.install"})

(or the same ``runtime_env`` key in a Serve config). Calling
``kvselect.ray.install()`` at import time of the module that builds the
Serve application also works when that module is imported by the replicas.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

__all__ = ["install", "uninstall", "is_installed", "TRACKER_MODULE"]

#: Module of Ray's KV-aware routing tracker (Ray 2.58 - 2.60).
TRACKER_MODULE = "ray.llm._internal.serve.routing_policies.kv_aware.kv_token_tracker"

_MARK = "__kvselect_installed__"
_logger = logging.getLogger(__name__)


def _tracker_class() -> Any:
    try:
        import importlib

        mod = importlib.import_module(TRACKER_MODULE)
    except ImportError as e:
        raise ImportError(
            f"kvselect.ray.install() needs Ray Serve LLM (ray[llm] >= 2.58): "
            f"cannot import {TRACKER_MODULE}: {e}"
        ) from e
    cls = getattr(mod, "KVTokenTracker", None)
    if cls is None or not callable(getattr(cls, "_create_selection_service", None)):
        raise RuntimeError(
            f"{TRACKER_MODULE}.KVTokenTracker._create_selection_service not found; "
            "this Ray version is not supported by kvselect.ray.install()"
        )
    return cls


def _make_replacement(original: Callable[..., None], **service_kwargs: Any):
    def _create_selection_service(self) -> None:
        """Create the router-local kvselect selection service (replaces
        Ray's Dynamo one; installed by ``kvselect.ray.install``)."""
        from kvselect import SelectionService

        self._svc = SelectionService(
            indexer_threads=self._indexer_threads, **service_kwargs
        )
        logging.getLogger("ray.serve").info(
            "kvselect SelectionService created (indexer threads %d).",
            self._indexer_threads,
        )

    setattr(_create_selection_service, _MARK, True)
    _create_selection_service.__kvselect_original__ = original  # type: ignore[attr-defined]
    _create_selection_service.__wrapped__ = original  # type: ignore[attr-defined]
    return _create_selection_service


def install(**service_kwargs: Any) -> Callable[..., None]:
    """Make Ray's ``KVTokenTracker`` create ``kvselect.SelectionService``.

    Idempotent: a second call changes nothing (unless new ``service_kwargs``
    are given, which replace the previous ones). Returns the method it
    replaced, i.e. Ray's original ``KVTokenTracker._create_selection_service``
    (the same object on every call), so a caller can restore it with
    :func:`uninstall`. ``service_kwargs`` are extra keyword arguments for
    ``kvselect.SelectionService`` (``indexer_threads`` always comes from
    Ray's ``KV_INDEXER_THREADS`` experimental config).

    Affects trackers created after the call, in this process only. Works
    whether or not ``ai-dynamo`` is installed; ``dynamo.llm`` is not touched.
    Raises ``ImportError`` if Ray Serve LLM is not importable and
    ``RuntimeError`` if the Ray version has no such hook.
    """
    import kvselect  # noqa: F401  - fail here, not in the replica, if missing

    cls = _tracker_class()
    current = cls.__dict__.get("_create_selection_service")
    if current is not None and getattr(current, _MARK, False):
        original = current.__kvselect_original__
        if not service_kwargs:
            return original
    else:
        original = cls._create_selection_service
    cls._create_selection_service = _make_replacement(original, **service_kwargs)
    _logger.debug("kvselect installed as the selection service of %s", cls)
    return original


def uninstall() -> Optional[Callable[..., None]]:
    """Undo :func:`install`: restore Ray's original method. Returns the
    restored method, or ``None`` if kvselect was not installed."""
    cls = _tracker_class()
    current = cls.__dict__.get("_create_selection_service")
    if current is None or not getattr(current, _MARK, False):
        return None
    original = current.__kvselect_original__
    cls._create_selection_service = original
    return original


def is_installed() -> bool:
    """Whether :func:`install` is in effect in this process."""
    try:
        cls = _tracker_class()
    except (ImportError, RuntimeError):
        return False
    current = cls.__dict__.get("_create_selection_service")
    return current is not None and bool(getattr(current, _MARK, False))
