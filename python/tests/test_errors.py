"""Error classes, kinds, status codes and messages, and whether an error is
raised synchronously (at the call) or by the awaitable. Contract:
REFERENCE_NOTES.md."""

from __future__ import annotations

import asyncio

import pytest

from conftest import async_test, service, wait_loaded, worker

TOKENS = list(range(1, 65))
NOT_READY = "no schedulable workers are available"


def raises_sync(exc, call, match=None):
    """``call()`` must raise ``exc`` itself, before anything is awaited."""
    with pytest.raises(exc) as ei:
        call()
    if match is not None:
        assert str(ei.value) == match, str(ei.value)
    return ei.value


async def raises_async(exc, call, match=None):
    """``call()`` must return an awaitable, which then raises ``exc``."""
    fut = call()
    with pytest.raises(exc) as ei:
        await fut
    if match is not None:
        assert str(ei.value) == match, str(ei.value)
    return ei.value


def check_kind(err, kind, status):
    assert err.kind == kind, (err.kind, str(err))
    assert err.status_code == status, (err.status_code, str(err))
    assert err.args == (str(err),)


def test_constructor_is_keyword_only(impl):
    with pytest.raises(TypeError):
        impl.SelectionService(4)
    with pytest.raises(TypeError):
        impl.SelectionCacheConfig(1.0)
    with pytest.raises(TypeError):
        impl.SelectionService(no_such_option=1)
    with pytest.raises(TypeError):
        impl.SelectionService(indexer_threads="4")


ARGUMENT_TYPE_ERRORS = [
    ("SelectionService", dict(indexer_threads=1.5),
     "argument 'indexer_threads': 'float' object cannot be interpreted as an integer"),
    ("SelectionService", dict(indexer_threads=None),
     "argument 'indexer_threads': 'NoneType' object cannot be interpreted as an integer"),
    ("SelectionService", dict(replica_sync_port="x"),
     "argument 'replica_sync_port': 'str' object cannot be interpreted as an integer"),
    ("SelectionService", dict(session_affinity_ttl_secs="5"),
     "argument 'session_affinity_ttl_secs': must be real number, not str"),
    ("SelectionService", dict(replica_sync_peers="tcp://a:1"),
     "argument 'replica_sync_peers': Can't extract `str` to `Vec`"),
    ("SelectionService", dict(indexer_peers=5), "argument 'indexer_peers': 'int' object cannot be converted to 'Sequence'"),
    ("SelectionService", dict(indexer_peers=[5]),
     "argument 'indexer_peers': 'int' object cannot be converted to 'PyString'"),
    ("SelectionService", dict(selection_cache={"ttl_secs": 1}),
     "argument 'selection_cache': 'dict' object cannot be converted to 'SelectionCacheConfig'"),
    ("SelectionCacheConfig", dict(ttl_secs="x"), "argument 'ttl_secs': must be real number, not str"),
    ("SelectionCacheConfig", dict(max_bytes=1.5),
     "argument 'max_bytes': 'float' object cannot be interpreted as an integer"),
]


@pytest.mark.parametrize("cls,kwargs,text", ARGUMENT_TYPE_ERRORS, ids=range(len(ARGUMENT_TYPE_ERRORS)))
def test_argument_type_errors_name_the_argument(impl, cls, kwargs, text):
    with pytest.raises(TypeError) as ei:
        getattr(impl, cls)(**kwargs)
    assert str(ei.value) == text
    # Overflow is Python's error, unnamed, in both.
    with pytest.raises(OverflowError) as ei:
        impl.SelectionService(replica_sync_port=70000)
    assert str(ei.value) == "out of range integral type conversion attempted"


def test_report_filters_name_the_argument(impl):
    svc = impl.SelectionService(indexer_threads=1)
    try:
        for method in (svc.list_workers, svc.loads):
            with pytest.raises(TypeError) as ei:
                method(model_name=5)
            assert str(ei.value) == "argument 'model_name': 'int' object cannot be converted to 'PyString'"
            with pytest.raises(TypeError) as ei:
                method(routing_group=[1])
            assert str(ei.value) == "argument 'routing_group': 'list' object cannot be converted to 'PyString'"
    finally:
        svc.shutdown()


def test_constructor_validation(impl):
    raises_sync(ValueError, lambda: impl.SelectionService(session_affinity_ttl_secs=0.5),
                "session_affinity_ttl_secs must be between 1 and 31536000")
    raises_sync(ValueError, lambda: impl.SelectionService(replica_sync_peers=["tcp://127.0.0.1:1"]),
                "replica_sync_peers requires replica_sync_port")


