"""Token input forms. ``list[int]`` is the Dynamo form; kvselect also takes
``array.array('I')``, a numpy ``uint32`` array and ``bytes``/``memoryview``
of little-endian u32, with results identical to the list. A bad token raises
``ValueError`` synchronously; kvselect's message names the token's index."""

from __future__ import annotations

import array
import re
import sys

import pytest

from conftest import SEQ_1_64, async_test, service, wait_loaded, worker

TOKENS = list(range(1, 65))


def forms(tokens):
    np = pytest.importorskip("numpy")
    le = array.array("I", tokens)
    if sys.byteorder != "little":
        le.byteswap()
    raw = le.tobytes()
    return {
        "list": list(tokens),
        "array_I": array.array("I", tokens),
        "numpy_uint32": np.asarray(tokens, dtype=np.uint32),
        "bytes": raw,
        "memoryview": memoryview(raw),
        "bytearray_memoryview": memoryview(bytearray(raw)),
    }


def test_sequence_forms_common_to_both(impl):
    """Forms Dynamo already takes, read as sequences of ints: list, tuple,
    range, array('I') and a memoryview whose items are u32 (format 'I')."""
    le = array.array("I", TOKENS)
    common = [list(TOKENS), tuple(TOKENS), range(1, 65), le, memoryview(le)]

    async def body():
        async with service(impl) as svc:
            await svc.upsert_worker(worker(1))
            await wait_loaded(svc, 1)
            for i, f in enumerate(common):
                r = await svc.select_and_reserve({"token_ids": f, "selection_id": f"f{i}"})
                assert r["sequence_hashes"] == SEQ_1_64 and r["isl_tokens"] == 64, type(f)

    import asyncio

    asyncio.run(body())


@pytest.mark.kvselect_only
@pytest.mark.parametrize("form", ["array_I", "numpy_uint32", "bytes", "memoryview", "bytearray_memoryview"])
@async_test
async def test_token_forms_match_list(impl, form):
    toks = list(range(1, 71)) + [2**32 - 1] * 3  # partial tail, max u32
    f = forms(toks)[form]
    async with service(impl) as svc:
        await svc.upsert_worker(worker(1))
        await wait_loaded(svc, 1)
        want = await svc.select_and_reserve({"token_ids": toks, "selection_id": "ref"})
        got = await svc.select_and_reserve({"token_ids": f, "selection_id": "form"})
        assert got["sequence_hashes"] == want["sequence_hashes"]
        assert got["sequence_hashes"][:4] == SEQ_1_64
        assert got["isl_tokens"] == len(toks) == want["isl_tokens"]
        assert got["effective_prefill_tokens"] == want["effective_prefill_tokens"]
        for method in ("select", "overlap_scores", "potential_loads"):
            a = await getattr(svc, method)({"token_ids": toks})
            b = await getattr(svc, method)({"token_ids": f})
            assert a == b, method
        r = await svc.create_reservation({"selection_id": "ex", "worker_id": 1, "token_ids": f})
        assert r["worker_id"] == 1
        # the caller's buffer is not modified or retained
        if form == "numpy_uint32":
            assert f.tolist() == toks


@pytest.mark.kvselect_only
@async_test
async def test_empty_and_strided_forms(impl):
    np = pytest.importorskip("numpy")
    async with service(impl) as svc:
        await svc.upsert_worker(worker(1))
        await wait_loaded(svc, 1)
        for empty in (np.zeros(0, dtype=np.uint32), b"", array.array("I")):
            r = await svc.select({"token_ids": empty})
            assert r["effective_prefill_tokens"] == 0 and r["potential_decode_blocks"] == 0
        # a non-contiguous view gives the same answer as its contents
        base = np.arange(0, 256, dtype=np.uint32)
        view = base[1:129:2]
        r1 = await svc.select_and_reserve({"token_ids": view})
        r2 = await svc.select_and_reserve({"token_ids": view.tolist()})
        assert r1["sequence_hashes"] == r2["sequence_hashes"] and r1["isl_tokens"] == 64


