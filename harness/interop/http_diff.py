"""kvselect's HTTP API against Dynamo 1.6.1's, request by request.

    python3 harness/interop/http_diff.py [--requests N] [--seed S] [--bin B] [--dynamo-python P]

Starts kvselect (default target/release/kvselect) and the reference
(`/opt/dynamo-venv/bin/python -m dynamo.select_service`) on loopback, feeds
both the same KV events from three mock engines (ZeroMQ PUB sockets both
servers subscribe to), then sends every request of a seeded random corpus to
both, in the same order: valid calls on every route, and the same calls
broken (fields dropped, retyped, out of range, duplicated; bodies truncated,
not objects, not JSON; Content-Type missing or wrong; unknown ids, routes
and methods). Each pair of answers must agree on the status, the content
type and the JSON body, up to the differences the README lists
("Switching from Dynamo"), which are counted apart. Every 25 requests the
two servers' `/loads`, `/workers` and `/ready` must agree too, so a request
that corrupts state shows up.

The reference breaks exact cost ties at random, so when the two pick
different workers the script frees the booking on both (if it booked) and
recomputes every candidate's cost (spec 7.3) from kvselect's own
`/overlap_scores`, `/potential_loads` and `/loads`: a split between
candidates of equal cost is a tie, anything else a mismatch.

Needs pyzmq and msgpack. The engines bind ports the OS picks; each server
starts on a free port and, if that port was taken before it bound (another
run's connection, say), starts again on another. Exits 1 on any mismatch,
printing each.
"""
import argparse
import os
import http.client
import json
import random
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse

import msgpack
import zmq

# The engines' ports, set when `engines` binds them.
ENGINE_PORTS = {1: 0, 2: 0, 3: 0}
BS = 16
# Two prompts the engines cache: worker 1 holds A's first 8 blocks on the
# GPU, worker 2 its first 4, worker 3 B's first 2 on the GPU and first 6 on
# the CPU. Workers 1 and 2 name A's blocks with the same engine hashes, as
# engines with one hash seed do: under different ones the reference reports
# one worker's overlap from the other's blocks (README, "Switching from
# Dynamo"). Workers 1 and 2 speak vLLM's wire, worker 3 SGLang's (signed
# hashes, no medium for the GPU, `CPU_PINNED`, no rank in the batch).
PROMPT_A = [(i * 7919) % 50000 + 1 for i in range(200)]
PROMPT_B = [(i * 104729) % 60000 + 3 for i in range(200)]

BYTE_SUFFIX = re.compile(r" \(byte \d+\)")


class Server:
    """One keep-alive HTTP/1.1 connection to a server, reopened on close."""

    def __init__(self, name, port):
        self.name, self.port, self.conn = name, port, None

    def call(self, method, path, body=None, ctype="application/json"):
        for attempt in range(2):
            if self.conn is None:
                self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
            headers = {}
            if ctype is not None:
                headers["Content-Type"] = ctype
            try:
                self.conn.request(method, path, body=body, headers=headers)
                r = self.conn.getresponse()
                data = r.read()
                if r.getheader("connection", "").lower() == "close":
                    self.conn.close()
                    self.conn = None
                return r.status, (r.getheader("content-type") or ""), data
            except (http.client.HTTPException, OSError):
                self.conn.close()
                self.conn = None
                if attempt:
                    raise
        raise AssertionError("unreachable")


def jbody(data):
    try:
        return json.loads(data)
    except ValueError:
        return data.decode("latin-1")


# ---------------------------------------------------------------- the corpus

WRONG = [None, True, False, 0, -1, 1.5, 2e3, "x", "", [], {}, [1], {"a": 1},
         4294967296, 18446744073709551615, 18446744073709551616, -9223372036854775809]


