"""How each request field converts a Python value, and the message when it
cannot: the prompt through serde, every other field through Python's own
conversions (REFERENCE_NOTES.md, "Conversions"). Every case runs against
both implementations (KVSELECT_TEST_IMPL=dynamo), so each expectation is
the reference's observed behaviour; harness/interop/py_diff.py checks the
same call by call at random."""

from __future__ import annotations

import array
import collections
import collections.abc
import re
import types

import numpy as np
import pytest

from conftest import async_test, service, worker

TOKENS = [1, 2, 3]


def sel(**fields):
    return {"token_ids": TOKENS, **fields}


async def outcome(call):
    """("call", message) for an error at the call, ("await", kind) for a
    SelectionServiceError of the awaitable, ("ok", value) otherwise."""
    try:
        fut = call()
    except ValueError as e:
        return ("call", str(e))
    try:
        return ("ok", await fut)
    except ValueError as e:
        return ("await-value", str(e))
    except Exception as e:  # noqa: BLE001 - SelectionServiceError of either impl
        return ("await", getattr(e, "kind", None))


# Accepted by Python's conversion (an int by __index__, a float by
# __float__, a flag by truth value): with no workers the selection itself
# fails, not the conversion.
ACCEPTED = [
    sel(expected_output_tokens=True),
    sel(expected_output_tokens=np.int64(7)),
    sel(strict_priority=False),
    sel(allowed_worker_ids=[True, np.int64(2)]),
    sel(allowed_worker_ids=(1, 2)),
    sel(pinned_worker={"worker_id": np.int64(1), "dp_rank": False}),
    sel(affinity_target={"worker_id": True, "dp_rank": None}),
    sel(priority_jump=True),
    sel(priority_jump=np.int64(1)),
    sel(advisory="yes"),
    sel(advisory=[]),
    sel(router_config_override={"track_prefill_tokens": "x", "assume_kv_reuse": 1,
                                "overlap_score_credit": True, "router_temperature": 2**64}),
    sel(session_context={"session_id": "s", "session_final": 1.5, "input_trigger": {"tool_result": None}}),
    sel(foo={5: 1}),  # an unknown field's value is never read
    sel(mm_routing_info=None, block_mm_infos=None, lora_name=None),
]


@pytest.mark.parametrize("req", ACCEPTED, ids=range(len(ACCEPTED)))
@async_test
async def test_python_conversions_accept(impl, req):
    async with service(impl) as svc:
        assert await outcome(lambda: svc.select(req)) == ("await", "not_ready")


