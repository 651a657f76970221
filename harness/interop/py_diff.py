"""kvselect's embedded Python selector against Dynamo 1.6.1's, call by call.

    /opt/dynamo-venv/bin/python harness/interop/py_diff.py [--calls N] [--seed S]
        [--native target/release/deps/lib_native.so] [--ctor JSON] [--env NAME=VALUE]

Loads `dynamo._core.SelectionService` (ai-dynamo-runtime 1.6.1) and this
build's `kvselect.SelectionService` into one interpreter (the package from
`python/kvselect` with the native library `--native`, as the test command
builds it), gives both the same constructor keywords (`--ctor`), feeds both
the same KV events from the mock engines of `http_diff.py`, then makes every
call of a seeded random corpus on both, in the same order. The corpus is
`http_diff.py`'s, each request turned into the embedded API's call
(`select`, `select_and_reserve`, `create_reservation`, `prefill_complete`,
`add_output_block`, `free_reservation`, `overlap_scores`,
`potential_loads`, `upsert_worker`, `patch_worker`, `delete_worker`,
`loads`, `list_workers`, `ready`), and a share of the calls broken the way
Python callers break them: a field dropped or given another Python type
(None, bool, float, NaN, out-of-range int, str, bytes, tuple, list, dict),
a bad element inside a list, a nested dict or list passed as another
mapping or sequence type (a `collections.abc.Mapping` or `Sequence` of
its own, a tuple, a deque), the whole argument of another type, an
argument too many, an unknown keyword.

The two outcomes must agree: the returned object (up to `http_diff.py`'s
normalisation: generated ids, random picks among equal idle workers), or
the exception: raised at the call or by the awaitable, its type, message,
`.kind` and `.status_code`. Token inputs other than lists and tuples
(bytes, buffers, other iterables) are kvselect extensions (README) and are
counted apart. A selection that went to different workers is judged as in
`http_diff.py` (an exact cost tie, or a mismatch). Every 25 calls
`loads()`, `list_workers()`, `ready()` and the index must agree.

Needs pyzmq and msgpack in the reference's interpreter. Exits 1 on any
mismatch, printing each.
"""
import argparse
import asyncio
import collections
import collections.abc
import copy
import importlib
import json
import os
import random
import re
import shutil
import sys
import sysconfig
import tempfile
import time
import urllib.parse

import zmq

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import http_diff as H  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Values a Python caller may pass where another type belongs.
PY_WRONG = H.WRONG + [(1, 2), b"ab", float("nan"), float("inf"), -0.0, ["1"], [None],
                      [1.5], [True], [-1], {1: 2}, {"a": None}, 2**64, -(2**63) - 1]
# The wrong values that do not name the engines' workers 1-3 (True is 1):
# a worker id changed to one of them would drop its index.
NOT_ENGINES = [w for w in PY_WRONG if not (isinstance(w, int) and 1 <= w <= 3)]
# Bad elements of a list.
BAD_ITEMS = [-1, 2**32, 2**64, 1.0, True, "1", None, [1], 1.5]
TOKEN_KEYS = ("token_ids", "routing_token_ids")


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

    def __repr__(self):
        return f"Mapping({self.d!r})"


class Sequence(collections.abc.Sequence):
    """A sequence that is not a list or tuple."""

    def __init__(self, items):
        self.items = items

    def __getitem__(self, i):
        return self.items[i]

    def __len__(self):
        return len(self.items)

    def __repr__(self):
        return f"Sequence({self.items!r})"


def load_kvselect(native):
    """This build's package: python/kvselect with `native` as its extension
    module, in a temporary directory put first on sys.path."""
    site = tempfile.mkdtemp(prefix="py_diff-")
    pkg = os.path.join(site, "kvselect")
    shutil.copytree(os.path.join(ROOT, "python", "kvselect"), pkg)
    shutil.copy(native, os.path.join(pkg, "_native" + sysconfig.get_config_var("EXT_SUFFIX")))
    sys.path.insert(0, site)
    return importlib.import_module("kvselect"), site