@pytest.mark.kvselect_only
@async_test
async def test_bytes_length_must_be_multiple_of_four(impl):
    async with service(impl) as svc:
        for bad in (b"\x01\x00\x00", memoryview(b"\x01\x00\x00\x00\x02")):
            with pytest.raises(ValueError):
                svc.select({"token_ids": bad})


def _names_index(msg: str, index: int) -> bool:
    return re.search(rf"(?<!\d){index}(?!\d)", msg) is not None


@pytest.mark.kvselect_only
@pytest.mark.parametrize("bad", [-1, 2**32, 2**64, 1.5, "x", None, True])
@async_test
async def test_bad_token_message_names_index(impl, bad):
    async with service(impl) as svc:
        toks = [1] * 9
        toks[5] = bad
        msgs = []
        for method in ("select", "select_and_reserve", "overlap_scores", "potential_loads"):
            with pytest.raises(ValueError) as ei:
                getattr(svc, method)({"token_ids": toks})  # synchronous: nothing awaited
            msgs.append(str(ei.value))
        for m in msgs:
            assert _names_index(m, 5), m
        toks2 = [1] * 9
        toks2[8] = bad
        with pytest.raises(ValueError) as ei:
            svc.select({"token_ids": toks2})
        assert _names_index(str(ei.value), 8), str(ei.value)


@pytest.mark.kvselect_only
@async_test
async def test_bad_numpy_dtype_or_shape(impl):
    np = pytest.importorskip("numpy")
    async with service(impl) as svc:
        # a negative value in a signed array is never accepted (whether the
        # dtype itself is refused or the element is)
        with pytest.raises(ValueError):
            svc.select({"token_ids": np.array([1, 2, -3], dtype=np.int64)})
        with pytest.raises(ValueError):
            svc.select({"token_ids": np.array([1.0, 2.5], dtype=np.float64)})
        with pytest.raises(ValueError):
            svc.select({"token_ids": np.ones((2, 16), dtype=np.uint32)})


class _Int(int):
    pass


def test_items_read_by_value_in_both(impl):
    """Int subclasses in a list (an ``IntEnum``, a user subclass) and an
    ``array('B')`` are read item by item, by value: one token per item, as
    Dynamo reads them (kvselect rejected the subclasses and read the
    ``array('B')`` as raw little-endian u32 bytes)."""
    import asyncio
    import enum

    E = enum.IntEnum("E", {f"T{t}": t for t in TOKENS})
    forms = {
        "int subclass": [_Int(t) for t in TOKENS],
        "IntEnum": [E(t) for t in TOKENS],
        "mixed": [TOKENS[0]] + [_Int(t) for t in TOKENS[1:3]] + TOKENS[3:],
        "array_B": array.array("B", TOKENS),
    }

    async def body():
        async with service(impl) as svc:
            await svc.upsert_worker(worker(1))
            await wait_loaded(svc, 1)
            for i, (name, f) in enumerate(forms.items()):
                r = await svc.select_and_reserve({"token_ids": f, "selection_id": f"v{i}"})
                assert r["sequence_hashes"] == SEQ_1_64 and r["isl_tokens"] == 64, name
            with pytest.raises(ValueError, match=r"invalid value: integer `-1`, expected u32"):
                svc.select({"token_ids": [1, _Int(-1)]})

    asyncio.run(body())


@pytest.mark.kvselect_only
@async_test
async def test_numpy_arrays_are_read_by_value_whatever_their_byte_order_or_width(impl):
    """A numpy ``uint8`` array holds one token per item, and a big-endian
    ``>u4`` array holds values, not bytes to read little-endian (both were
    read as raw bytes, giving other tokens without an error)."""
    np = pytest.importorskip("numpy")
    async with service(impl) as svc:
        await svc.upsert_worker(worker(1))
        await wait_loaded(svc, 1)
        for i, f in enumerate([
            np.arange(1, 65, dtype=np.uint8),
            np.arange(1, 65, dtype=">u4"),
            np.arange(1, 65, dtype="<u4"),
            np.repeat(np.arange(1, 65, dtype=">u4"), 2)[::2],  # strided
        ]):
            r = await svc.select_and_reserve({"token_ids": f, "selection_id": f"np{i}"})
            assert r["sequence_hashes"] == SEQ_1_64 and r["isl_tokens"] == 64, f.dtype