def test_error_class(impl):
    assert issubclass(impl.SelectionServiceError, Exception)
    assert not issubclass(impl.SelectionServiceError, ValueError)


def test_async_call_needs_running_loop(impl):
    svc = impl.SelectionService(indexer_threads=1)
    try:
        with pytest.raises(RuntimeError):
            svc.select({"token_ids": TOKENS})
    finally:
        svc.shutdown()


@async_test
async def test_not_ready_without_workers(impl):
    async with service(impl) as svc:
        for name in ("select", "select_and_reserve", "overlap_scores", "potential_loads"):
            e = await raises_async(impl.SelectionServiceError,
                                   lambda: getattr(svc, name)({"token_ids": TOKENS}), NOT_READY)
            check_kind(e, "not_ready", 503)
        e = await raises_async(impl.SelectionServiceError, lambda: svc.create_reservation(
            {"selection_id": "x", "worker_id": 1, "token_ids": TOKENS}), NOT_READY)
        check_kind(e, "not_ready", 503)


@async_test
async def test_not_ready_unknown_partition(impl):
    async with service(impl) as svc:
        await svc.upsert_worker(worker(1))
        await wait_loaded(svc, 1)
        e = await raises_async(impl.SelectionServiceError, lambda: svc.select(
            {"token_ids": TOKENS, "model_name": "zz"}),
            "no schedulable workers for model=zz routing_group=default")
        check_kind(e, "not_ready", 503)


@async_test
async def test_scheduler_no_eligible_worker(impl):
    async with service(impl) as svc:
        await svc.upsert_worker(worker(1))
        await wait_loaded(svc, 1)
        for extra in ({"allowed_worker_ids": [999]},
                      {"pinned_worker": {"worker_id": 999, "dp_rank": 0}},
                      {"routing_constraints": {"required_taints": ["gpu-x"]}}):
            e = await raises_async(impl.SelectionServiceError, lambda: svc.select(
                dict({"token_ids": TOKENS}, **extra)), "no endpoints available to route work")
            check_kind(e, "scheduler", 503)


@async_test
async def test_unknown_ids_not_found(impl):
    async with service(impl) as svc:
        for name in ("prefill_complete", "free_reservation"):
            e = await raises_async(impl.SelectionServiceError,
                                   lambda: getattr(svc, name)("nope"), "reservation nope not found")
            check_kind(e, "not_found", 404)
        # add_output_block is synchronous: it raises at once
        e = raises_sync(impl.SelectionServiceError, lambda: svc.add_output_block("nope"),
                        "reservation nope not found")
        check_kind(e, "not_found", 404)
        e = await raises_async(impl.SelectionServiceError, lambda: svc.delete_worker(5), "worker 5 not found")
        check_kind(e, "not_found", 404)
        e = await raises_async(impl.SelectionServiceError, lambda: svc.create_reservation({"selection_id": "c9"}),
                               "no pending selection c9 for model=default routing_group=default "
                               "(expired, already used, or never selected)")
        check_kind(e, "not_found", 404)


@async_test
async def test_explicit_reservation_errors(impl):
    async with service(impl) as svc:
        await svc.upsert_worker(worker(1))
        await wait_loaded(svc, 1)
        base = {"selection_id": "e", "worker_id": 1, "sequence_hashes": [], "isl_tokens": 40}
        e = await raises_async(impl.SelectionServiceError, lambda: svc.create_reservation(
            dict(base, worker_id=999)), "schedulable worker 999 not found for model=default routing_group=default")
        check_kind(e, "not_found", 404)
        e = await raises_async(impl.SelectionServiceError, lambda: svc.create_reservation(
            dict(base, dp_rank=5)), "Worker WorkerWithDpRank { worker_id: 1, dp_rank: 5 } not found")
        check_kind(e, "sequence", 404)
        await raises_async(ValueError, lambda: svc.create_reservation(dict(base, effective_prefill_tokens=41)),
                           "effective_prefill_tokens (41) must not exceed isl_tokens (40)")
        await raises_async(ValueError, lambda: svc.create_reservation(
            {"selection_id": "e", "worker_id": 1, "isl_tokens": 40}),
            "sequence_hashes is required without token_ids")
        raises_sync(ValueError, lambda: svc.create_reservation({"worker_id": 1}), "missing field `selection_id`")
        assert svc.loads()[0]["loads"][0]["active_requests"] == 0


