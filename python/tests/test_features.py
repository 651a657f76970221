"""Constructor features: session affinity and the replica-sync mesh between
two in-process services."""

from __future__ import annotations

import time

import pytest

from conftest import async_test, free_port, load_row, service, wait_for, wait_loaded, worker


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
        ep = f"tcp://127.0.0.1:{free_port()}"
        for svc in (a, b):
            await svc.upsert_worker(worker(7, endpoint=ep))
            await wait_loaded(svc, 7)
        # PUB/SUB joins lazily: book until one booking shows up on the peer
        booked = []

        async def replicated():
            sid = f"r{len(booked)}"
            await a.select_and_reserve({"token_ids": list(range(1, 65)), "selection_id": sid})
            booked.append(sid)
            row = _row(b, 7)
            return row is not None and row[2] > 0

        assert await wait_for(replicated, timeout=10.0, interval=0.1), "booking never reached the peer"
        assert await wait_for(lambda: _row(b, 7) == _row(a, 7), timeout=5.0)
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
