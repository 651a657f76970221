"""A worker fed by a real ZeroMQ publisher: BlockStored / BlockRemoved /
AllBlocksCleared batches on the vLLM wire (spec kv-events.md: frames
``[topic, seq u64 BE, msgpack payload]``, payload ``[ts, [event...], dp_rank]``)
give the exact overlap in ``overlap_scores`` and ``select``."""

from __future__ import annotations

import asyncio
import struct
import time

import pytest

from conftest import async_test, service, wait_for, wait_loaded, worker

zmq = pytest.importorskip("zmq", reason="pyzmq is needed to publish KV events")
msgpack = pytest.importorskip("msgpack", reason="msgpack is needed to encode KV events")

BS = 16
PROMPT = list(range(1000, 1000 + 5 * BS + 7))  # 5 full blocks + a partial one
STORED = 4  # blocks the worker caches
ENGINE_HASHES = [(0xA5A5_0000_0000_0000 + i) for i in range(STORED)]  # opaque, > 2**63


class Publisher:
    """A vLLM-style KV-event publisher bound on a free loopback port. It is
    an XPUB (a PUB that also reports subscriptions), so that each batch can be
    sent exactly once after the selector's SUB has joined: a re-sent batch
    would be a repeated sequence number, which kvselect reads as an engine
    restart (it clears the rank) and Dynamo ignores."""

    def __init__(self, topic: bytes = b""):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.XPUB)
        self.subscribed = False
        self.sock.setsockopt(zmq.LINGER, 0)
        # A port the OS picks: no port is chosen before it is bound.
        self.sock.bind("tcp://127.0.0.1:*")
        self.endpoint = self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.topic = topic

    def wait_subscriber(self, timeout: float) -> None:
        if not self.subscribed and self.sock.poll(int(timeout * 1000)):
            self.sock.recv()
            self.subscribed = True
        assert self.subscribed, "the selector never subscribed"

    def send(self, seq: int, events, dp_rank=0):
        payload = msgpack.packb([time.time(), events, dp_rank], use_bin_type=True)
        self.sock.send_multipart([self.topic, struct.pack(">Q", seq), payload])

    def close(self):
        self.sock.close(0)
        self.ctx.term()


def device_blocks(o, worker_id):
    for row in o["workers"]:
        if row["worker_id"] == worker_id and row["dp_rank"] == 0:
            return row["device_blocks"]
    return None