@async_test
async def test_duplicate_selection_id_conflict(impl):
    async with service(impl) as svc:
        await svc.upsert_worker(worker(1))
        await wait_loaded(svc, 1)
        await svc.select_and_reserve({"token_ids": TOKENS, "selection_id": "r1"})
        msg = "selection r1 is already reserved or being reserved"
        e = await raises_async(impl.SelectionServiceError,
                               lambda: svc.select_and_reserve({"token_ids": TOKENS, "selection_id": "r1"}), msg)
        check_kind(e, "conflict", 409)
        e = await raises_async(impl.SelectionServiceError, lambda: svc.create_reservation(
            {"selection_id": "r1", "worker_id": 1, "sequence_hashes": [], "isl_tokens": 1}), msg)
        check_kind(e, "conflict", 409)
        # a cached selection survives a conflicting replay and books once the id is free
        await svc.select({"token_ids": TOKENS, "selection_id": "r1"})
        e = await raises_async(impl.SelectionServiceError, lambda: svc.create_reservation({"selection_id": "r1"}), msg)
        check_kind(e, "conflict", 409)
        await svc.free_reservation("r1")
        await svc.create_reservation({"selection_id": "r1"})
        assert svc.loads()[0]["loads"][0]["active_requests"] == 1
        # freed ids are gone
        await svc.free_reservation("r1")
        e = await raises_async(impl.SelectionServiceError, lambda: svc.free_reservation("r1"),
                               "reservation r1 not found")
        check_kind(e, "not_found", 404)


@async_test
async def test_bad_request_is_value_error(impl):
    async with service(impl) as svc:
        await svc.upsert_worker(worker(1))
        await wait_loaded(svc, 1)
        cases = [
            ({}, "block_hashes is required without token_ids"),
            ({"block_hashes": [1, 2]}, "sequence_hashes is required without token_ids"),
            ({"block_hashes": [1, 2], "sequence_hashes": [3, 4]}, "isl_tokens is required without token_ids"),
            ({"block_hashes": [1, 2], "sequence_hashes": [3, 4], "isl_tokens": 0}, "isl_tokens must be greater than 0"),
            ({"block_hashes": [1, 2], "sequence_hashes": [3], "isl_tokens": 32},
             "block_hashes length 2 must match sequence_hashes length 1"),
        ]
        for req, msg in cases:
            await raises_async(ValueError, lambda: svc.select(req), msg)
        # decay_fraction is range-checked before the id lookup
        raises_sync(ValueError, lambda: svc.add_output_block("nope", decay_fraction=1.5),
                    "decay_fraction must be between 0.0 and 1.0")
        raises_sync(ValueError, lambda: svc.add_output_block("nope", decay_fraction=-0.1),
                    "decay_fraction must be between 0.0 and 1.0")


@async_test
async def test_malformed_request_dicts_raise_value_error_synchronously(impl):
    async with service(impl) as svc:
        for method in ("select", "select_and_reserve", "overlap_scores", "potential_loads"):
            call = getattr(svc, method)
            raises_sync(ValueError, lambda: call([1, 2]),
                        "unexpected type: 'list' object cannot be converted to 'Mapping'")
            raises_sync(ValueError, lambda: call(None),
                        "unexpected type: 'NoneType' object cannot be converted to 'Mapping'")
            raises_sync(ValueError, lambda: call({"token_ids": "abc"}),
                        'invalid type: string "abc", expected a sequence')
            raises_sync(ValueError, lambda: call({"token_ids": TOKENS, "model_name": 5}),
                        "unexpected type: 'int' object cannot be converted to 'PyString'")
            raises_sync(ValueError, lambda: call({"token_ids": TOKENS, "model_name": None}),
                        "unexpected type: 'NoneType' object cannot be converted to 'PyString'")


@pytest.mark.parametrize("bad,text", [
    (-1, "invalid value: integer `-1`, expected u32"),
    (2**32, "invalid value: integer `4294967296`, expected u32"),
    (1.5, "invalid type: floating point `1.5`, expected u32"),
    ("a", 'invalid type: string "a", expected u32'),
    (True, "invalid type: boolean `true`, expected u32"),
])
@async_test
async def test_bad_token_raises_value_error_synchronously(impl, bad, text):
    async with service(impl) as svc:
        toks = [1, 2, 3, 4, 5]
        toks[3] = bad
        for method in ("select", "select_and_reserve", "overlap_scores", "potential_loads"):
            e = raises_sync(ValueError, lambda: getattr(svc, method)({"token_ids": toks}))
            assert text in str(e), str(e)
        e = raises_sync(ValueError, lambda: svc.create_reservation(
            {"selection_id": "x", "worker_id": 1, "token_ids": toks}))
        assert text in str(e)


