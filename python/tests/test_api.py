"""Methods, return shapes and load accounting of the embedded API (the
success paths). Contract: REFERENCE_NOTES.md."""

from __future__ import annotations

import asyncio
import inspect

import pytest

from conftest import (
    BLOCK_SIZE,
    SEQ_1_64,
    async_test,
    load_row,
    service,
    wait_loaded,
    worker,
)

TOKENS = list(range(1, 65))  # 4 full blocks

WORKER_KEYS = [
    "worker_id", "model_name", "routing_group", "lifecycle", "endpoint",
    "kv_events_endpoint", "kv_events_endpoints", "replay_endpoint", "block_size",
    "data_parallel_start_rank", "data_parallel_size", "max_num_batched_tokens",
    "total_kv_blocks", "stable_routing_id", "is_eagle", "taints",
    "topology_domains", "kv_transfer_domain", "kv_transfer_enforcement",
    "kv_transfer_preferred_weight",
]
SELECT_KEYS = [
    "model_name", "routing_group", "worker_id", "dp_rank", "endpoint",
    "block_size", "overlap", "effective_prefill_tokens", "potential_decode_blocks",
]
RESERVE_KEYS = ["selection_id", "sequence_hashes", "isl_tokens", "track_prefill_tokens"] + SELECT_KEYS
LOAD_KEYS = ["worker_id", "dp_rank", "potential_prefill_tokens", "potential_decode_blocks", "active_requests"]


def test_constructor_defaults_and_keywords(impl):
    svc = impl.SelectionService()
    svc.shutdown()
    cfg = impl.SelectionCacheConfig(ttl_secs=30.0, max_entries=10, max_bytes=1 << 20)
    svc = impl.SelectionService(
        indexer_threads=2,
        indexer_peers=None,
        replica_sync_port=None,
        replica_sync_peers=None,
        selection_cache=cfg,
        session_affinity_ttl_secs=60.0,
    )
    svc.shutdown()
    impl.SelectionCacheConfig()  # every field optional


def test_module_exports(impl):
    assert issubclass(impl.SelectionServiceError, Exception)
    for name in ("SelectionService", "SelectionCacheConfig", "SelectionServiceError"):
        assert hasattr(impl.module, name)
    if impl.name == "kvselect":
        import kvselect

        assert set(kvselect.__all__) >= {"SelectionService", "SelectionCacheConfig", "SelectionServiceError"}
        assert isinstance(kvselect.__version__, str) and kvselect.__version__


def test_async_methods_return_awaitables_sync_methods_values(impl):
    async def body():
        async with service(impl) as svc:
            fut = svc.upsert_worker(worker(1))
            assert inspect.isawaitable(fut)
            rec = await fut
            assert isinstance(rec, dict)
            for call in (
                lambda: svc.select({"token_ids": TOKENS}),
                lambda: svc.overlap_scores({"token_ids": TOKENS}),
                lambda: svc.potential_loads({"token_ids": TOKENS}),
            ):
                f = call()
                assert inspect.isawaitable(f) and not isinstance(f, (dict, list))
                await f
            assert isinstance(svc.ready(), dict)
            assert isinstance(svc.list_workers(), list)
            assert isinstance(svc.loads(), list)

    asyncio.run(body())


@async_test
async def test_fresh_service_state(impl):
    async with service(impl) as svc:
        assert svc.ready() == {"ready": False, "schedulable_workers": 0, "workers": []}
        assert svc.list_workers() == []
        assert svc.loads() == []


