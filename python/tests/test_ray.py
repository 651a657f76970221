"""The Ray recipe: Ray Serve LLM's real ``KVTokenTracker`` (ray 2.60.0) driven
without engines, the way Ray's own CPU tests drive it (a subclass whose
``_start_replica_tracking`` is a no-op, so no controller is needed).

Under kvselect, ``kvselect.ray.install()`` makes the tracker create
``kvselect.SelectionService``; under ``KVSELECT_TEST_IMPL=dynamo`` the same
round trip runs on Ray's own path (``from dynamo.llm import SelectionService``).
"""

from __future__ import annotations

import asyncio
import sys

import pytest

from conftest import IMPL, async_test, load_row, unused_port

ray = pytest.importorskip("ray", reason="ray is not installed (CI installs ray[serve]==2.60.0)")
try:
    from ray.llm._internal.serve.routing_policies.kv_aware import kv_token_tracker as ktt
except ImportError as e:  # e.g. ray without the serve extra (starlette, ...)
    pytest.skip(f"Ray's KV token tracker is not importable: {e}", allow_module_level=True)

RAY_CALLS = ("upsert_worker", "select_and_reserve", "create_reservation",
             "prefill_complete", "add_output_block", "free_reservation", "delete_worker")


class NoLongPollTracker(ktt.KVTokenTracker):
    """Real selection service, no controller membership subscription."""

    def _start_replica_tracking(self):
        pass


class BroadcastHandle:
    """The DeploymentHandle surface ReservationBroadcastForwarder uses:
    ``broadcast(method, *args).results_async(...)`` over local trackers."""

    def __init__(self, *trackers):
        self.trackers = trackers

    def broadcast(self, method_name, *args):
        trackers = self.trackers

        class _Response:
            async def results_async(self, *, timeout_s=None, return_exceptions=False):
                return list(await asyncio.gather(
                    *(getattr(t, method_name)(*args) for t in trackers),
                    return_exceptions=return_exceptions))

        return _Response()


class Recorder:
    """Wraps a tracker's service, recording every call Ray makes and whether
    Ray awaited its result."""

    def __init__(self, inner):
        self._inner = inner
        self.calls = []

    def __getattr__(self, name):
        attr = getattr(self._inner, name)
        if name not in RAY_CALLS:
            return attr

        def call(*args, **kwargs):
            self.calls.append((name, args, kwargs))
            return attr(*args, **kwargs)

        return call


@pytest.fixture
def recipe(impl):
    """Install kvselect into Ray's tracker (kvselect) or leave Ray's own
    Dynamo path alone (dynamo); undo afterwards."""
    if impl.name == "dynamo":
        pytest.importorskip("dynamo.llm")
        yield None
        return
    import kvselect.ray

    original = ktt.KVTokenTracker._create_selection_service
    replaced = kvselect.ray.install()
    try:
        yield replaced
    finally:
        kvselect.ray.uninstall()
        assert ktt.KVTokenTracker._create_selection_service is original


def _worker_meta(port):
    return {"endpoint": f"tcp://127.0.0.1:{port}", "block_size": 16,
            "max_num_batched_tokens": 8192, "dp_rank": 0}


def _row(tracker, worker_id):
    row = load_row(tracker._svc, worker_id)
    assert row is not None, "worker not in loads()"
    return (row["potential_prefill_tokens"], row["potential_decode_blocks"], row["active_requests"])