async def publish_until(svc, pub, seq, events, pred, timeout=10.0):
    """Send batch ``seq`` once the selector's SUB has joined (it connects
    lazily and misses what was published before), then wait until the
    service reflects it."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    await loop.run_in_executor(None, pub.wait_subscriber, timeout)
    pub.send(seq, events)
    while True:
        o = await svc.overlap_scores({"token_ids": PROMPT})
        if pred(o) or loop.time() >= deadline:
            return o
        await asyncio.sleep(0.05)


@async_test
async def test_zmq_block_stored_gives_exact_overlap(impl):
    pub = Publisher()
    try:
        async with service(impl) as svc:
            rec = await svc.upsert_worker(worker(7, endpoint=pub.endpoint))
            assert rec["lifecycle"] == "schedulable"
            await svc.upsert_worker(worker(8))  # no publisher: never any overlap
            await wait_loaded(svc, 8)
            o = await svc.overlap_scores({"token_ids": PROMPT})
            assert device_blocks(o, 7) == 0 and device_blocks(o, 8) == 0

            # positional (vLLM <= 0.23) BlockStored of the first 4 blocks, one batch
            stored = ["BlockStored", ENGINE_HASHES, None, PROMPT[: STORED * BS], BS, None, "GPU", None, None]
            o = await publish_until(svc, pub, 0, [stored], lambda o: device_blocks(o, 7))
            assert o["num_blocks"] == 5
            row = next(r for r in o["workers"] if r["worker_id"] == 7)
            assert row["device_blocks"] == STORED
            assert row["host_pinned_blocks"] == STORED and row["disk_blocks"] == STORED
            assert row["host_pinned_extension_blocks"] == 0 and row["disk_extension_blocks"] == 0
            assert device_blocks(o, 8) == 0

            r = await svc.select({"token_ids": PROMPT})
            assert r["worker_id"] == 7
            assert r["overlap"] == {"longest_matched": STORED * BS, "gpu": STORED * BS,
                                    "dp": {"0": STORED * BS}, "cpu": STORED * BS, "disk": STORED * BS}
            assert r["effective_prefill_tokens"] == len(PROMPT) - STORED * BS
            r = await svc.select_and_reserve({"token_ids": PROMPT, "selection_id": "hit"})
            assert r["worker_id"] == 7 and r["overlap"]["longest_matched"] == STORED * BS
            await svc.free_reservation("hit")
            # a prompt sharing only the first block matches only that block
            other = PROMPT[:BS] + [7] * (3 * BS)
            o2 = await svc.overlap_scores({"token_ids": other})
            assert device_blocks(o2, 7) == 1

            # tagged-map (vLLM >= 0.24) BlockRemoved of the last stored block
            removed = {"type": "BlockRemoved", "block_hashes": [ENGINE_HASHES[-1]], "medium": "GPU"}
            pub.send(1, [removed])
            o = await wait_for(lambda: _overlap_is(svc, 7, STORED - 1))
            assert o, "BlockRemoved was not applied"

            pub.send(2, [{"type": "AllBlocksCleared"}])
            o = await wait_for(lambda: _overlap_is(svc, 7, 0))
            assert o, "AllBlocksCleared was not applied"
    finally:
        pub.close()


@async_test
async def test_zero_indexer_threads_still_index(impl):
    # The reference takes indexer_threads=0 and indexes; kvselect runs one thread.
    pub = Publisher()
    try:
        async with service(impl, indexer_threads=0) as svc:
            await svc.upsert_worker(worker(7, endpoint=pub.endpoint))
            stored = ["BlockStored", ENGINE_HASHES, None, PROMPT[: STORED * BS], BS, None, "GPU", None, None]
            o = await publish_until(svc, pub, 0, [stored], lambda o: device_blocks(o, 7))
            assert device_blocks(o, 7) == STORED
    finally:
        pub.close()


async def _overlap_is(svc, worker_id, n):
    o = await svc.overlap_scores({"token_ids": PROMPT})
    return o if device_blocks(o, worker_id) == n else None


@async_test
async def test_zmq_host_tier_and_topic(impl):
    """A CPU-medium store counts as host-pinned (not device); a non-empty
    topic is received (the subscriber takes every topic)."""
    pub = Publisher(topic=b"kv-events")
    try:
        async with service(impl) as svc:
            await svc.upsert_worker(worker(9, endpoint=pub.endpoint))
            await wait_loaded(svc, 9)
            stored = {"type": "BlockStored", "block_hashes": ENGINE_HASHES[:2], "parent_block_hash": None,
                      "token_ids": PROMPT[: 2 * BS], "block_size": BS, "lora_id": None, "medium": "CPU",
                      "lora_name": None, "extra_keys": [None, None], "group_idx": 0,
                      "kv_cache_spec_kind": "full_attention"}

            def host(o):
                row = next((r for r in o["workers"] if r["worker_id"] == 9), None)
                return row and row["host_pinned_blocks"] == 2

            o = await publish_until(svc, pub, 0, [stored], host)
            row = next(r for r in o["workers"] if r["worker_id"] == 9)
            assert (row["device_blocks"], row["host_pinned_blocks"], row["host_pinned_extension_blocks"]) == (0, 2, 2)
            r = await svc.select({"token_ids": PROMPT})
            assert r["overlap"]["gpu"] == 0 and r["overlap"]["cpu"] == 2 * BS
            assert r["overlap"]["longest_matched"] == 2 * BS
            # cached = round(0.75 * 2 blocks * 16) = 24 tokens
            assert r["effective_prefill_tokens"] == len(PROMPT) - 24
    finally:
        pub.close()