class Service:
    """One embedded selector, called synchronously on a private event loop
    (its awaitables need a running loop when they are made). `call` answers
    http_diff's (method, path, body) requests as (status, content type,
    JSON bytes), so that its cost and index checks run unchanged."""

    def __init__(self, name, svc, loop):
        self.name, self.svc, self.loop = name, svc, loop

    def invoke(self, method, args, kwargs):
        """("ok", value) or ("raise", where, type, message, kind, status)."""
        async def run():
            try:
                r = getattr(self.svc, method)(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 - the outcome compared
                return error("call", e)
            if asyncio.isfuture(r) or asyncio.iscoroutine(r):
                try:
                    r = await asyncio.wait_for(r, 10)
                except asyncio.TimeoutError:
                    return ("raise", "await", "timeout", "no answer within 10 s", None, None)
                except Exception as e:  # noqa: BLE001
                    return error("await", e)
            return ("ok", r)
        return self.loop.run_until_complete(run())

    def call(self, method, path, body=None, ctype="application/json"):
        req = json.loads(body) if body else None
        if isinstance(req, dict) and isinstance(req.get("kv_events_endpoints"), dict):
            # JSON's object keys are strings; the embedded API's ranks are ints.
            req["kv_events_endpoints"] = {int(k): v for k, v in req["kv_events_endpoints"].items()}
        name, args, kwargs = to_call(method, path, req)
        out = self.invoke(name, args, kwargs)
        if out[0] == "ok":
            status = 201 if name in ("upsert_worker", "create_reservation") else 200
            return status, "application/json", json.dumps(out[1]).encode()
        return out[5] or 400, "application/json", json.dumps({"error": out[3]}).encode()


def error(where, e):
    return ("raise", where, type(e).__name__, str(e), getattr(e, "kind", None),
            getattr(e, "status_code", None))


def to_call(method, path, body):
    """The embedded API's call for one of http_diff's requests:
    (method name, args, kwargs), or None (routes it has no call for)."""
    p, _, q = path.partition("?")
    kw = dict(urllib.parse.parse_qsl(q, keep_blank_values=True))
    parts = [urllib.parse.unquote(x) for x in p.split("/")[1:]]
    if method == "POST" and len(parts) == 1:
        name = {"select": "select", "select_and_reserve": "select_and_reserve",
                "reservations": "create_reservation", "overlap_scores": "overlap_scores",
                "potential_loads": "potential_loads", "workers": "upsert_worker"}.get(parts[0])
        return (name, [body], {}) if name else None
    if parts[0] == "workers" and len(parts) == 2 and parts[1].isdigit():
        if method == "PATCH":
            return "patch_worker", [int(parts[1]), body], {}
        if method == "DELETE":
            return "delete_worker", [int(parts[1])], {}
    if parts[0] == "reservations" and len(parts) == 3 and method == "POST":
        if parts[2] == "prefill_complete":
            return "prefill_complete", [parts[1]], {}
        if parts[2] == "output_block":
            return "add_output_block", [parts[1]], dict(body or {})
    if parts[0] == "reservations" and len(parts) == 2 and method == "DELETE":
        return "free_reservation", [parts[1]], {}
    if method == "GET" and len(parts) == 1:
        if parts[0] == "loads":
            return "loads", [], kw
        if parts[0] == "workers":
            return "list_workers", [], kw
        if parts[0] == "ready":
            return "ready", [], {}
    return None


def containers(v, at=()):
    """Every dict and list inside v, with its path."""
    if isinstance(v, (dict, list)):
        yield at, v
        items = v.items() if isinstance(v, dict) else enumerate(v)
        for k, x in items:
            yield from containers(x, at + (k,))


def plain(v):
    """v with its mappings as dicts and its sequences as lists (what JSON takes)."""
    if isinstance(v, (dict, Mapping)):
        return {k: plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple, Sequence, collections.deque)):
        return [plain(x) for x in v]
    return v