@async_test
async def test_upsert_worker_record(impl):
    async with service(impl) as svc:
        ep = "tcp://127.0.0.1:39001"
        rec = await svc.upsert_worker(worker(1, endpoint=ep))
        assert list(rec) == WORKER_KEYS  # field order; reasons omitted when empty
        assert rec["worker_id"] == 1
        assert rec["model_name"] == "default" and rec["routing_group"] == "default"
        assert rec["lifecycle"] == "schedulable"
        assert rec["kv_events_endpoints"] == {0: ep}  # keys come back as ints
        assert rec["block_size"] == BLOCK_SIZE
        assert rec["kv_events_endpoint"] is None and rec["data_parallel_size"] is None
        assert rec["taints"] == [] and rec["topology_domains"] == {}

        inc = await svc.upsert_worker({"worker_id": 10})
        assert inc["lifecycle"] == "incomplete"
        assert "kv_events_endpoints" not in inc
        assert inc["not_schedulable_reasons"] == [
            "endpoint is required",
            "block_size must be greater than 0",
            "kv_events endpoint is required for dp_rank 0",
        ]
        # singular endpoint, explicit partition
        rec3 = await svc.upsert_worker(
            {"worker_id": 3, "endpoint": "http://w3", "block_size": 16,
             "kv_events_endpoint": "tcp://127.0.0.1:39003", "model_name": "m2"}
        )
        assert rec3["lifecycle"] == "schedulable" and rec3["model_name"] == "m2"
        assert "kv_events_endpoints" not in rec3

        r = svc.ready()
        assert r["ready"] is True and r["schedulable_workers"] == 2
        # ready() lists workers in the same order as list_workers()
        assert [w["worker_id"] for w in r["workers"]] == [1, 10, 3]
        # list_workers sorts by (model_name, routing_group, worker_id)
        assert [w["worker_id"] for w in svc.list_workers()] == [1, 10, 3]
        assert [w["worker_id"] for w in svc.list_workers(model_name="m2")] == [3]
        assert svc.list_workers(routing_group="nope") == []
        assert [w["worker_id"] for w in svc.list_workers(model_name="default", routing_group="default")] == [1, 10]


@async_test
async def test_unknown_keys_ignored(impl):
    # Ray sends "tenant_id", which is not a field.
    async with service(impl) as svc:
        rec = await svc.upsert_worker(dict(worker(1), tenant_id="t", unknown_key=[1, 2]))
        assert rec["lifecycle"] == "schedulable" and "tenant_id" not in rec
        r = await svc.select({"token_ids": TOKENS, "tenant_id": "t", "no_such_field": {"a": 1}})
        assert r["worker_id"] == 1


@async_test
async def test_select_shape_and_no_booking(impl):
    async with service(impl) as svc:
        await svc.upsert_worker(worker(1))
        await wait_loaded(svc, 1)
        r = await svc.select({"token_ids": TOKENS})
        assert list(r) == SELECT_KEYS
        assert r["worker_id"] == 1 and r["dp_rank"] == 0
        assert r["endpoint"] == "http://w1:8000" and r["block_size"] == 16
        assert r["overlap"] == {"longest_matched": 0, "gpu": 0, "dp": {"0": 0}, "cpu": 0, "disk": 0}
        assert r["effective_prefill_tokens"] == 64 and r["potential_decode_blocks"] == 4
        assert load_row(svc, 1) == {"worker_id": 1, "dp_rank": 0, "potential_prefill_tokens": 0,
                                   "potential_decode_blocks": 0, "active_requests": 0}
        r = await svc.select({"token_ids": TOKENS, "selection_id": "s1"})
        assert list(r) == ["selection_id"] + SELECT_KEYS and r["selection_id"] == "s1"
        r = await svc.select({"token_ids": []})
        assert r["effective_prefill_tokens"] == 0 and r["potential_decode_blocks"] == 0
        r = await svc.select({"block_hashes": [1, 2], "sequence_hashes": [-3, 4], "isl_tokens": 40})
        assert r["potential_decode_blocks"] == 3 and r["effective_prefill_tokens"] == 40


@async_test
async def test_select_and_reserve_shape_and_hashes(impl):
    async with service(impl) as svc:
        await svc.upsert_worker(worker(1))
        await wait_loaded(svc, 1)
        r = await svc.select_and_reserve({"token_ids": TOKENS, "selection_id": "r1",
                                          "expected_output_tokens": None})
        assert list(r) == RESERVE_KEYS
        assert r["selection_id"] == "r1"
        assert r["sequence_hashes"] == SEQ_1_64
        assert r["isl_tokens"] == 64 and r["track_prefill_tokens"] is True
        assert r["effective_prefill_tokens"] == 64 and r["potential_decode_blocks"] == 4
        # without an id a UUID v4 string is generated
        r2 = await svc.select_and_reserve({"token_ids": list(range(1, 71))})
        sid = r2["selection_id"]
        assert isinstance(sid, str) and len(sid) == 36 and sid[14] == "4"
        assert r2["sequence_hashes"] == SEQ_1_64 and r2["isl_tokens"] == 70
        # precomputed hashes pass through
        r3 = await svc.select_and_reserve({"block_hashes": [1, 2], "sequence_hashes": [-3, 4], "isl_tokens": 40})
        assert r3["sequence_hashes"] == [-3, 4] and r3["isl_tokens"] == 40
        for sid_ in ("r1", sid, r3["selection_id"]):
            assert await svc.free_reservation(sid_) == ()


