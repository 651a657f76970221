"""Constructor features: session affinity and the replica-sync mesh between
two in-process services."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import pytest

from conftest import async_test, free_port, load_row, service, unused_port, wait_for, wait_loaded, worker


def _prompt(i):
    return list(range(i * 100, i * 100 + 64))


def _row(svc, w):
    r = load_row(svc, w)
    return None if r is None else (r["potential_prefill_tokens"], r["potential_decode_blocks"], r["active_requests"])


@async_test
async def test_session_affinity_binds_bookings(impl):
    async with service(impl, session_affinity_ttl_secs=60.0) as svc:
        for w in (1, 2):
            await svc.upsert_worker(worker(w))
        await wait_loaded(svc, 2)
        got = [(await svc.select_and_reserve({"token_ids": _prompt(i), "session_id": "S", "selection_id": f"s{i}"}))["worker_id"]
               for i in range(6)]
        assert len(set(got)) == 1, got
        bound = got[0]
        r = await svc.select({"token_ids": _prompt(50), "session_id": "S"})
        assert r["worker_id"] == bound
        # session_context.session_id works the same way
        ctx = [(await svc.select_and_reserve({"token_ids": _prompt(i), "session_context": {"session_id": "T"},
                                              "selection_id": f"t{i}"}))["worker_id"] for i in range(4)]
        assert len(set(ctx)) == 1, ctx
        assert _row(svc, bound)[2] == 6 + (4 if ctx[0] == bound else 0)


@async_test
async def test_without_affinity_session_id_is_ignored(impl):
    async with service(impl) as svc:
        for w in (1, 2):
            await svc.upsert_worker(worker(w))
        await wait_loaded(svc, 2)
        got = [(await svc.select_and_reserve({"token_ids": _prompt(i), "session_id": "S", "selection_id": f"s{i}"}))["worker_id"]
               for i in range(6)]
        assert sorted(got) == [1, 1, 1, 2, 2, 2], got  # the load term alternates the bookings


@async_test
async def test_replica_sync_between_two_services(impl):
    pa, pb = free_port(), free_port()
    async with service(impl, replica_sync_port=pa, replica_sync_peers=[f"tcp://127.0.0.1:{pb}"]) as a, \
            service(impl, replica_sync_port=pb, replica_sync_peers=[f"tcp://127.0.0.1:{pa}"]) as b:
        ep = f"tcp://127.0.0.1:{unused_port()}"
        for svc in (a, b):
            await svc.upsert_worker(worker(7, endpoint=ep))
            await wait_loaded(svc, 7)
        # PUB/SUB joins lazily, and a message sent before the join is lost
        # for good (the embedded form serves no repair): probe until one
        # booking shows up on the peer, then free the probes.
        probes = []

        async def joined():
            sid = f"probe{len(probes)}"
            await a.select_and_reserve({"token_ids": list(range(1, 65)), "selection_id": sid})
            probes.append(sid)
            row = _row(b, 7)
            return row is not None and row[2] > 0

        assert await wait_for(joined, timeout=10.0, interval=0.1), "booking never reached the peer"
        for sid in probes:
            await a.free_reservation(sid)
        assert await wait_for(lambda: _row(b, 7) == (0, 0, 0), timeout=5.0), _row(b, 7)
        assert _row(a, 7) == (0, 0, 0)
        # Joined: every booking now reaches the peer.
        booked = ["r0", "r1"]
        for sid in booked:
            await a.select_and_reserve({"token_ids": list(range(1, 65)), "selection_id": sid})
        assert await wait_for(lambda: _row(b, 7) == _row(a, 7), timeout=5.0), (_row(a, 7), _row(b, 7))
        assert _row(a, 7) == (64 * len(booked), 4, len(booked))
        # the mirrored id is taken on the peer
        try:
            await b.select_and_reserve({"token_ids": [1], "selection_id": booked[-1]})
            raise AssertionError("peer booked a replicated id")
        except impl.SelectionServiceError as e:
            assert e.kind == "conflict"
        for sid in booked:
            await a.prefill_complete(sid)
        assert await wait_for(lambda: _row(b, 7) == (0, 4, len(booked)), timeout=5.0), _row(b, 7)
        for sid in booked:
            await a.free_reservation(sid)
        assert await wait_for(lambda: _row(b, 7) == (0, 0, 0), timeout=5.0), _row(b, 7)
        assert _row(a, 7) == (0, 0, 0)



@pytest.mark.kvselect_only
def test_shutdown_closes_the_mesh_socket(impl):
    """shutdown() stops the mesh threads and closes the PUB socket: its port
    can be bound again by a new service."""
    port = free_port()
    svc = impl.SelectionService(indexer_threads=1, replica_sync_port=port)
    with pytest.raises(ValueError, match="cannot start the replica mesh"):
        impl.SelectionService(indexer_threads=1, replica_sync_port=port)
    svc.shutdown()
    deadline = time.monotonic() + 3.0
    while True:
        try:
            again = impl.SelectionService(indexer_threads=1, replica_sync_port=port)
            break
        except ValueError:
            assert time.monotonic() < deadline, "the mesh port stayed bound after shutdown()"
            time.sleep(0.05)
    again.shutdown()
    with pytest.raises(ValueError, match="replica_sync_host"):
        impl.SelectionService(replica_sync_port=0, replica_sync_host="not-an-ip")


@pytest.mark.kvselect_only
@async_test
async def test_ipc_endpoints_need_the_keyword(impl):
    ipc = "ipc:///tmp/kvselect-pytest-ipc.sock"
    async with service(impl) as svc:
        rec = await svc.upsert_worker(worker(1, endpoint=ipc))
        assert rec["lifecycle"] == "incomplete"
        assert any("ipc endpoints are refused" in r for r in rec["not_schedulable_reasons"]), rec
        rec = await svc.upsert_worker(worker(2, endpoint="inproc://x"))
        assert rec["lifecycle"] == "incomplete"
    async with service(impl, allow_ipc_endpoints=True) as svc:
        rec = await svc.upsert_worker(worker(1, endpoint=ipc))
        assert rec["lifecycle"] == "schedulable", rec
        rec = await svc.upsert_worker(worker(2, endpoint="inproc://x"))
        assert rec["lifecycle"] == "incomplete"


@pytest.mark.kvselect_only
@async_test
async def test_simd_keyword_and_environment(impl):
    with pytest.raises(ValueError, match="is not one of auto, avx512, avx2, sse4.1, scalar"):
        impl.SelectionService(simd="sse9")
    # every path gives the same answer; the scalar one exists on every CPU
    for path in ("scalar", "auto", "sse4.1"):
        try:
            impl.SelectionService(indexer_threads=1, simd=path).shutdown()
        except ValueError as e:
            # a CPU without the path: the start-up error, and nothing to run
            assert f"lacks the {path}" in str(e), e
            continue
        async with service(impl, simd=path) as svc:
            await svc.upsert_worker(worker(1))
            await wait_loaded(svc, 1)
            r = await svc.select({"token_ids": list(range(1, 65))})
            assert r["worker_id"] == 1
            with pytest.raises(ValueError, match="invalid value: integer `-1`"):
                await svc.select({"token_ids": [1, 2, -1]})
    # KVSELECT_SIMD is read when the keyword is absent
    code = ("import kvselect\n"
            "try:\n    kvselect.SelectionService(indexer_threads=1)\nexcept ValueError as e:\n    print(e)\n")
    env = dict(os.environ, KVSELECT_SIMD="bogus")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert "`bogus` is not one of" in out.stdout, (out.stdout, out.stderr)


@pytest.mark.kvselect_only
@async_test
async def test_freshness_keywords(impl):
    with pytest.raises(ValueError, match="index_lag_max_wait_ms must be at least 1"):
        impl.SelectionService(index_lag_max_wait_ms=0)
    # the gate on (a tight bound) and off answer alike on a caught-up index
    for lag in (1, 0):
        async with service(impl, max_index_lag_ms=lag, index_lag_max_wait_ms=500) as svc:
            await svc.upsert_worker(worker(1))
            await wait_loaded(svc, 1)
            r = await svc.select_and_reserve({"token_ids": list(range(1, 65))})
            assert r["worker_id"] == 1, r
            assert len(r["sequence_hashes"]) == 4, r


@pytest.mark.kvselect_only
@async_test
async def test_queue_threshold_waits_without_blocking_the_loop(impl, monkeypatch):
    """DYN_ROUTER_QUEUE_THRESHOLD: a select whose workers are all busy waits
    (the event loop keeps running), a free admits it, a cancelled one leaves
    the queue unbooked."""
    monkeypatch.setenv("DYN_ROUTER_QUEUE_THRESHOLD", "1.0")
    async with service(impl) as svc:
        rec = await svc.upsert_worker(worker(1))
        assert rec["not_schedulable_reasons"] == ["max_num_batched_tokens is required while queueing is enabled"]
        await svc.upsert_worker(worker(1, max_num_batched_tokens=100))
        await wait_loaded(svc, 1)
        await svc.select_and_reserve({"token_ids": _prompt(1)[:64] * 4, "selection_id": "big"})  # 256 > 100: busy

        def pending():
            return svc.loads()[0]["pending_count"]

        waiting = asyncio.ensure_future(svc.select_and_reserve({"token_ids": _prompt(2), "selection_id": "w"}))
        assert await wait_for(lambda: pending() == 1)
        ticks = 0
        for _ in range(10):  # the loop is not blocked while it waits
            await asyncio.sleep(0.01)
            ticks += 1
        assert ticks == 10 and not waiting.done()
        await svc.free_reservation("big")
        r = await asyncio.wait_for(waiting, 5)
        assert r["worker_id"] == 1 and r["selection_id"] == "w"
        assert pending() == 0

        # a cancelled waiter leaves the queue and books nothing
        await svc.select_and_reserve({"token_ids": _prompt(3)[:64] * 4, "selection_id": "big2"})
        gone = asyncio.ensure_future(svc.select_and_reserve({"token_ids": _prompt(4), "selection_id": "gone"}))
        assert await wait_for(lambda: pending() == 1)
        gone.cancel()
        assert await wait_for(lambda: pending() == 0)
        await svc.free_reservation("big2")
        await asyncio.sleep(0.1)
        with pytest.raises(impl.SelectionServiceError):
            await svc.free_reservation("gone")
        # advisory selects never wait
        await svc.select_and_reserve({"token_ids": _prompt(5)[:64] * 4, "selection_id": "big3"})
        r = await asyncio.wait_for(svc.select({"token_ids": _prompt(6), "advisory": True}), 2)
        assert r["worker_load"]["active_prefill_tokens"] > 100


@async_test
async def test_replica_peer_methods(impl):
    """``list_replica_peers`` (sync), ``register_replica_peer`` and
    ``deregister_replica_peer`` (awaitables resolving with whether the
    membership changed), as Dynamo's; without the mesh the last two fail."""
    peer = f"tcp://127.0.0.1:{unused_port()}"
    async with service(impl) as off:
        assert off.list_replica_peers() == []
        for call in (off.register_replica_peer, off.deregister_replica_peer):
            with pytest.raises(Exception, match="replica sync is disabled"):
                await call(peer)
    async with service(impl, replica_sync_port=free_port()) as svc:
        assert svc.list_replica_peers() == []
        assert await svc.register_replica_peer(peer) is True
        assert await svc.register_replica_peer(peer) is False
        assert svc.list_replica_peers() == [peer]
        with pytest.raises(Exception, match="bogus"):
            await svc.register_replica_peer("bogus")
        assert await svc.deregister_replica_peer(peer) is True
        assert await svc.deregister_replica_peer(peer) is False
        assert svc.list_replica_peers() == []