REFUSED = [
    # ints by __index__: Python's own TypeError and OverflowError texts
    (sel(expected_output_tokens=1.5), "TypeError: 'float' object cannot be interpreted as an integer"),
    (sel(expected_output_tokens=np.float64(1.0)),
     "TypeError: 'numpy.float64' object cannot be interpreted as an integer"),
    (sel(expected_output_tokens=-1), "OverflowError: out of range integral type conversion attempted"),
    (sel(expected_output_tokens=2**64), "OverflowError: Python int too large to convert to C long"),
    (sel(pinned_worker={"worker_id": -1, "dp_rank": 0}), "OverflowError: can't convert negative int to unsigned"),
    (sel(pinned_worker={"worker_id": 2**64, "dp_rank": 0}), "OverflowError: int too big to convert"),
    (sel(pinned_worker={"worker_id": 1, "dp_rank": None}),
     "TypeError: 'NoneType' object cannot be interpreted as an integer"),
    (sel(pinned_worker={"dp_rank": 1.5}), "TypeError: 'float' object cannot be interpreted as an integer"),
    (sel(pinned_worker={"worker_id": True}), "missing field `dp_rank`"),
    (sel(allowed_worker_ids="12"), "TypeError: 'str' object cannot be interpreted as an integer"),
    (sel(allowed_worker_ids=5), "unexpected type: 'int' object cannot be converted to 'Sequence'"),
    # floats by __float__
    (sel(priority_jump="1"), "TypeError: must be real number, not str"),
    (sel(router_config_override={"overlap_score_credit": [1]}), "TypeError: must be real number, not list"),
    (sel(router_config_override={"shared_cache_multiplier": 2}), "shared_cache_multiplier must be between 0 and 1"),
    # present means a value: None is not absent here
    (sel(routing_constraints=None), "unexpected type: 'NoneType' object cannot be converted to 'Mapping'"),
    (sel(routing_constraints={"required_taints": None}),
     "unexpected type: 'NoneType' object cannot be converted to 'Sequence'"),
    (sel(routing_constraints={"preferred_taints": {"t": None}}), "TypeError: must be real number, not NoneType"),
    # dicts read field by field need string keys
    ({**sel(), 5: 1}, "dict keys must have type str"),
    (sel(pinned_worker={"worker_id": 1, "dp_rank": 0, 5: 1}), "dict keys must have type str"),
    (sel(router_config_override={5: 1}), "dict keys must have type str"),
    (sel(session_context={"session_id": "s", 5: 1}), "dict keys must have type str"),
    # enums as serde reads them
    (sel(session_context={"session_id": "s", "input_trigger": 5}), "expected either a str or dict for enum"),
    (sel(session_context={"session_id": "s", "input_trigger": {}}), "expected tagged enum dict to have exactly 1 key"),
    (sel(session_context={"session_id": "s", "input_trigger": "x"}),
     "unknown variant `x`, expected one of `user_message`, `tool_result`, `other`"),
    # the prompt, through serde
    (sel(isl_tokens=-1), "invalid value: integer `-1`, expected usize"),
    (sel(isl_tokens=[1]), "invalid type: sequence, expected usize"),
    (sel(isl_tokens=np.int64(1)), "unsupported type int64"),
    (sel(lora_name=5), "invalid type: integer `5`, expected a string"),
    (sel(cache_salt={}), "invalid type: map, expected a string"),
    (sel(is_eagle=1), "invalid type: integer `1`, expected a boolean"),
    (sel(is_eagle=2**64), "invalid type: integer `18446744073709551616` as u128, expected any value"),
    ({"token_ids": {1: 2}}, "invalid type: map, expected a sequence"),
    ({"token_ids": -(2**63) - 1}, "invalid type: integer `-9223372036854775809` as i128, expected any value"),
    ({"block_hashes": None, "sequence_hashes": {}}, "invalid type: map, expected a sequence"),
    ({"mm_routing_info": {"block_mm_infos": [None]}}, "missing field `routing_token_ids`"),
    ({"mm_routing_info": {"routing_token_ids": [1], "block_mm_infos": None}},
     "invalid type: unit value, expected a sequence"),
    ({"mm_routing_info": []}, "invalid length 0, expected struct MmRoutingInfoRequest with 2 elements"),
    ({"mm_routing_info": {1: 2}}, "invalid type: integer `2`, expected a sequence"),  # key 1 is field 1
    (sel(block_mm_infos=[{}]), "missing field `mm_objects`"),
    (sel(block_mm_infos=[[]]), "invalid length 0, expected struct BlockExtraInfo with 1 element"),
    (sel(block_mm_infos=[{"mm_objects": [{"mm_hash": 1}]}]), "missing field `offsets`"),
    (sel(block_mm_infos=[{"mm_objects": [[None]]}]), "invalid type: unit value, expected u64"),
    (sel(block_mm_infos=[{"mm_objects": [[1]]}]), "invalid length 1, expected struct BlockMmObjectInfo with 2 elements"),
    (sel(block_mm_infos=[{"mm_objects": [{"mm_hash": 1, "offsets": [[1, 2, 3]]}]}]),
     "invalid length 3, expected 2 elements in sequence"),
    (sel(block_mm_infos=[{"mm_objects": [{"mm_hash": 1, "offsets": [5]}]}]),
     "invalid type: integer `5`, expected a tuple of size 2"),
    # the other fields are read first, in the dict's order, then the prompt
    ({"token_ids": "x", "expected_output_tokens": "x"},
     "TypeError: 'str' object cannot be interpreted as an integer"),
    ({"expected_output_tokens": "x", "model_name": 5},
     "TypeError: 'str' object cannot be interpreted as an integer"),
    (sel(pinned_worker={"dp_rank": 1.5, "worker_id": "x"}),
     "TypeError: 'float' object cannot be interpreted as an integer"),
]


@pytest.mark.parametrize("req,text", REFUSED, ids=range(len(REFUSED)))
@async_test
async def test_conversions_refuse_with_the_reference_text(impl, req, text):
    async with service(impl) as svc:
        assert await outcome(lambda: svc.select(req)) == ("call", text)