@async_test
async def test_overlap_scores_and_potential_loads_shapes(impl):
    async with service(impl) as svc:
        await svc.upsert_worker(worker(2))
        await svc.upsert_worker(worker(1))
        await wait_loaded(svc, 2)
        o = await svc.overlap_scores({"token_ids": list(range(1, 81))})
        assert o["block_size"] == 16 and o["num_blocks"] == 5
        assert [(w["worker_id"], w["dp_rank"]) for w in o["workers"]] == [(1, 0), (2, 0)]
        assert list(o["workers"][0]) == [
            "worker_id", "dp_rank", "device_blocks", "host_pinned_blocks", "disk_blocks",
            "host_pinned_extension_blocks", "disk_extension_blocks", "shared_beyond_device_blocks",
        ]
        assert o["workers"][0]["device_blocks"] == 0 and o["workers"][0]["shared_beyond_device_blocks"] is None
        assert o["shared_cache"] == {"enabled": False, "total_hit_blocks": 0, "ranges": [], "error": None}
        p = await svc.potential_loads({"token_ids": TOKENS})
        assert isinstance(p, list)
        assert sorted(row["worker_id"] for row in p) == [1, 2]
        for row in p:
            assert list(row) == LOAD_KEYS
            assert (row["potential_prefill_tokens"], row["potential_decode_blocks"], row["active_requests"]) == (64, 4, 0)


@async_test
async def test_booking_lifecycle_in_loads(impl):
    async with service(impl) as svc:
        await svc.upsert_worker(worker(1))
        await wait_loaded(svc, 1)
        parts = svc.loads()
        assert list(parts[0]) == ["model_name", "routing_group", "loads", "pending_count", "pending_isl_tokens"]
        await svc.select_and_reserve({"token_ids": TOKENS, "selection_id": "r1"})
        row = load_row(svc, 1)
        assert (row["potential_prefill_tokens"], row["potential_decode_blocks"], row["active_requests"]) == (64, 4, 1)
        # potential_loads adds the prompt on top of the current load (shared hashes)
        p = await svc.potential_loads({"token_ids": TOKENS})
        assert (p[0]["potential_prefill_tokens"], p[0]["potential_decode_blocks"]) == (128, 4)
        assert await svc.prefill_complete("r1") == ()
        assert await svc.prefill_complete("r1") == ()  # idempotent
        row = load_row(svc, 1)
        assert (row["potential_prefill_tokens"], row["potential_decode_blocks"], row["active_requests"]) == (0, 4, 1)
        assert svc.add_output_block("r1") is None
        assert load_row(svc, 1)["potential_decode_blocks"] == 5
        assert svc.add_output_block("r1", decay_fraction=0.5) is None
        assert load_row(svc, 1)["potential_decode_blocks"] == 3  # 6 exclusive blocks x 0.5
        assert await svc.free_reservation("r1") == ()
        row = load_row(svc, 1)
        assert (row["potential_prefill_tokens"], row["potential_decode_blocks"], row["active_requests"]) == (0, 0, 0)
        assert svc.loads(model_name="nope") == []
        assert [p["model_name"] for p in svc.loads(routing_group="default")] == ["default"]


@async_test
async def test_identical_bookings_share_decode_blocks(impl):
    async with service(impl) as svc:
        await svc.upsert_worker(worker(1))
        await wait_loaded(svc, 1)
        await svc.select_and_reserve({"token_ids": TOKENS, "selection_id": "a"})
        await svc.select_and_reserve({"token_ids": TOKENS, "selection_id": "b"})
        row = load_row(svc, 1)
        assert (row["potential_prefill_tokens"], row["potential_decode_blocks"], row["active_requests"]) == (128, 4, 2)