class Corpus:
    """Seeded request bodies: a valid call, then maybe broken."""

    def __init__(self, rng):
        self.rng = rng
        self.next_id = 0
        self.booked = []  # selection ids that may be live

    def pick(self, xs):
        return xs[self.rng.randrange(len(xs))]

    def new_id(self):
        self.next_id += 1
        return f"s{self.next_id}"

    def some_id(self):
        r = self.rng.random()
        if self.booked and r < 0.7:
            return self.pick(self.booked)
        return self.pick(["nope", "s0", "", "x%20y", "%41", self.new_id()])

    def tokens(self):
        r = self.rng.random()
        if r < 0.35:
            return PROMPT_A[: self.rng.randrange(0, 200)]
        if r < 0.6:
            return PROMPT_B[: self.rng.randrange(0, 200)]
        if r < 0.7:
            return PROMPT_A[:64] + PROMPT_B[: self.rng.randrange(0, 64)]
        return [self.rng.randrange(0, 200000) for _ in range(self.rng.randrange(0, 100))]

    def prompt(self, body):
        r = self.rng.random()
        if r < 0.8:
            body["token_ids"] = self.tokens()
        elif r < 0.9:
            n = self.rng.randrange(0, 5)
            body["block_hashes"] = [self.rng.randrange(-2**63, 2**63) for _ in range(n)]
            body["sequence_hashes"] = [self.rng.randrange(-2**63, 2**63)
                                       for _ in range(self.pick([n, n, n + 1]))]
            body["isl_tokens"] = self.pick([0, 1, n * BS, n * BS + 3])
        else:
            body["mm_routing_info"] = {
                "routing_token_ids": self.tokens()[:48],
                "block_mm_infos": [None, {"mm_objects": [{"mm_hash": 7, "offsets": [[0, 3]]}]}],
            }
        for k, vals in [("lora_name", ["", "l1"]), ("cache_salt", ["", "salt"]),
                        ("is_eagle", [True, False])]:
            if self.rng.random() < 0.1:
                body[k] = self.pick(vals)
        return body

    def select_body(self, booking):
        b = {}
        if self.rng.random() < 0.93:
            b["model_name"] = self.pick(["m", "m", "m", "m", "w", "nomodel"])
        if self.rng.random() < 0.05:
            b["routing_group"] = self.pick(["default", "g2"])
        if booking or self.rng.random() < 0.2:
            if self.rng.random() < 0.9:
                sid = self.new_id() if self.rng.random() < 0.9 else self.some_id()
                # No route frees a booking under the empty id (both servers
                # answer DELETE /reservations/ with 404), so a split tie under
                # it could never be undone: selections take a nonempty id.
                b["selection_id"] = sid or self.new_id()
        self.prompt(b)
        opt = self.rng.random
        if opt() < 0.1:
            b["expected_output_tokens"] = self.rng.randrange(0, 500)
        if opt() < 0.1:
            b["allowed_worker_ids"] = self.rng.sample([1, 2, 3, 10, 11, 99], self.rng.randrange(0, 3))
        if opt() < 0.08:
            b["pinned_worker"] = {"worker_id": self.pick([1, 2, 3, 11]), "dp_rank": self.pick([0, 0, 1])}
        if opt() < 0.05:
            b["affinity_target"] = {"worker_id": self.pick([1, 2, 3])}
        if opt() < 0.05:
            b["routing_constraints"] = {"required_taints": self.pick([[], ["t1"]]),
                                        "preferred_taints": {"t1": 0.5}}
        if opt() < 0.08:
            b["router_config_override"] = self.pick([
                {"track_prefill_tokens": False}, {"assume_kv_reuse": True},
                {"shared_cache_multiplier": 0.5}, {"unknown_key": 1}, {},
            ])
        if opt() < 0.1:
            b["session_id"] = self.pick(["sess", "s2", "s3"])
        if opt() < 0.05:
            c = {"session_id": self.pick(["sess", "s2", "c1"])}
            if opt() < 0.5:
                c["parent_session_id"] = self.pick(["sess", "p"])
            if opt() < 0.3:
                c["session_final"] = self.pick([True, False])
            if opt() < 0.3:
                c["input_trigger"] = self.pick(["user_message", "tool_result", "other"])
            b["session_context"] = c
        if opt() < 0.03:
            b["priority_jump"] = 1.5
        if not booking and opt() < 0.1:
            b["advisory"] = True
        return b

    def worker_body(self):
        b = {"worker_id": self.pick([10, 11, 12, 13, 18446744073709551615])}
        opt = self.rng.random
        b["model_name"] = self.pick(["w", "w", "w2"])
        if opt() < 0.8:
            b["endpoint"] = f"http://x{b['worker_id']}"
        if opt() < 0.8:
            b["block_size"] = self.pick([16, 16, 8, 0])
        if opt() < 0.2:
            b["total_kv_blocks"] = self.pick([100, 0, 50000])
        if opt() < 0.2:
            b["max_num_batched_tokens"] = self.pick([0, 8192])
        if opt() < 0.2:
            b["data_parallel_size"] = self.pick([1, 2, 0])
        if opt() < 0.1:
            b["data_parallel_start_rank"] = self.pick([0, 1])
        if opt() < 0.1:
            b["taints"] = self.pick([[], ["t1"]])
        if opt() < 0.1:
            b["kv_transfer_enforcement"] = self.pick(["required", "preferred", "bogus"])
        if opt() < 0.1:
            b["topology_domains"] = {"rack": "r1"}
        if opt() < 0.1:
            b["is_eagle"] = True
        return b

    def request(self):
        """(method, path, body object or None, what-for) of a valid call."""
        r = self.rng.random()
        if r < 0.2:
            return "POST", "/select", self.select_body(False)
        if r < 0.4:
            b = self.select_body(True)
            return "POST", "/select_and_reserve", b
        if r < 0.47:
            b = {"selection_id": self.some_id() if self.rng.random() < 0.5 else self.new_id()}
            if self.rng.random() < 0.7:
                b["worker_id"] = self.pick([1, 2, 3, 3, 99])
                b["dp_rank"] = self.pick([0, 0, 0, 5])
                self.prompt(b)
                if self.rng.random() < 0.4:
                    b["effective_prefill_tokens"] = self.rng.randrange(0, 80)
                if self.rng.random() < 0.2:
                    b["track_prefill_tokens"] = self.pick([True, False])
            b["model_name"] = self.pick(["m", "m", "w"])
            return "POST", "/reservations", b
        if r < 0.55:
            return "POST", f"/reservations/{self.some_id()}/prefill_complete", None
        if r < 0.63:
            b = self.pick([{}, {}, {"decay_fraction": self.pick([0.0, 0.5, 1.0, 1.5, -0.1])}])
            return "POST", f"/reservations/{self.some_id()}/output_block", b
        if r < 0.7:
            return "DELETE", f"/reservations/{self.some_id()}", None
        if r < 0.76:
            return "POST", self.pick(["/potential_loads", "/overlap_scores"]), self.prompt(
                {"model_name": self.pick(["m", "m", "w", "nomodel"])})
        if r < 0.82:
            return "POST", "/workers", self.worker_body()
        if r < 0.86:
            b = self.worker_body()
            for k in list(b):
                if self.rng.random() < 0.5:
                    del b[k]
            return "PATCH", f"/workers/{self.pick([10, 11, 12, 99])}", b
        if r < 0.88:
            return "DELETE", f"/workers/{self.pick([10, 11, 12, 13, 99])}", None
        q = self.pick(["", "?model_name=m", "?model_name=w", "?routing_group=default",
                       "?model_name=", "?tenant_id=1"])
        return "GET", self.pick(["/loads", "/workers", "/ready", "/health"]) + (
            q if self.rng.random() < 0.7 else ""), None

    def break_it(self, method, path, body):
        """A broken variant: (method, path, raw bytes or None, content type, kind)."""
        r = self.rng.random()
        raw = None if body is None else json.dumps(body).encode()
        if r < 0.35 and isinstance(body, dict) and body:
            b = dict(body)
            k = self.pick(sorted(b))
            if self.rng.random() < 0.3:
                del b[k]
                return method, path, json.dumps(b).encode(), "application/json", "drop " + k
            b[k] = self.pick(WRONG)
            return method, path, json.dumps(b).encode(), "application/json", "retype " + k
        if r < 0.45 and isinstance(body, dict) and body:
            k = self.pick(sorted(body))
            inner = json.dumps(body)[1:-1]
            dup = f'{{{inner},{json.dumps(k)}:{json.dumps(body[k])}}}'
            return method, path, dup.encode(), "application/json", "duplicate " + k
        if r < 0.6 and raw:
            cut = self.rng.randrange(0, len(raw))
            return method, path, raw[:cut], "application/json", "truncate"
        if r < 0.68 and raw:
            i = raw.rfind(b"]")
            if i > 0 and raw[i - 1:i] != b"[":
                return method, path, raw[:i] + b"," + raw[i:], "application/json", "trailing comma"
        if r < 0.75:
            alt = self.pick([b"[]", b"null", b"1", b'"x"', b"", b"{", b"{}", b"\xff\xfe",
                             b'{"token_ids":[1,2,NaN]}', b'{"model_name":"m","token_ids":[01]}',
                             b'{"model_name":"m","token_ids":[1e2]}', b'{"model_name":"\\ud800"}'])
            return method, path, alt, "application/json", "body " + alt[:12].decode("latin-1")
        if r < 0.83:
            ct = self.pick([None, "text/plain", "application/json; charset=utf-8",
                            "application/vnd.x+json", "application/jsonx", "APPLICATION/JSON"])
            return method, path, raw if raw is not None else b"{}", ct, f"content-type {ct}"
        if r < 0.9:
            m = self.pick(["GET", "PUT", "DELETE", "PATCH", "POST"])
            return m, path, raw, "application/json", "method " + m
        p = self.pick(["/workers/abc", "/reservations//prefill_complete", "/dump/", "/nope",
                       "/select/", "/workers/-1", "/workers/18446744073709551616",
                       "/reservations/x/output_block/y"])
        return self.pick(["GET", "POST", "DELETE", "PATCH"]), p, raw, "application/json", "path"