@async_test
async def test_reservation_and_query_conversions(impl):
    async with service(impl) as svc:
        # dp_rank by __index__: False is rank 0 (the worker is unknown, so the
        # booking itself fails)
        got = await outcome(lambda: svc.create_reservation(
            {"selection_id": "r", "worker_id": 1, "dp_rank": False, "token_ids": TOKENS,
             "effective_prefill_tokens": True, "track_prefill_tokens": "x"}))
        assert got == ("await", "not_ready")
        assert await outcome(lambda: svc.create_reservation({"selection_id": "r", 5: 1})) == (
            "call", "dict keys must have type str")
        assert await outcome(lambda: svc.create_reservation(
            {"selection_id": "r", "effective_prefill_tokens": 1.5})) == (
            "call", "TypeError: 'float' object cannot be interpreted as an integer")
        assert await outcome(lambda: svc.overlap_scores({"model_name": "m", "token_ids": {1: 2}})) == (
            "call", "invalid type: map, expected a sequence")
        # The missing id is found after the buffering and before the prompt's types.
        assert await outcome(lambda: svc.create_reservation({"token_ids": "x"})) == (
            "call", "missing field `selection_id`")
        assert await outcome(lambda: svc.create_reservation({"token_ids": [1], "foo": np.int64(1)})) == (
            "call", "unsupported type int64")


@async_test
async def test_worker_dict_conversions(impl):
    async with service(impl) as svc:
        rec = await svc.upsert_worker(worker(False, block_size=True, is_eagle="x",
                                             kv_transfer_preferred_weight=True,
                                             kv_transfer_enforcement={"preferred": None}))
        assert (rec["worker_id"], rec["block_size"], rec["is_eagle"]) == (0, 1, True)
        assert rec["kv_transfer_enforcement"] == "preferred"
        assert await outcome(lambda: svc.upsert_worker({"worker_id": 9, 5: 1})) == (
            "call", "dict keys must have type str")
        assert await outcome(lambda: svc.upsert_worker({"worker_id": 9, "taints": None})) == (
            "call", "unexpected type: 'NoneType' object cannot be converted to 'Sequence'")
        assert await outcome(lambda: svc.upsert_worker(
            {"worker_id": 9, "kv_transfer_preferred_weight": "x"})) == (
            "call", "TypeError: must be real number, not str")
        assert await outcome(lambda: svc.upsert_worker({"worker_id": 9, "kv_transfer_enforcement": 5})) == (
            "call", "expected either a str or dict for enum")
        assert await outcome(lambda: svc.upsert_worker({"worker_id": 9, "kv_transfer_enforcement": {1: 2}})) == (
            "call", "dict keys must have type str")
        # A patch leaves worker_id, model_name and routing_group alone,
        # whatever they hold, and `taints: None` too.
        rec = await svc.patch_worker(0, {"worker_id": [1.5], "model_name": 5, "taints": None,
                                         "total_kv_blocks": 100})
        assert (rec["worker_id"], rec["model_name"], rec["total_kv_blocks"]) == (0, "default", 100)
        rec = await svc.patch_worker(worker_id=0, patch={"block_size": np.int64(16)})
        assert rec["block_size"] == 16
        assert await outcome(lambda: svc.patch_worker(0, {"block_size": "x"})) == (
            "call", "TypeError: 'str' object cannot be interpreted as an integer")


@async_test
async def test_plain_argument_errors_name_the_argument(impl):
    async with service(impl) as svc:
        for call in (svc.prefill_complete, svc.free_reservation, svc.add_output_block):
            with pytest.raises(TypeError) as ei:
                call(5)
            assert str(ei.value) == "argument 'selection_id': 'int' object cannot be converted to 'PyString'"
        with pytest.raises(TypeError) as ei:
            svc.delete_worker(1.5)
        assert str(ei.value) == "argument 'worker_id': 'float' object cannot be interpreted as an integer"
        with pytest.raises(OverflowError) as ei:
            svc.delete_worker(-1)
        assert str(ei.value) == "can't convert negative int to unsigned"


@async_test
async def test_pinned_worker_outside_the_allowed_set_is_the_schedulers_error(impl):
    async with service(impl) as svc:
        await svc.upsert_worker(worker(1))
        await svc.upsert_worker(worker(2))
        with pytest.raises(impl.SelectionServiceError) as ei:
            await svc.select(sel(pinned_worker={"worker_id": 2, "dp_rank": 0}, allowed_worker_ids=[1]))
        assert str(ei.value) == "pinned worker 2 is not in allowed worker set"
        assert (ei.value.kind, ei.value.status_code) == ("scheduler", 400)