@async_test
async def test_create_reservation_replay_and_explicit(impl):
    async with service(impl) as svc:
        await svc.upsert_worker(worker(1))
        await wait_loaded(svc, 1)
        await svc.select({"token_ids": TOKENS, "selection_id": "c1"})
        assert load_row(svc, 1)["active_requests"] == 0
        r = await svc.create_reservation({"selection_id": "c1"})
        assert r == {"selection_id": "c1", "model_name": "default", "routing_group": "default",
                     "worker_id": 1, "dp_rank": 0, "endpoint": "http://w1:8000"}
        row = load_row(svc, 1)
        assert (row["potential_prefill_tokens"], row["potential_decode_blocks"], row["active_requests"]) == (64, 4, 1)
        # explicit form, as a Ray peer ingress sends it
        r = await svc.create_reservation({
            "selection_id": "e1", "worker_id": 1, "dp_rank": 0,
            "sequence_hashes": SEQ_1_64 + [7], "isl_tokens": 80,
            "expected_output_tokens": 10, "effective_prefill_tokens": 16,
            "model_name": "default", "tenant_id": "default",
        })
        assert r["selection_id"] == "e1" and r["worker_id"] == 1
        row = load_row(svc, 1)
        assert (row["potential_prefill_tokens"], row["potential_decode_blocks"], row["active_requests"]) == (80, 5, 2)
        # explicit with raw tokens and no effective_prefill_tokens books no prefill
        await svc.create_reservation({"selection_id": "e2", "worker_id": 1, "token_ids": TOKENS})
        row = load_row(svc, 1)
        assert (row["potential_prefill_tokens"], row["active_requests"]) == (80, 3)
        for sid in ("c1", "e1", "e2"):
            await svc.free_reservation(sid)
        assert load_row(svc, 1)["active_requests"] == 0


@async_test
async def test_selection_cache_config_limits(impl):
    # A TTL that the reservation of "y" right after its selection fits in,
    # on a loaded machine too.
    cache = impl.SelectionCacheConfig(ttl_secs=1.0, max_entries=2)
    async with service(impl, selection_cache=cache) as svc:
        await svc.upsert_worker(worker(1))
        await wait_loaded(svc, 1)
        for sid in ("x", "y", "z"):
            await svc.select({"token_ids": TOKENS, "selection_id": sid})
        with pytest.raises(impl.SelectionServiceError) as ei:
            await svc.create_reservation({"selection_id": "x"})  # evicted (cap 2)
        assert ei.value.kind == "not_found"
        await svc.create_reservation({"selection_id": "y"})
        await asyncio.sleep(1.5)
        with pytest.raises(impl.SelectionServiceError) as ei:
            await svc.create_reservation({"selection_id": "z"})  # expired (TTL)
        assert ei.value.kind == "not_found"


@async_test
async def test_delete_worker_drops_bookings(impl):
    async with service(impl) as svc:
        await svc.upsert_worker(worker(1))
        await svc.upsert_worker(worker(2))
        await wait_loaded(svc, 2)
        await svc.select_and_reserve({"token_ids": TOKENS, "selection_id": "a", "allowed_worker_ids": [1]})
        rec = await svc.delete_worker(1)
        assert rec["worker_id"] == 1 and rec["lifecycle"] == "unschedulable"
        assert "not_schedulable_reasons" not in rec
        assert [w["worker_id"] for w in svc.list_workers()] == [2]
        await asyncio.sleep(0.05)
        assert load_row(svc, 1) is None
        with pytest.raises(impl.SelectionServiceError) as ei:
            await svc.free_reservation("a")
        assert ei.value.kind == "not_found"


@async_test
async def test_partitions(impl):
    async with service(impl) as svc:
        await svc.upsert_worker(worker(1))
        await svc.upsert_worker(worker(2, model_name="m2", routing_group="g"))
        await wait_loaded(svc, 2)
        r = await svc.select({"token_ids": TOKENS, "model_name": "m2", "routing_group": "g"})
        assert (r["worker_id"], r["model_name"], r["routing_group"]) == (2, "m2", "g")
        await svc.select_and_reserve({"token_ids": TOKENS, "selection_id": "p", "model_name": "m2", "routing_group": "g"})
        assert load_row(svc, 2, model_name="m2")["active_requests"] == 1
        assert load_row(svc, 1)["active_requests"] == 0
        assert [(p["model_name"], p["routing_group"]) for p in svc.loads()] == [("default", "default"), ("m2", "g")]