# ------------------------------------------------------------ the comparison

def records(body):
    """Worker records without kvselect's added `kv_streams` (README,
    "Connecting engines"), their taints in order (the reference lists a
    worker's taints in an order that changes from run to run)."""
    def strip(r):
        if not isinstance(r, dict):
            return r
        r = {k: v for k, v in r.items() if k != "kv_streams"}
        if isinstance(r.get("taints"), list):
            r["taints"] = sorted(r["taints"], key=str)
        return r
    if isinstance(body, list):
        return [strip(r) for r in body]
    if isinstance(body, dict) and isinstance(body.get("workers"), list) and "ready" in body:
        return dict(body, workers=[strip(r) for r in body["workers"]])
    return strip(body) if isinstance(body, dict) and "lifecycle" in body else body


def normalise(path, status, body, req):
    """The parts of an answer that must agree, as comparable JSON."""
    if path.startswith(("/workers", "/ready")):
        body = records(body)
    if isinstance(body, dict) and "error" in body and isinstance(body["error"], str):
        body = dict(body, error=BYTE_SUFFIX.sub("", body["error"]))
    if status == 200 and path.startswith("/select_and_reserve") and isinstance(body, dict):
        if not (isinstance(req, dict) and isinstance(req.get("selection_id"), str)):
            body = {k: v for k, v in body.items() if k != "selection_id"}
    if status == 200 and path.startswith("/select_and_reserve") and isinstance(body, dict) \
            and isinstance(body.get("sequence_hashes"), list):
        over = req.get("router_config_override") if isinstance(req, dict) else None
        reuse = over.get("assume_kv_reuse") if isinstance(over, dict) else None
        if not (WEIGHTS["reuse"] if reuse is None else reuse):
            # Random identities: only their number compares.
            body = dict(body, sequence_hashes=len(body["sequence_hashes"]))
    if status == 200 and isinstance(body, list):
        if path.startswith("/loads"):
            body = [dict(p, loads=sorted(p["loads"], key=lambda r: (r["worker_id"], r["dp_rank"])))
                    if isinstance(p, dict) and isinstance(p.get("loads"), list) else p for p in body]
        elif path.startswith("/potential_loads"):
            body = sorted(body, key=lambda r: (r.get("worker_id"), r.get("dp_rank")))
    if isinstance(body, dict) and req_model(req) == "w" and status == 200:
        # Partition "w" holds idle workers of equal cost: the pick is random.
        body = {k: v for k, v in body.items()
                if k not in ("worker_id", "endpoint", "dp_rank", "overlap",
                             "potential_decode_blocks", "effective_prefill_tokens")}
    return body