def break_call(rng, name, args, kwargs):
    """A broken variant of a call: (args, kwargs, kind)."""
    args, kwargs = copy.deepcopy(args), dict(kwargs)
    r = rng.random()
    if r < 0.1 and args and isinstance(args[-1], dict):
        # A nested dict or list as another mapping or sequence type.
        places = [(at, c) for at, c in containers(args[-1]) if at]
        if places:
            at, c = places[rng.randrange(len(places))]
            parent = args[-1]
            for k in at[:-1]:
                parent = parent[k]
            kinds = [Mapping] if isinstance(c, dict) else [Sequence, tuple, collections.deque]
            parent[at[-1]] = kinds[rng.randrange(len(kinds))](c)
            return args, kwargs, f"rewrap {'.'.join(map(str, at))}"
    if r < 0.6 and args and isinstance(args[-1], dict) and args[-1]:
        places = list(containers(args[-1]))
        at, c = places[rng.randrange(len(places))]
        if isinstance(c, list) and c and rng.random() < 0.5:
            i = rng.randrange(len(c) + 1)
            c.insert(i, BAD_ITEMS[rng.randrange(len(BAD_ITEMS))])
            return args, kwargs, f"bad item at {'.'.join(map(str, at))}[{i}]"
        if isinstance(c, dict) and c:
            k = sorted(c, key=str)[rng.randrange(len(c))]
            if rng.random() < 0.25:
                del c[k]
                return args, kwargs, f"drop {'.'.join(map(str, at + (k,)))}"
            wrong = PY_WRONG
            if k == "worker_id" and name in ("upsert_worker", "patch_worker"):
                wrong = NOT_ENGINES
            c[k] = copy.deepcopy(wrong[rng.randrange(len(wrong))])
            return args, kwargs, f"retype {'.'.join(map(str, at + (k,)))}"
        if isinstance(c, list) and c:
            i = rng.randrange(len(c))
            c[i] = copy.deepcopy(PY_WRONG[rng.randrange(len(PY_WRONG))])
            return args, kwargs, f"retype {'.'.join(map(str, at + (i,)))}"
    if r < 0.75 and args:
        i = rng.randrange(len(args))
        wrong = NOT_ENGINES if name in ("delete_worker", "patch_worker") and i == 0 else PY_WRONG
        args[i] = copy.deepcopy(wrong[rng.randrange(len(wrong))])
        return args, kwargs, f"argument {i} retyped"
    if r < 0.85:
        return args + [1], kwargs, "an argument too many"
    if r < 0.92 and args:
        return args[:-1], kwargs, "an argument missing"
    kwargs["bogus"] = 1
    return args, kwargs, "unknown keyword"


def token_extension(kind, args):
    """A token input only kvselect reads (bytes, buffers, other iterables):
    accepted, or refused for its length."""
    if not kind.startswith(("retype", "argument")):
        return False
    for _, c in containers(args[-1] if args else None):
        if isinstance(c, dict):
            for k in TOKEN_KEYS:
                if k in c and not isinstance(c[k], (list, tuple, type(None), bool, int, float, str, dict)):
                    return True
    return False


INDEXED = re.compile(r"^(token_ids|routing_token_ids|block_hashes|sequence_hashes)\[\d+\]: ")


def names_index(a, b):
    """kvselect's message is the reference's under `field[i]: ` (README)."""
    return (a[0] == b[0] == "raise" and a[1:3] == b[1:3] and a[4:] == b[4:]
            and INDEXED.sub("", a[3], count=1) == b[3] and a[3] != b[3])


def normalised(path, req, out):
    """The comparable part of an outcome."""
    if out[0] == "ok":
        return ("ok", H.normalise(path, 200, out[1], req))
    return out