DYNAMO_KWARGS = {
    "indexer_threads": 4,
    "indexer_peers": None,
    "replica_sync_port": None,
    "replica_sync_peers": None,
    "selection_cache": None,
    "session_affinity_ttl_secs": None,
}


def test_constructor_signature(impl):
    """Dynamo's class has an introspectable signature (``__text_signature__``):
    six keyword-only parameters. kvselect keeps them with the same defaults
    and may add options only as keyword-only parameters with defaults."""
    sig = inspect.signature(impl.SelectionService)
    params = sig.parameters
    for name, default in DYNAMO_KWARGS.items():
        assert name in params, name
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY, name
        assert params[name].default == default, (name, params[name].default)
    extra = {}
    for name, p in params.items():
        if name in DYNAMO_KWARGS or p.kind is inspect.Parameter.VAR_KEYWORD:
            continue
        assert p.kind is inspect.Parameter.KEYWORD_ONLY, name
        assert p.default is not inspect.Parameter.empty, name
        extra[name] = p.default
    if impl.name == "dynamo":
        assert extra == {}
    # every option passed explicitly at its default builds the same service
    svc = impl.SelectionService(**DYNAMO_KWARGS, **extra)
    try:
        assert svc.ready() == {"ready": False, "schedulable_workers": 0, "workers": []}
    finally:
        svc.shutdown()


METHOD_SIGNATURES = {
    # as Dynamo 1.6.1's __text_signature__ gives them (self omitted)
    "upsert_worker": "(worker)",
    "delete_worker": "(worker_id)",
    "overlap_scores": "(request)",
    "select": "(request)",
    "select_and_reserve": "(request)",
    "create_reservation": "(request)",
    "prefill_complete": "(selection_id)",
    "free_reservation": "(selection_id)",
    "potential_loads": "(request)",
    "list_workers": "(*, model_name=None, routing_group=None)",
    "ready": "()",
    "loads": "(*, model_name=None, routing_group=None)",
    "add_output_block": "(selection_id, *, decay_fraction=None)",
    "shutdown": "()",
}


def test_method_and_cache_config_signatures(impl):
    assert str(inspect.signature(impl.SelectionCacheConfig)) == "(*, ttl_secs=None, max_entries=None, max_bytes=None)"
    svc = impl.SelectionService(indexer_threads=1)
    try:
        for name, want in METHOD_SIGNATURES.items():
            assert str(inspect.signature(getattr(svc, name))) == want, name
    finally:
        svc.shutdown()


@async_test
async def test_keyword_arguments_by_name(impl):
    async with service(impl) as svc:
        await svc.upsert_worker(worker=worker(1))
        await wait_loaded(svc, 1)
        await svc.select_and_reserve(request={"token_ids": TOKENS, "selection_id": "k"})
        await svc.prefill_complete(selection_id="k")
        svc.add_output_block(selection_id="k", decay_fraction=None)
        await svc.free_reservation(selection_id="k")
        rec = await svc.delete_worker(worker_id=1)
        assert rec["worker_id"] == 1


@async_test
async def test_routing_constraints_steer_the_choice(impl):
    """`preferred_taints` is a map of taint -> weight, `required_taints` a
    list; both are read exactly as the HTTP body's fields are."""
    async with service(impl) as svc:
        await svc.upsert_worker(worker(1))
        await svc.upsert_worker(worker(2, taints=["fast"]))
        await wait_loaded(svc, 1)
        await wait_loaded(svc, 2)
        prompt = list(range(1, 65))
        for _ in range(8):
            r = await svc.select({"token_ids": prompt, "routing_constraints": {"preferred_taints": {"fast": 5.0}}})
            assert r["worker_id"] == 2, r
            r = await svc.select({"token_ids": prompt, "routing_constraints": {"required_taints": ["fast"]}})
            assert r["worker_id"] == 2, r
        with pytest.raises(ValueError):
            svc.select({"token_ids": prompt, "routing_constraints": {"preferred_taints": [["fast", 5.0]]}})