@async_test
async def test_indexer_snapshot_and_recovery_from_peers(impl):
    """``indexer_snapshot()`` resolves with the ``/dump`` shape as a dict
    (``{}`` for an empty index); ``recover_indexer_from_peers(peers)``
    resolves with whether a peer's dump loaded (none listens here)."""
    async with service(impl) as svc:
        assert await svc.indexer_snapshot() == {}
        dead = f"http://127.0.0.1:{unused_port()}"
        assert await svc.recover_indexer_from_peers([dead]) is False
        assert await svc.recover_indexer_from_peers([]) is False
        with pytest.raises(TypeError):
            svc.recover_indexer_from_peers(dead)


def test_replica_sync_port_zero_is_refused(impl):
    with pytest.raises(Exception, match="replica sync port must be greater than zero"):
        impl.SelectionService(indexer_threads=1, replica_sync_port=0)


@pytest.mark.kvselect_only
@async_test
async def test_indexer_threads_beyond_the_cap_run_the_cap(impl):
    """Dynamo takes any ``indexer_threads`` (it runs a fixed few); kvselect
    runs at most 64 KV-event threads, so a huge value neither aborts the
    interpreter (it did, allocating for 2**40 threads) nor runs out of file
    descriptors."""
    threads = lambda: len(os.listdir("/proc/self/task"))  # native ones too
    before = threads()
    async with service(impl, indexer_threads=2**40) as svc:
        assert threads() - before <= 64 + 8, threads() - before
        await svc.upsert_worker(worker(1))
        await wait_loaded(svc, 1)