def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--native", default=os.path.join(ROOT, "target/release/deps/lib_native.so"))
    ap.add_argument("--ctor", default="{}", help="constructor keywords for both, as JSON "
                    "(`selection_cache` as the keywords of its SelectionCacheConfig)")
    ap.add_argument("--max-mismatches", type=int, default=40, help="stop after this many")
    ap.add_argument("--trace", action="store_true", help="print every call and both outcomes")
    ap.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                    help="environment for both (repeatable), e.g. DYN_ROUTER_PREFILL_LOAD_SCALE=2")
    args = ap.parse_args()
    os.environ.setdefault("DYN_LOG", "error")
    os.environ.update(dict(e.split("=", 1) for e in args.env))
    H.set_weights(os.environ, [])
    import dynamo._core as reference
    kvselect, site = load_kvselect(args.native)

    ctx = zmq.Context()
    pubs = H.engines(ctx)
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    ctor = json.loads(args.ctor)

    def made_with(mod):
        # `selection_cache` is given as the keywords of its SelectionCacheConfig.
        kw = dict(ctor)
        if isinstance(kw.get("selection_cache"), dict):
            kw["selection_cache"] = mod.SelectionCacheConfig(**kw["selection_cache"])
        return mod.SelectionService(**kw)

    kv = Service("kvselect", made_with(kvselect), loop)
    dy = Service("dynamo", made_with(reference), loop)
    mismatches, listed, ties, made = [], {}, 0, 0
    apart = set()
    try:
        seq = H.prepare((kv, dy), pubs, "DYN_ROUTER_QUEUE_THRESHOLD" in os.environ)
        rng = random.Random(args.seed)
        corpus = H.Corpus(rng)
        beat = time.monotonic()
        for i in range(args.calls):
            if time.monotonic() - beat >= 2.0:
                seq += 1
                H.publish(pubs, seq)
                beat = time.monotonic()
            method, path, body = corpus.request()
            call = to_call(method, path, body)
            if call is None:
                continue
            name, cargs, ckw = call
            kind = "valid"
            if rng.random() < 0.4:
                cargs, ckw, kind = break_call(rng, name, cargs, ckw)
            req = cargs[-1] if cargs and isinstance(cargs[-1], dict) else None
            a = kv.invoke(name, copy.deepcopy(cargs), dict(ckw))
            b = dy.invoke(name, copy.deepcopy(cargs), dict(ckw))
            made += 1
            if args.trace:
                print(f"@{i} [{kind}] {name}({repr(cargs)[:160]}, **{ckw})\n  kv {str(a)[:160]}\n  dy {str(b)[:160]}")
            if a[0] == "ok" and isinstance(req, dict) and isinstance(req.get("selection_id"), str) \
                    and name in ("select_and_reserve", "create_reservation"):
                corpus.booked.append(req["selection_id"])
            na, nb = normalised(path, req, a), normalised(path, req, b)
            if na == nb:
                continue
            if b[0] == "raise" and token_extension(kind, cargs):
                what = "a token input only kvselect accepts"
                listed[what] = listed.get(what, 0) + 1
            elif names_index(a, b):
                what = "a bad token or hash names its index"
                listed[what] = listed.get(what, 0) + 1
            elif (a[0] == b[0] == "ok" and name in ("select", "select_and_reserve")
                  and isinstance(na[1], dict) and isinstance(nb[1], dict)
                  and na[1].get("worker_id") != nb[1].get("worker_id")):
                verdict = H.judge_split(kv, dy, "/" + name, plain(req), (a[1], b[1]), corpus, apart)
                if verdict == "tie":
                    ties += 1
                elif verdict == H.SESSION_APART:
                    listed[verdict] = listed.get(verdict, 0) + 1
                else:
                    mismatches.append((i, kind, name, cargs, ckw, na, nb, verdict))
            else:
                mismatches.append((i, kind, name, cargs, ckw, na, nb, ""))
            if i % 25 == 24:
                for (what, p, sa, sb, note) in H.state_differences(kv, dy):
                    mismatches.append((i, what, p, [], {}, sa, sb, note))
            if len(mismatches) >= args.max_mismatches:
                break
    finally:
        for s in (kv, dy):
            s.svc.shutdown()
        loop.close()
        for s in pubs.values():
            s.close(linger=0)
        ctx.term()
        shutil.rmtree(site, ignore_errors=True)
    for (n, kind, name, cargs, ckw, na, nb, note) in mismatches:
        shown = repr(cargs)
        print(f"#{n} [{kind}] {name}({shown[:300]}{'...' if len(shown) > 300 else ''}, **{ckw})")
        if na and nb and na[0] == nb[0] == "ok" and isinstance(na[1], (dict, list)):
            for line in H.diff_paths(json.loads(json.dumps(na[1])), json.loads(json.dumps(nb[1]))):
                print(f"  kvselect vs dynamo at {line}")
        else:
            print(f"  kvselect {str(na)[:400]}\n  dynamo   {str(nb)[:400]}")
        if note:
            print(f"  {note}")
    print(f"{made} calls, {len(mismatches)} mismatches, {ties} cost ties split apart, "
          f"documented differences: {listed or 'none'}")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