def diff_paths(a, b, at="", out=None):
    """Where two JSON values differ: up to 6 `path: a != b` lines."""
    out = [] if out is None else out
    if len(out) >= 6:
        return out
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            diff_paths(a.get(k, "<absent>"), b.get(k, "<absent>"), f"{at}.{k}", out)
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            diff_paths(x, y, f"{at}[{i}]", out)
    elif a != b:
        out.append(f"{at or '.'}: {json.dumps(a)[:200]} != {json.dumps(b)[:200]}")
    return out


def req_model(req):
    return req.get("model_name", "default") if isinstance(req, dict) else None


def documented(kind, method, path, raw, a, b):
    """The README's listed differences: (True, what) when this pair is one."""
    (sa, _, ba), (sb, cb, bb) = a, b
    if kind == "path" and sa == sb == 400 and cb.startswith("text/plain"):
        return True, "path id that does not parse: JSON error instead of text/plain"
    if isinstance(raw, bytes) and raw[:1] == b"[" and sa == 422 and any(
            path.startswith(p) for p in ("/workers", "/replica_sync")) or (
            isinstance(raw, bytes) and raw[:1] == b"[" and path.endswith("/output_block") and sa == 422):
        return True, "whole body given as an array"
    return False, ""


# The cost's weights and identity mode (spec 1.2), from the servers'
# environment (--env) and flags (--server-args).
WEIGHTS = {"credit": 1.0, "scale": 1.0, "track": True, "reuse": True, "decay": 0.0, "active": 0.0}