@async_test
async def test_malformed_worker_dicts(impl):
    async with service(impl) as svc:
        ep = "tcp://127.0.0.1:39999"
        raises_sync(ValueError, lambda: svc.upsert_worker({}), "missing field `worker_id`")
        raises_sync(ValueError, lambda: svc.upsert_worker({"worker_id": -1}),
                    "OverflowError: can't convert negative int to unsigned")
        raises_sync(ValueError, lambda: svc.upsert_worker({"worker_id": "1"}),
                    "TypeError: 'str' object cannot be interpreted as an integer")
        # kv_events_endpoints keys must be Python ints
        raises_sync(ValueError, lambda: svc.upsert_worker(
            {"worker_id": 1, "endpoint": "http://w1", "block_size": 16, "kv_events_endpoints": {"0": ep}}),
            "TypeError: 'str' object cannot be interpreted as an integer")
        raises_sync(ValueError, lambda: svc.upsert_worker({"worker_id": 1, "kv_transfer_enforcement": "bogus"}),
                    "unknown variant `bogus`, expected `required` or `preferred`")
        raises_sync(ValueError, lambda: svc.upsert_worker([1]),
                    "unexpected type: 'list' object cannot be converted to 'Mapping'")
        assert svc.list_workers() == []


def test_wrong_argument_types_raise_type_error(impl):
    async def body():
        async with service(impl) as svc:
            with pytest.raises(TypeError):
                svc.delete_worker("x")
            with pytest.raises(OverflowError):
                svc.delete_worker(-1)
            with pytest.raises(TypeError):
                svc.prefill_complete(5)
            with pytest.raises(TypeError):
                svc.free_reservation(None)
            with pytest.raises(TypeError):
                svc.add_output_block("r1", 0.5)  # decay_fraction is keyword-only
            with pytest.raises(TypeError):
                svc.list_workers("default")  # filters are keyword-only
            with pytest.raises(TypeError):
                svc.list_workers(tenant_id="t")
            with pytest.raises(TypeError):
                svc.loads(model_name=5)

    asyncio.run(body())


@async_test
async def test_incomplete_worker_reasons(impl):
    async with service(impl) as svc:
        rec = await svc.upsert_worker({"worker_id": 5, "endpoint": "http://w", "block_size": 16,
                                       "data_parallel_size": 2, "kv_events_endpoint": "tcp://127.0.0.1:39998"})
        assert rec["lifecycle"] == "incomplete"
        assert rec["not_schedulable_reasons"] == [
            "kv_events endpoint is required for dp_rank 0", "kv_events endpoint is required for dp_rank 1"]
        rec = await svc.upsert_worker(worker(6, endpoint="not-a-url"))
        assert rec["lifecycle"] == "incomplete"
        assert rec["not_schedulable_reasons"] == [
            "reconciliation failed: invalid kv_events endpoint for worker 6 dp_rank 0: "
            "invalid ZMQ endpoint `not-a-url`: missing scheme"]
        assert svc.ready()["ready"] is False
        await svc.upsert_worker(worker(7))
        rec = await svc.upsert_worker(worker(8, block_size=32))
        assert rec["not_schedulable_reasons"] == [
            "reconciliation failed: block_size mismatch for model=default routing_group=default: "
            "existing=16 requested=32"]


@async_test
async def test_error_pickles_with_kind_and_status(impl):
    """Ray ships exceptions between processes by pickling them: the class must
    be importable by its ``__module__`` and keep ``kind``/``status_code``."""
    import importlib
    import pickle

    cls = impl.SelectionServiceError
    assert getattr(importlib.import_module(cls.__module__), cls.__qualname__) is cls
    async with service(impl) as svc:
        with pytest.raises(cls) as ei:
            await svc.free_reservation("x")
    e = ei.value
    assert repr(e) == "SelectionServiceError('reservation x not found')"
    e2 = pickle.loads(pickle.dumps(e))
    assert type(e2) is cls
    assert str(e2) == "reservation x not found"
    assert (e2.kind, e2.status_code) == ("not_found", 404)