@async_test
async def test_tracker_round_trip_with_peer_broadcast(impl, recipe):
    routing = NoLongPollTracker(ingress_replica_rank=0)
    peer = NoLongPollTracker(ingress_replica_rank=1)
    trackers = (routing, peer)
    for t in trackers:
        assert type(t._svc) is impl.SelectionService, type(t._svc)
    worker_id = ktt.get_worker_id("engine-replica-0")  # a 64-bit id
    port = unused_port()
    tokens = list(range(1, 65))  # 4 blocks of 16
    try:
        for t in trackers:
            t._register_block_size(16, "engine-replica-0")
            await t._upsert_worker(worker_id, "engine-replica-0", _worker_meta(port))
            t._svc = Recorder(t._svc)
            assert [w["worker_id"] for w in t._svc.list_workers()] == [worker_id]
            assert t._svc.list_workers()[0]["lifecycle"] == "schedulable"

        routing.start_reservation_broadcast(BroadcastHandle(*trackers))
        sel = await routing.select_worker("req-1", tokens, [worker_id], 64)
        assert sel == {"worker_id": worker_id, "dp_rank": 0, "overlap_tokens": 0,
                       "effective_prefill_tokens": 64}
        assert _row(routing, worker_id) == (64, 4, 1)
        await routing._reservation_forwarder.flush()
        for t in trackers:
            await t._reservation_updates.join()

        # The peer booked the broadcast with create_reservation, as Ray sends it.
        creates = [c for c in peer._svc.calls if c[0] == "create_reservation"]
        assert len(creates) == 1
        req = creates[0][1][0]
        assert set(req) == {"model_name", "tenant_id", "selection_id", "worker_id", "dp_rank",
                            "sequence_hashes", "isl_tokens", "expected_output_tokens",
                            "effective_prefill_tokens"}
        assert req["selection_id"] == "req-1" and req["worker_id"] == worker_id
        assert req["isl_tokens"] == 64 and req["effective_prefill_tokens"] == 64
        assert len(req["sequence_hashes"]) == 4
        assert not [c for c in routing._svc.calls if c[0] == "create_reservation"]
        assert _row(peer, worker_id) == _row(routing, worker_id) == (64, 4, 1)
        assert all("req-1" in t._requests for t in trackers)

        # Engine lifecycle events, applied on every ingress.
        for t in trackers:
            await t.on_lifecycle_events([("on_prefill_complete", ("req-1",))])
        assert _row(peer, worker_id) == _row(routing, worker_id) == (0, 4, 1)
        # 20 output tokens: 84 tokens = 6 blocks, so two synchronous
        # add_output_block calls, decay 1 - 20/64 over 6 exclusive blocks.
        for t in trackers:
            await t.on_lifecycle_events([("on_decode_progress", ("req-1", 20))])
            aob = [c for c in t._svc.calls if c[0] == "add_output_block"]
            assert [(a, k) for _, a, k in aob] == [(("req-1",), {"decay_fraction": 1 - 20 / 64})] * 2
        assert _row(peer, worker_id) == _row(routing, worker_id) == (0, 4, 1)
        for t in trackers:
            await t.on_lifecycle_events([("on_decode_progress", ("req-1", 40))])
        assert _row(routing, worker_id) == (0, 3, 1)
        for t in trackers:
            await t.on_lifecycle_events([("on_request_completed", ("req-1",))])
        assert _row(peer, worker_id) == _row(routing, worker_id) == (0, 0, 0)
        assert all("req-1" not in t._requests for t in trackers)
        for t in trackers:
            frees = [c for c in t._svc.calls if c[0] == "free_reservation"]
            assert [a for _, a, _ in frees] == [("req-1",)]

        # A selection restricted to an unknown worker surfaces the service's error.
        with pytest.raises(impl.SelectionServiceError) as ei:
            await routing.select_worker("req-2", tokens, [12345], None)
        assert ei.value.kind == "scheduler"
        with pytest.raises(ValueError):
            await routing.select_worker("req-3", [], [worker_id], None)

        # Replica removal: Ray schedules delete_worker without awaiting it itself.
        routing.remove_worker(worker_id)
        await asyncio.gather(*routing._pending_tasks)
        assert routing._svc.list_workers() == []
    finally:
        if routing._reservation_forwarder is not None:
            routing._reservation_forwarder.close()
        for t in trackers:
            if t._reservation_apply_task is not None:
                t._reservation_apply_task.cancel()
            t._svc.shutdown()


@pytest.mark.kvselect_only
def test_install_is_idempotent_and_reversible():
    import kvselect
    import kvselect.ray

    original = ktt.KVTokenTracker._create_selection_service
    assert not kvselect.ray.is_installed()
    try:
        first = kvselect.ray.install()
        assert first is original
        patched = ktt.KVTokenTracker._create_selection_service
        assert patched is not original and kvselect.ray.is_installed()
        assert kvselect.ray.install() is original  # idempotent: nothing new replaced
        assert ktt.KVTokenTracker._create_selection_service is patched
    finally:
        assert kvselect.ray.uninstall() is original
    assert ktt.KVTokenTracker._create_selection_service is original
    assert not kvselect.ray.is_installed()
    assert kvselect.ray.uninstall() is None


@pytest.mark.kvselect_only
@async_test
async def test_install_without_dynamo(monkeypatch):
    """With ai-dynamo absent, Ray's own path leaves the tracker without a
    service; after install() it gets kvselect's."""
    import kvselect
    import kvselect.ray

    for mod in ("dynamo", "dynamo.llm", "dynamo._core"):
        monkeypatch.setitem(sys.modules, mod, None)  # import raises ImportError
    t = NoLongPollTracker()
    assert t._svc is None
    kvselect.ray.install()
    try:
        t = NoLongPollTracker()
        assert isinstance(t._svc, kvselect.SelectionService)
        t._svc.shutdown()
    finally:
        kvselect.ray.uninstall()


@pytest.mark.kvselect_only
def test_install_passes_service_options():
    import kvselect.ray

    seen = {}

    class Fake:
        def __init__(self, **kw):
            seen.update(kw)

    import kvselect

    real = kvselect.SelectionService
    kvselect.SelectionService = Fake
    try:
        kvselect.ray.install(selection_cache=None)

        async def build():
            return NoLongPollTracker(indexer_threads=3)

        asyncio.run(build())
        assert seen == {"indexer_threads": 3, "selection_cache": None}
    finally:
        kvselect.SelectionService = real
        kvselect.ray.uninstall()