BUFFERED = [
    # serde buffers the prompt and unknown fields first: an int beyond 64
    # bits or a type it has no word for wins over any type error
    (sel(foo=2**64), "invalid type: integer `18446744073709551616` as u128, expected any value"),
    (sel(foo={"a": np.int64(1)}), "unsupported type int64"),
    (sel(foo={1, 2**64}), "invalid type: integer `18446744073709551616` as u128, expected any value"),
    ({"token_ids": "x", "lora_name": -(2**64)},
     "invalid type: integer `-18446744073709551616` as i128, expected any value"),
    ({"token_ids": [1, "x", 2**64]}, "invalid type: integer `18446744073709551616` as u128, expected any value"),
    ({"token_ids": [1, "x", np.int64(3)]}, "unsupported type int64"),
    (sel(block_mm_infos=[{"mm_objects": [], "x": 2**64}]),
     "invalid type: integer `18446744073709551616` as u128, expected any value"),
    (sel(block_mm_infos=[{"mm_objects": [{"mm_hash": 1, "offsets": [[0, 3, 2**64]]}]}]),
     "invalid type: integer `18446744073709551616` as u128, expected any value"),
]


@pytest.mark.parametrize("req,text", BUFFERED, ids=range(len(BUFFERED)))
@async_test
async def test_values_serde_cannot_buffer_are_refused_first(impl, req, text):
    async with service(impl) as svc:
        where, msg = await outcome(lambda: svc.select(req))
        # kvselect names a bad token's index (README)
        assert (where, re.sub(r"^token_ids\[\d+\]: ", "", msg)) == ("call", text)
    # Values the conversions read themselves are not buffered.
    async with service(impl) as svc:
        assert await outcome(lambda: svc.select(sel(expected_output_tokens=np.int64(1), foo={1, 2}))) == (
            "await", "not_ready")


class Mapping(collections.abc.Mapping):
    """A mapping that is not a dict."""

    def __init__(self, d):
        self.d = d

    def __getitem__(self, k):
        return self.d[k]

    def __iter__(self):
        return iter(self.d)

    def __len__(self):
        return len(self.d)


class NoValues(Mapping):
    def values(self):
        raise TypeError("no values")


class Sequence(collections.abc.Sequence):
    """A sequence that is not a list or tuple."""

    def __init__(self, items):
        self.items = items

    def __getitem__(self, i):
        return self.items[i]

    def __len__(self):
        return len(self.items)


class MappingSequence(Mapping):
    """A mapping that is also a registered Sequence: read as a mapping where
    a struct is expected and by index (its items, not its keys) where a
    sequence is."""

    def __init__(self, d, items):
        super().__init__(d)
        self.items = items

    def __getitem__(self, k):
        return self.items[k] if isinstance(k, int) else self.d[k]


collections.abc.Sequence.register(MappingSequence)


class BadItem(Sequence):
    def __getitem__(self, i):
        raise KeyError("nope")


def mm_object(**fields):
    return sel(block_mm_infos=[{"mm_objects": [fields]}])


# Any collections.abc.Mapping reads as a dict, any Sequence (range, deque,
# array, user classes) and any set as a list, strings from bytes when UTF-8.
MAPPINGS_AND_SEQUENCES_ACCEPTED = [
    Mapping(sel()),
    types.MappingProxyType(sel()),
    sel(pinned_worker=Mapping({"worker_id": 1, "dp_rank": 0})),
    sel(session_context=Mapping({"session_id": "s",
                                 "input_trigger": Mapping({"tool_result": None})})),
    sel(router_config_override=Mapping({"assume_kv_reuse": False})),
    sel(block_mm_infos=[Mapping({"mm_objects": []})]),
    {"token_ids": [1], "mm_routing_info": Mapping({0: [1], 1: []})},
    sel(foo=Mapping({"a": 1})),
    sel(foo=collections.deque([1])),
    sel(foo=array.array("I", [1])),
    sel(foo=memoryview(b"ab")),
    {"block_hashes": Sequence([1]), "sequence_hashes": array.array("q", [2]), "isl_tokens": 3},
    {"block_hashes": {1}, "sequence_hashes": [2], "isl_tokens": 3},
    sel(block_mm_infos=Sequence([Sequence([[]])])),
    mm_object(mm_hash=1, offsets=[range(2), Sequence([0, 1])]),
    sel(lora_name=b"adapter", cache_salt=b"salt"),
    # keys of a struct's mapping: another name or an index past the fields is skipped
    sel(block_mm_infos=[{"mm_objects": [], 5: 1, b"x": 2}]),
    sel(block_mm_infos=[{b"mm_objects": []}]),
    # a mapping that is also a Sequence: a sequence's items by index
    sel(token_ids=MappingSequence({"a": 1}, TOKENS)),
    sel(allowed_worker_ids=MappingSequence({"a": 1}, [1])),
    sel(routing_constraints={"required_taints": MappingSequence({1: 2}, ["t"])}),
    sel(pinned_worker=MappingSequence({"worker_id": 1, "dp_rank": 0}, [2, 3])),
    {"block_hashes": MappingSequence({"a": 1}, [1]), "sequence_hashes": [2], "isl_tokens": 3},
]