def set_weights(env, flags):
    """WEIGHTS from the servers' environment and flags."""
    WEIGHTS["credit"] = float(env.get("DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT", 1.0))
    WEIGHTS["scale"] = float(env.get("DYN_ROUTER_PREFILL_LOAD_SCALE", 1.0))
    WEIGHTS["decay"] = float(env.get("DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT_DECAY", 0.0))
    WEIGHTS["active"] = float(env.get("DYN_ROUTER_DECODE_ACTIVE_REQUEST_WEIGHT", 0.0))
    WEIGHTS["track"] = env.get("DYN_ROUTER_TRACK_PREFILL_TOKENS", "true").lower() != "false"
    WEIGHTS["reuse"] = (env.get("DYN_ROUTER_ASSUME_KV_REUSE", "true").lower() != "false"
                        and "--no-router-assume-kv-reuse" not in flags)


SESSION_APART = "a session bound to different targets by an earlier tie"


def session_of(req):
    """The session a request names (`session_context` wins), or None."""
    ctx = req.get("session_context")
    if isinstance(ctx, dict) and isinstance(ctx.get("session_id"), str):
        return ctx["session_id"]
    sid = req.get("session_id")
    return sid if isinstance(sid, str) else None


def judge_split(kv, dy, path, req, answers, corpus, apart):
    """Both servers answered a selection with different workers (`answers`,
    kvselect's then the reference's): frees the booking on both if it
    booked, then tells a tie ("tie": equal lowest cost), a session an
    earlier tie set apart (SESSION_APART), or a mismatch (its note)."""
    if path == "/select_and_reserve":
        # Each server's own id (generated when the request had none).
        for s, ans in zip((kv, dy), answers):
            sid = urllib.parse.quote(ans["selection_id"], safe="")
            st = s.call("DELETE", f"/reservations/{sid}")[0]
            assert st == 200, (s.name, sid, st)
    c = costs(kv, req)
    ka, kb = ((ans["worker_id"], ans["dp_rank"]) for ans in answers)
    sess = session_of(req)
    if c and ka in c and kb in c and abs(c[ka] - c[kb]) < 1e-9 and c[ka] <= min(c.values()) + 1e-9:
        # The servers now hold different choices under this id (a pending
        # selection a later booking replays) and may bind the session to
        # different targets: keep both out of the rest of the run's
        # comparisons.
        if req.get("selection_id") in corpus.booked:
            corpus.booked.remove(req["selection_id"])
        if sess is not None:
            apart.add(sess)
        return "tie"
    if sess in apart:
        return SESSION_APART
    return f"costs from kvselect's answers {c}, from the reference's {costs(dy, req)}"


