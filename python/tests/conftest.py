"""Shared fixtures for the kvselect contract suite.

The suite runs against either implementation of the embedded selection API:

* ``KVSELECT_TEST_IMPL=kvselect`` (default): ``import kvselect``;
* ``KVSELECT_TEST_IMPL=dynamo``: ``import dynamo._core`` (ai-dynamo-runtime
  1.6.1, the reference the contract was taken from).

Tests marked ``kvselect_only`` exercise extensions (token input forms beyond
``list``, GIL release guarantees, kvselect-only options) and are skipped under
Dynamo. Tests are plain functions that drive their own event loop with
``asyncio.run`` (see :func:`async_test`), so no pytest plugin is needed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib
import os
import socket
import types
from typing import Any, AsyncIterator, Dict, List, Optional

import pytest

# Dynamo logs every selection at INFO; keep test output readable. Must be set
# before the extension is imported.
os.environ.setdefault("DYN_LOG", "error")

IMPL = os.environ.get("KVSELECT_TEST_IMPL", "kvselect").strip().lower()
if IMPL not in ("kvselect", "dynamo"):
    raise pytest.UsageError(
        f"KVSELECT_TEST_IMPL must be 'kvselect' or 'dynamo', not {IMPL!r}"
    )

BLOCK_SIZE = 16
# Sequence hashes of tokens 1..64 at block size 16 (public-xxh3-v1), as
# Dynamo 1.6.1 returns them (spec selection-api.md 5.4 #1).
SEQ_1_64 = [
    -1583300653928780152,
    -5980354406663771828,
    960926348267535642,
    4923844688253642376,
]


def _load_impl() -> types.SimpleNamespace:
    name = "dynamo._core" if IMPL == "dynamo" else "kvselect"
    try:
        mod = importlib.import_module(name)
    except ImportError as e:
        hint = ("install ai-dynamo-runtime==1.6.1" if IMPL == "dynamo" else
                "build it with `pip install ./python` (or `maturin develop` in python/) and run "
                "pytest from the repository root")
        raise RuntimeError(f"KVSELECT_TEST_IMPL={IMPL}: cannot import {name}: {e}; {hint}") from e
    return types.SimpleNamespace(
        name=IMPL,
        module=mod,
        SelectionService=mod.SelectionService,
        SelectionCacheConfig=mod.SelectionCacheConfig,
        SelectionServiceError=mod.SelectionServiceError,
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "kvselect_only: kvselect extension, skipped under the Dynamo reference"
    )



def pytest_report_header(config: pytest.Config) -> str:
    return f"kvselect contract suite: implementation under test = {IMPL}"


def pytest_collection_modifyitems(config: pytest.Config, items) -> None:
    if IMPL != "dynamo":
        return
    skip = pytest.mark.skip(reason="kvselect-only extension (KVSELECT_TEST_IMPL=dynamo)")
    for item in items:
        if "kvselect_only" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def impl() -> types.SimpleNamespace:
    """The implementation under test: ``.SelectionService``,
    ``.SelectionCacheConfig``, ``.SelectionServiceError``, ``.name``."""
    return _load_impl()


def async_test(fn):
    """Run an ``async def test_...(...)`` with ``asyncio.run`` (fixtures are
    passed through)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return asyncio.run(asyncio.wait_for(fn(*args, **kwargs), timeout=60))

    return wrapper


@contextlib.asynccontextmanager
async def service(impl, **kwargs: Any) -> AsyncIterator[Any]:
    """A fresh service (``indexer_threads=1`` unless given), shut down on exit."""
    kwargs.setdefault("indexer_threads", 1)
    svc = impl.SelectionService(**kwargs)
    try:
        yield svc
    finally:
        svc.shutdown()


def free_port() -> int:
    """A port that was free a moment ago, for a socket the code under test
    binds itself. Linux often hands a just-closed port out again within a
    few dozen binds, so a port that must stay unbound comes from
    `unused_port`."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The sockets that hold `unused_port`'s ports until the session ends.
_HELD: List[socket.socket] = []


def unused_port() -> int:
    """A loopback port that refuses connections for the rest of the session:
    a socket is bound to it without SO_REUSEADDR and never listens, so no
    socket bound later (a publisher on a port the OS picks, say) can take
    it and answer a service that connects there."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    _HELD.append(s)
    return s.getsockname()[1]


def worker(worker_id: int, *, endpoint: Optional[str] = None, **extra: Any) -> Dict[str, Any]:
    """A schedulable worker record whose KV-events endpoint is an unused
    loopback port (nothing needs to listen there: the SUB socket connects
    lazily)."""
    rec: Dict[str, Any] = {
        "worker_id": worker_id,
        "endpoint": f"http://w{worker_id}:8000",
        "block_size": BLOCK_SIZE,
        "kv_events_endpoints": {0: endpoint or f"tcp://127.0.0.1:{unused_port()}"},
    }
    rec.update(extra)
    return rec


def load_row(svc: Any, worker_id: int, dp_rank: int = 0, **filters: Any) -> Optional[Dict[str, Any]]:
    """The ``loads()`` row of (worker, rank), or None when it is not listed."""
    for part in svc.loads(**filters):
        for row in part["loads"]:
            if row["worker_id"] == worker_id and row["dp_rank"] == dp_rank:
                return row
    return None


async def wait_for(pred, timeout: float = 5.0, interval: float = 0.01):
    """Poll ``pred()`` (sync or async) until truthy; returns its last value."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        v = pred()
        if asyncio.iscoroutine(v):
            v = await v
        if v or loop.time() >= deadline:
            return v
        await asyncio.sleep(interval)


async def wait_loaded(svc: Any, worker_id: int, timeout: float = 5.0) -> Dict[str, Any]:
    """Wait until ``loads()`` lists the worker (it appears a moment after
    ``upsert_worker`` resolves)."""
    row = await wait_for(lambda: load_row(svc, worker_id), timeout)
    assert row is not None, f"worker {worker_id} never appeared in loads()"
    return row