@pytest.mark.parametrize("req", MAPPINGS_AND_SEQUENCES_ACCEPTED,
                         ids=range(len(MAPPINGS_AND_SEQUENCES_ACCEPTED)))
@async_test
async def test_mappings_and_sequences_of_any_type_accept(impl, req):
    async with service(impl) as svc:
        assert await outcome(lambda: svc.select(req)) == ("await", "not_ready")


MAPPINGS_AND_SEQUENCES_REFUSED = [
    (Mapping({"token_ids": [1], 5: 1}), "dict keys must have type str"),
    (Mapping({"expected_output_tokens": "x", "model_name": 5}),
     "TypeError: 'str' object cannot be interpreted as an integer"),
    (NoValues(sel()), "TypeError: no values"),
    (sel(session_context=NoValues({"session_id": "s"})), "TypeError: no values"),
    (sel(token_ids=Mapping({0: 1})), "invalid type: map, expected a sequence"),
    (sel(cache_salt=Mapping({})), "invalid type: map, expected a string"),
    (sel(foo=Mapping({"a": 2**64})), "invalid type: integer `18446744073709551616` as u128, expected any value"),
    (sel(foo=Sequence([1, 2**64])), "invalid type: integer `18446744073709551616` as u128, expected any value"),
    (sel(foo=BadItem([1])), "KeyError: 'nope'"),
    (sel(lora_name=Sequence([1])), "invalid type: sequence, expected a string"),
    (sel(lora_name=b"\xff"), "invalid value: byte array, expected a string"),
    # a struct in list form with elements past its fields, once they read
    (sel(block_mm_infos=[[[], 5]]), "invalid length 2, expected 1 element in sequence"),
    ({"token_ids": [1], "mm_routing_info": [[1, 2], [], 5]}, "invalid length 3, expected 2 elements in sequence"),
    (sel(block_mm_infos=[{"mm_objects": [Sequence([None, [], 7])]}]), "invalid type: unit value, expected u64"),
    # a struct's mapping is read in its order; keys name or number the fields
    (mm_object(offsets=[5], mm_hash=None), "invalid type: integer `5`, expected a tuple of size 2"),
    (mm_object(mm_hash=None, offsets=[5]), "invalid type: unit value, expected u64"),
    (mm_object(offsets=[5]), "invalid type: integer `5`, expected a tuple of size 2"),
    ({"token_ids": [1], "mm_routing_info": {"block_mm_infos": 5, "routing_token_ids": "x"}},
     "invalid type: integer `5`, expected a sequence"),
    (sel(block_mm_infos=[{"mm_objects": [], 0: []}]), "duplicate field `mm_objects`"),
    (sel(block_mm_infos=[{"mm_objects": [], 1.5: 1}]), "invalid type: floating point `1.5`, expected field identifier"),
    (sel(block_mm_infos=[{"mm_objects": [], -1: 1}]), "invalid type: integer `-1`, expected field identifier"),
    (sel(block_mm_infos=[{"mm_objects": [], True: 1}]), "invalid type: boolean `true`, expected field identifier"),
    (sel(block_mm_infos=[{"mm_objects": [], None: 1}]), "invalid type: unit value, expected field identifier"),
    (sel(block_mm_infos=[{"mm_objects": [], (1,): 1}]), "invalid type: sequence, expected field identifier"),
    # an enum's one-key mapping needs a string key
    (sel(session_context={"session_id": "s", "input_trigger": {1: 2}}), "dict keys must have type str"),
    (sel(session_context={"session_id": "s", "input_trigger": Mapping({b"other": None})}),
     "dict keys must have type str"),
]


@pytest.mark.parametrize("req,text", MAPPINGS_AND_SEQUENCES_REFUSED,
                         ids=range(len(MAPPINGS_AND_SEQUENCES_REFUSED)))
@async_test
async def test_mappings_and_sequences_refuse_with_the_reference_text(impl, req, text):
    async with service(impl) as svc:
        assert await outcome(lambda: svc.select(req)) == ("call", text)