def costs(srv, req):
    """Each candidate's cost (spec 7.3 with WEIGHTS; with prefill untracked,
    minus the credit) from srv's answers."""
    prompt = {k: v for k, v in req.items() if k in (
        "model_name", "routing_group", "token_ids", "block_hashes", "sequence_hashes",
        "isl_tokens", "lora_name", "cache_salt", "is_eagle", "mm_routing_info",
        "block_mm_infos", "router_config_override")}
    _, _, o = srv.call("POST", "/overlap_scores", json.dumps(prompt).encode())
    _, _, p = srv.call("POST", "/potential_loads", json.dumps(prompt).encode())
    _, _, l = srv.call("GET", f"/loads?model_name={req_model(req)}")
    o, p, l = jbody(o), jbody(p), jbody(l)
    if not (isinstance(o, dict) and isinstance(p, list) and isinstance(l, list) and l):
        return None
    tiers = {(w["worker_id"], w["dp_rank"]): w for w in o["workers"]}
    active = {(r["worker_id"], r["dp_rank"]): r for part in l for r in part["loads"]}
    out = {}
    track = (req.get("router_config_override") or {}).get("track_prefill_tokens", WEIGHTS["track"])
    mm = (req.get("mm_routing_info") or {}).get("routing_token_ids")
    toks = mm if mm else req.get("token_ids")
    isl = len(toks) if isinstance(toks, list) else req.get("isl_tokens", 0)
    least = min(active[(r["worker_id"], r["dp_rank"])]["potential_prefill_tokens"] for r in p) if p else 0
    for r in p:
        key = (r["worker_id"], r["dp_rank"])
        t, a = tiers.get(key, {}), active[key]
        dev = t.get("device_blocks", 0)
        host, disk = t.get("host_pinned_extension_blocks", 0), t.get("disk_extension_blocks", 0)
        decay = 1.0
        if WEIGHTS["decay"] > 0 and isl > 0:
            extra = (a["potential_prefill_tokens"] - least) / BS
            decay = 1.0 / (1.0 + WEIGHTS["decay"] * extra / -(-isl // BS))
        credit = WEIGHTS["credit"] * dev * decay + 0.75 * host + 0.25 * disk
        cached = round((dev + 0.75 * host + 0.25 * disk) * BS)
        if track:
            raw = (a["potential_prefill_tokens"] + max(isl, cached)) / BS
            prefill = WEIGHTS["scale"] * max(0.0, raw - credit)
        else:
            prefill = -credit  # measured: the cache keeps its credit, unscaled
        out[key] = prefill + r["potential_decode_blocks"] + WEIGHTS["active"] * a["active_requests"]
    return out


# ------------------------------------------------------------------- setup

def engines(ctx):
    """Binds the three engines' PUB sockets on ports the OS picks (no port
    can be taken between choosing and binding it) and records them in
    `ENGINE_PORTS`."""
    pubs = {}
    for w in ENGINE_PORTS:
        s = ctx.socket(zmq.XPUB)
        # Report every subscription, not just a topic's first: two servers
        # subscribe to the same (empty) topic.
        s.setsockopt(zmq.XPUB_VERBOSE, 1)
        s.bind("tcp://127.0.0.1:*")
        endpoint = s.getsockopt(zmq.LAST_ENDPOINT).decode()
        ENGINE_PORTS[w] = int(endpoint.rsplit(":", 1)[1])
        pubs[w] = s
    return pubs


def stored(hashes, parent, tokens, medium="GPU"):
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": tokens, "block_size": BS, "lora_id": None, "medium": medium}


def sglang_stored(hashes, parent, tokens, medium=None):
    """SGLang's BlockStored: signed i64 hashes, `medium` only off the GPU."""
    e = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
         "token_ids": tokens, "block_size": BS, "lora_id": None}
    if medium is not None:
        e["medium"] = medium
    return e


def publish(pubs, seq):
    """The three engines' caches (module docs), one batch each (storing
    the same blocks again changes nothing)."""
    batches = {
        1: [stored(list(range(100, 108)), None, PROMPT_A[:8 * BS])],
        2: [stored(list(range(100, 104)), None, PROMPT_A[:4 * BS])],
        3: [sglang_stored([-(2**62) - i for i in range(2)], None, PROMPT_B[:2 * BS]),
            sglang_stored([-(2**62) - i for i in range(6)], None, PROMPT_B[:6 * BS], "CPU_PINNED")],
    }
    for w, events in batches.items():
        rank = None if w == 3 else 0
        pubs[w].send_multipart([b"", seq.to_bytes(8, "big"),
                                msgpack.packb([time.time(), events, rank])])


# (device, host_pinned) blocks of workers 1 and 2 on A, and 3 on B.
CACHED = ((8, 8), (4, 4), (2, 6))


def applied(s):
    """What server s has indexed of the engines' caches (CACHED when all)."""
    tiers = {}
    for prompt in (PROMPT_A, PROMPT_B):
        body = json.dumps({"model_name": "m", "token_ids": prompt[:128]}).encode()
        for w in jbody(s.call("POST", "/overlap_scores", body)[2])["workers"]:
            tiers[(w["worker_id"], prompt is PROMPT_A)] = (w["device_blocks"], w["host_pinned_blocks"])
    return tiers.get((1, True)), tiers.get((2, True)), tiers.get((3, False))


def prepare(servers, pubs, queue):
    """Registers the three engines' workers on both servers, publishes
    until both indexed the caches, and books unequal idle loads; returns the
    last batch's sequence number."""
    for s in servers:
        for w, port in ENGINE_PORTS.items():
            body = {"worker_id": w, "model_name": "m", "endpoint": f"http://w{w}",
                    "block_size": BS, "kv_events_endpoints": {"0": f"tcp://127.0.0.1:{port}"}}
            if queue:
                # The queue schedules only workers that state their batch size.
                body["max_num_batched_tokens"] = 8192
            st, _, data = s.call("POST", "/workers", json.dumps(body).encode())
            assert st == 201, (s.name, st, data)
    # A server may subscribe more than once, so the subscriptions seen do
    # not prove both are connected: publish until both applied.
    for seq in range(30):
        publish(pubs, seq)
        time.sleep(1)
        got = {s.name: applied(s) for s in servers}
        if all(g == CACHED for g in got.values()):
            break
    else:
        sys.exit(f"the servers did not apply the KV events within 30 s: {got}")
    # Unequal idle loads, so that cost ties are the exception.
    for s in servers:
        for sid, w, n in (("base2", 2, 1), ("base3", 3, 2)):
            body = {"selection_id": sid, "model_name": "m", "worker_id": w,
                    "sequence_hashes": list(range(1, n + 1)), "isl_tokens": n * BS}
            st, _, data = s.call("POST", "/reservations", json.dumps(body).encode())
            assert st == 201, (s.name, st, data)
    return seq


def state_differences(kv, dy):
    """Where the two servers' state parts: their /loads, /workers and /ready,
    and their index (nothing after the setup changes what the engines
    cached). A list of (what, path, kvselect's answer, the reference's, note)."""
    out = []
    for p in ("/loads", "/workers", "/ready"):
        sa, sb = kv.call("GET", p), dy.call("GET", p)
        if normalise(p, sa[0], jbody(sa[2]), None) != normalise(p, sb[0], jbody(sb[2]), None):
            out.append(("state", p, sa, sb, "state differs"))
    got = {s.name: applied(s) for s in (kv, dy)}
    if any(g != CACHED for g in got.values()):
        out.append(("index", "/overlap_scores", (0, "", b""), (0, "", b""),
                    f"cached blocks {got}, published {CACHED}"))
    return out


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(name, argv, env, attempts=5, timeout=60.0):
    """Starts `argv + ["--port", P]` on a free port P and waits for its
    `/health`; returns the process and its `Server`. A free port can be
    taken between `free_port` closing it and the server binding it (by a
    connection's local port, in a parallel run), so a server that exits
    before it answers, saying its address is in use, starts again on
    another port. Any other early exit, or no answer within `timeout`
    seconds, ends the run with the server's output."""
    for _ in range(attempts):
        port = free_port()
        log = tempfile.TemporaryFile()
        proc = subprocess.Popen([*argv, "--port", str(port)], env=env,
                                stdout=log, stderr=subprocess.STDOUT)
        server = Server(name, port)
        end = time.time() + timeout
        while time.time() < end and proc.poll() is None:
            if _ok(server, "GET", "/health"):
                log.close()
                return proc, server
            time.sleep(0.05)
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        log.seek(0)
        out = log.read().decode(errors="replace")
        log.close()
        if "in use" not in out:
            sys.exit(f"{name} gave no /health on port {port} within {timeout:.0f} s "
                     f"(exit status {proc.returncode}):\n{out[-4000:]}")
    sys.exit(f"{name} found its port in use {attempts} times:\n{out[-4000:]}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--bin", default="target/release/kvselect")
    ap.add_argument("--dynamo-python", default="/opt/dynamo-venv/bin/python")
    ap.add_argument("--full", action="store_true", help="print whole request bodies")
    ap.add_argument("--server-args", default="",
                    help="extra flags for both servers, e.g. '--session-affinity-ttl-secs 60'")
    ap.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                    help="environment for both servers (repeatable), e.g. DYN_ROUTER_PREFILL_LOAD_SCALE=2")
    args = ap.parse_args()
    extra = args.server_args.split()
    env = dict(os.environ, **dict(e.split("=", 1) for e in args.env))
    set_weights(env, extra)

    # Ports of this run's own, so that a second run (or a leftover server)
    # cannot answer in place of ours.
    ctx = zmq.Context()
    pubs = engines(ctx)
    procs = []
    mismatches, listed, ties, sent = [], {}, 0, 0
    apart = set()  # sessions whose bindings a split tie set apart
    try:
        kv_proc, kv = launch("kvselect", [args.bin, *extra], env)
        procs.append(kv_proc)
        dy_proc, dy = launch("dynamo", [args.dynamo_python, "-m", "dynamo.select_service", *extra], env)
        procs.append(dy_proc)
        seq = prepare((kv, dy), pubs, "DYN_ROUTER_QUEUE_THRESHOLD" in env)

        rng = random.Random(args.seed)
        corpus = Corpus(rng)
        # The engines keep publishing (the same stores, which change
        # nothing), as live engines do: kvselect counts the overlap of a
        # rank whose stream is silent for 10 s while it has bookings at half
        # (README, "Connecting engines"), the reference does not.
        beat = time.monotonic()
        for i in range(args.requests):
            if time.monotonic() - beat >= 2.0:
                seq += 1
                publish(pubs, seq)
                beat = time.monotonic()
            method, path, body = corpus.request()
            kind, ctype = "valid", "application/json"
            raw = None if body is None else json.dumps(body).encode()
            if method in ("POST", "PATCH") and raw is None and rng.random() < 0.5:
                raw = b"{}"
            if rng.random() < 0.4:
                method, path, raw, ctype, kind = corpus.break_it(method, path, body)
            req = None
            if isinstance(raw, bytes):
                try:
                    req = json.loads(raw)
                except ValueError:
                    pass
            a = kv.call(method, path, raw, ctype)
            b = dy.call(method, path, raw, ctype)
            sent += 1
            if isinstance(req, dict) and a[0] in (200, 201) and isinstance(req.get("selection_id"), str):
                corpus.booked.append(req["selection_id"])
            na = normalise(path, a[0], jbody(a[2]), req)
            nb = normalise(path, b[0], jbody(b[2]), req)
            ja, jb = a[1].startswith("application/json"), b[1].startswith("application/json")
            if (a[0], na, ja) == (b[0], nb, jb):
                pass
            elif documented(kind, method, path, raw, a, b)[0]:
                what = documented(kind, method, path, raw, a, b)[1]
                listed[what] = listed.get(what, 0) + 1
            elif (a[0] == b[0] == 200 and path in ("/select", "/select_and_reserve")
                  and isinstance(na, dict) and isinstance(nb, dict)
                  and na.get("worker_id") != nb.get("worker_id")):
                verdict = judge_split(kv, dy, path, req, (jbody(a[2]), jbody(b[2])), corpus, apart)
                if verdict == "tie":
                    ties += 1
                elif verdict == SESSION_APART:
                    listed[SESSION_APART] = listed.get(SESSION_APART, 0) + 1
                else:
                    mismatches.append((i, kind, method, path, raw, a, b, verdict))
            else:
                mismatches.append((i, kind, method, path, raw, a, b, ""))
            if i % 25 == 24:
                for (what, p, sa, sb, note) in state_differences(kv, dy):
                    mismatches.append((i, what, "GET", p, None, sa, sb, note))
            if len(mismatches) >= 40:
                break
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait()
        for s in pubs.values():
            s.close(linger=0)
        ctx.term()
    for (n, kind, method, path, raw, a, b, note) in mismatches:
        shown = raw if raw is None or len(raw) < 300 or args.full else raw[:300] + b"..."
        print(f"#{n} [{kind}] {method} {path} {shown!r}")
        ja, jb = jbody(a[2]), jbody(b[2])
        if a[0] == b[0] and not isinstance(ja, str) and not isinstance(jb, str):
            for line in diff_paths(ja, jb):
                print(f"  {a[0]} kvselect vs dynamo at {line}")
        else:
            print(f"  kvselect {a[0]} {a[1]} {a[2][:300]!r}\n  dynamo   {b[0]} {b[1]} {b[2][:300]!r}")
        if note:
            print(f"  {note}")
    print(f"{sent} requests, {len(mismatches)} mismatches, {ties} cost ties split apart, "
          f"documented differences: {listed or 'none'}")
    return 1 if mismatches else 0


def _ok(s, method, path):
    try:
        return s.call(method, path)[0] == 200
    except OSError:
        return False


if __name__ == "__main__":
    sys.exit(main())
