#!/usr/bin/env python3
"""Embedded-selector benchmark: the agentic workload, in-process.

Drives ``kvselect.SelectionService`` and/or Dynamo 1.6.1's
``dynamo._core.SelectionService`` from Python (one child process per
implementation, run one after the other by this driver with the same seed),
against a fleet of mock vLLM workers (``kvselect-mocker``, a subprocess, so
its CPU is not counted) that publish real ZMQ KV events.

Workload (as the Rust harness's ``loadgen``): ``--sessions`` agentic sessions
share a ``--prefix-tokens`` system prefix; each session's prompt grows by
``--turn-growth`` tokens per turn and restarts (new history) past the top
length, so prompt lengths are uniform in [prefix + growth, 2*mean - that]
with mean ``--mean-isl``. Every session first runs one unmeasured turn (the
fleet's caches fill as in a running fleet). A turn is: ``select_and_reserve``
(the timed call), the chosen mock worker serves the prompt (stores and
publishes its blocks), the decode wait, ``free_reservation``.

Modes:
  paced      turns start at ``--rate`` per second (evenly spaced), decode wait
             ``--decode-s``;
  saturated  closed loop: ``--saturated-concurrency`` sessions run turns back
             to back, no decode wait.

Per implementation and mode: CPU ms per call of the whole Python process
(``getrusage``: every thread, including the selector's own), calls/s,
p50/p99 latency of ``select_and_reserve`` (from before the call is made to
its result), errors, KV hit ratio (sum of ``overlap.longest_matched`` / sum of
``isl_tokens``), and the kvselect/dynamo ratios. ``--impl null`` (run by
default too) replaces the selector by a no-op to measure the harness's own
per-call overhead (prompt bookkeeping, mocker hand-off, timing).

Input forms: each implementation gets the token form it is fastest with
(``--input-form auto``): a numpy ``uint32`` view for kvselect (zero-copy
slice of the session's token array), a ``list[int]`` for Dynamo (the only
form it takes; each session keeps its prompt as a list that grows in place,
so no list is built per call). The mocker gets the prompt as a binary frame
(``--stdin-binary``), the same bytes for every implementation.

Example::

    python python/bench/embedded_bench.py --impl both \\
        --python-dynamo /opt/dynamo-venv/bin/python --duration 25
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

VOCAB = 128_256  # Llama-3 vocabulary
RESULT_TAG = "EMBEDDED_BENCH_RESULT "
HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent


# --------------------------------------------------------------------------
# CLI


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impl", default="both", choices=["kvselect", "dynamo", "both", "null"],
                   help="implementation(s) to run, each followed by the null selector (default: both)")
    p.add_argument("--mode", default="both", choices=["paced", "saturated", "both"])
    p.add_argument("--python-dynamo", default="/opt/dynamo-venv/bin/python",
                   help="interpreter with ai-dynamo-runtime installed")
    p.add_argument("--python-kvselect", default=sys.executable, help="interpreter with kvselect installed")
    p.add_argument("--mocker", default=str(REPO / "target" / "release" / "kvselect-mocker"))
    p.add_argument("--duration", type=float, default=25.0, help="measured seconds per mode")
    p.add_argument("--warmup", type=float, default=3.0, help="unmeasured seconds before each window")
    p.add_argument("--rate", type=float, default=60.0, help="paced mode: calls offered per second")
    p.add_argument("--decode-s", type=float, default=1.0, help="paced mode: decode wait before the free")
    p.add_argument("--saturated-concurrency", type=int, default=0,
                   help="saturated mode: sessions in flight (default: all sessions)")
    p.add_argument("--workers", type=int, default=128)
    p.add_argument("--sessions", type=int, default=256)
    p.add_argument("--prefix-tokens", type=int, default=16_384)
    p.add_argument("--mean-isl", type=int, default=99_000)
    p.add_argument("--turn-growth", type=int, default=2_048)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--capacity-blocks", type=int, default=32_768, help="mock worker KV capacity")
    p.add_argument("--indexer-threads", type=int, default=4, help="SelectionService(indexer_threads=...)")
    p.add_argument("--prime-concurrency", type=int, default=16, help="first (unmeasured) turns in flight")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--input-form", default="auto", choices=["auto", "list", "numpy", "bytes"],
                   help="token form passed to the selector (auto: numpy for kvselect, list otherwise)")
    p.add_argument("--null-forms", default="auto", choices=["auto", "list", "numpy", "both", "none"],
                   help="null-selector runs after the real ones (auto: the forms the real runs used)")
    p.add_argument("--json-out", help="also write the final JSON line to this file")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# --------------------------------------------------------------------------
# Child: one implementation, both modes


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def proc_cpu_seconds(pid: int) -> Optional[float]:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def machine_busy() -> Optional[tuple]:
    """(busy, total) jiffies of all CPUs, from /proc/stat."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        idle = v[3] + (v[4] if len(v) > 4 else 0)
        return sum(v) - idle, sum(v)
    except (OSError, ValueError):
        return None


def percentile(sorted_vals: List[float], q: float) -> float:
    if not sorted_vals:
        return 0.0
    i = min(len(sorted_vals) - 1, max(0, int(len(sorted_vals) * q + 0.999999) - 1))
    return sorted_vals[i]


class Mocker:
    """``kvselect-mocker --stdin-binary``: frames ``worker_id u64 LE, n u32 LE,
    n x u32 LE``."""

    def __init__(self, path: str, workers: int, block_size: int, capacity: int, run_for_s: float):
        if sys.byteorder != "little":
            raise SystemExit("the mocker's binary frames are little-endian u32; this host is big-endian")
        if not os.path.exists(path):
            raise SystemExit(
                f"mocker binary not found at {path}; build it with "
                "`cargo build --release -p kvselect-harness --bin kvselect-mocker`")
        self.proc = subprocess.Popen(
            [path, "--workers", str(workers), "--block-size", str(block_size),
             "--capacity-blocks", str(capacity), "--stdin-binary", "--run-for-s", str(run_for_s)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
        self.endpoints = [json.loads(self.proc.stdout.readline()) for _ in range(workers)]
        self._fd = self.proc.stdin.fileno()

    def serve(self, worker_id: int, tokens) -> None:
        """Hand the prompt (a contiguous numpy uint32 array) to the worker."""
        view = memoryview(tokens).cast("B")
        os.write(self._fd, struct.pack("<QI", worker_id, view.nbytes // 4))
        while view:
            n = os.write(self._fd, view)
            view = view[n:]

    def cpu(self) -> Optional[float]:
        return proc_cpu_seconds(self.proc.pid)

    def close(self) -> Dict[str, Any]:
        try:
            self.proc.stdin.close()
            line = self.proc.stdout.readline()
            self.proc.wait(timeout=30)
            return json.loads(line) if line else {}
        except Exception as e:  # pragma: no cover - diagnostics only
            self.proc.kill()
            return {"error": str(e)}


class NullSelector:
    """No-op selector with the same call shape (harness overhead)."""

    def __init__(self, workers: int):
        self.workers = workers

    async def upsert_worker(self, w):
        return w

    def loads(self):
        return []

    async def select_and_reserve(self, req):
        tokens = req["token_ids"]
        n = len(tokens) if not isinstance(tokens, (bytes, memoryview)) else len(tokens) // 4
        wid = 1 + int(req["selection_id"][1:].split("g", 1)[0]) % self.workers  # sticky per session
        return {"selection_id": req["selection_id"], "worker_id": wid, "isl_tokens": n,
                "overlap": {"longest_matched": 0}}

    async def free_reservation(self, sid):
        return ()

    def shutdown(self):
        pass


class Session:
    __slots__ = ("sid", "gen", "turn", "length", "arr", "lst", "tokens")

    def __init__(self, sid: int):
        self.sid = sid
        self.gen = 0
        self.turn = 0
        self.length = 0
        self.arr = None  # numpy uint32, the whole generation's tokens (up to max_len)
        self.lst = None  # list form: the current prompt, grown in place
        self.tokens = None


class Workload:
    def __init__(self, a: argparse.Namespace, form: str):
        import numpy as np

        self.np = np
        self.a = a
        self.form = form
        self.min_len = a.prefix_tokens + max(1, a.turn_growth)
        self.max_len = max(self.min_len, 2 * a.mean_isl - self.min_len)
        span = (self.max_len - self.min_len) // max(1, a.turn_growth)
        self.prefix = np.random.default_rng([a.seed, 0x5EED]).integers(0, VOCAB, a.prefix_tokens, dtype=np.uint32)
        self.pool = list(range(VOCAB)) if form == "list" else None  # shared int objects
        start_rng = np.random.default_rng([a.seed, 0x57A7])
        self.sessions = []
        for sid in range(a.sessions):
            s = Session(sid)
            s.length = self.min_len + int(start_rng.integers(0, span + 1)) * a.turn_growth
            self._new_generation(s, keep_length=True)
            self.sessions.append(s)

    def _new_generation(self, s: Session, keep_length: bool = False) -> None:
        np = self.np
        if not keep_length:
            s.gen += 1
            s.length = self.min_len
        hist = np.random.default_rng([self.a.seed, s.sid, s.gen]).integers(
            0, VOCAB, self.max_len - self.a.prefix_tokens, dtype=np.uint32)
        s.arr = np.concatenate([self.prefix, hist])
        if self.form == "list":
            s.lst = list(map(self.pool.__getitem__, s.arr[: s.length].tolist()))

    def prompt(self, s: Session):
        """(selector form, mocker bytes) of the session's current prompt."""
        view = s.arr[: s.length]
        if self.form == "list":
            tokens = s.lst
        elif self.form == "numpy":
            tokens = view
        else:
            tokens = view.tobytes()
        return tokens, view

    def advance(self, s: Session) -> None:
        s.turn += 1
        new_len = s.length + self.a.turn_growth
        if new_len > self.max_len:
            self._new_generation(s)
            return
        if self.form == "list":
            s.lst.extend(map(self.pool.__getitem__, s.arr[s.length:new_len].tolist()))
        s.length = new_len


class Stats:
    """Per-call records of one mode; summarised over the window actually
    measured (the CPU snapshots' times)."""

    def __init__(self):
        self.ok: List[tuple] = []  # (t0, t1, isl_tokens, longest_matched)
        self.err: List[tuple] = []  # (t0, message)

    def call(self, t0: float, t1: float, isl: int, matched: int) -> None:
        self.ok.append((t0, t1, isl, matched))

    def error(self, t0: float, e: BaseException) -> None:
        self.err.append((t0, f"{type(e).__name__}: {e}"))

    def summary(self, w0: float, w1: float) -> Dict[str, Any]:
        calls = [c for c in self.ok if c[0] >= w0 and c[1] <= w1]
        errs = [e for e in self.err if w0 <= e[0] < w1]
        return {
            "calls": len(calls),
            "lat": sorted(c[1] - c[0] for c in calls),
            "isl": sum(c[2] for c in calls),
            "matched": sum(c[3] for c in calls),
            "errors": len(errs),
            "first_error": errs[0][1] if errs else None,
        }


class Runner:
    def __init__(self, a: argparse.Namespace, svc, mocker: Mocker, wl: Workload):
        self.a, self.svc, self.mocker, self.wl = a, svc, mocker, wl
        self.outstanding = set()

    async def turn(self, s: Session, stats: Optional[Stats], decode_s: float, tick=None) -> None:
        tokens, view = self.wl.prompt(s)
        sid = f"s{s.sid}g{s.gen}t{s.turn}"
        if tick is not None:
            tick()
        t0 = time.perf_counter()
        try:
            r = await self.svc.select_and_reserve({"token_ids": tokens, "selection_id": sid})
        except Exception as e:  # counted, then the session moves on
            if stats is not None:
                stats.error(t0, e)
            await asyncio.sleep(0.02)
            self.wl.advance(s)
            return
        t1 = time.perf_counter()
        self.outstanding.add(sid)
        if stats is not None:
            stats.call(t0, t1, r["isl_tokens"], r["overlap"]["longest_matched"])
        if tick is not None:
            tick()
        self.mocker.serve(r["worker_id"], view)
        self.wl.advance(s)  # the prompt object is not used after this point
        if decode_s > 0:
            await asyncio.sleep(decode_s)
        try:
            await self.svc.free_reservation(sid)
        except Exception as e:
            if stats is not None:
                stats.error(t0, e)
        self.outstanding.discard(sid)

    async def prime(self) -> float:
        """Every session's first turn, unmeasured (fills the fleet's caches)."""
        t = time.perf_counter()
        sem = asyncio.Semaphore(max(1, self.a.prime_concurrency))

        async def one(s):
            async with sem:
                await self.turn(s, None, 0.0)

        await asyncio.gather(*(one(s) for s in self.wl.sessions))
        return time.perf_counter() - t

    async def run_mode(self, mode: str) -> Dict[str, Any]:
        a = self.a
        stats = Stats()
        loop_start = time.perf_counter()
        w0 = loop_start + a.warmup
        w1 = w0 + a.duration
        snap: Dict[str, Any] = {}

        def tick():
            """Take the window's start/end snapshot once its time has come.
            Called around every call and by two timers, so the snapshots are
            taken on time even if the selector never yields to the loop."""
            now = time.perf_counter()
            if "start" not in snap and now >= w0:
                snap["start"] = (time.perf_counter(), cpu_seconds(), self.mocker.cpu(), machine_busy())
            if "end" not in snap and now >= w1:
                snap["end"] = (time.perf_counter(), cpu_seconds(), self.mocker.cpu(), machine_busy())

        async def timer(at):
            await asyncio.sleep(max(0.0, at - time.perf_counter()))
            tick()

        snappers = [asyncio.ensure_future(timer(w0)), asyncio.ensure_future(timer(w1))]
        sessions = list(self.wl.sessions)
        if mode == "paced":
            every = 1.0 / a.rate
            idle: asyncio.Queue = asyncio.Queue()
            for s in sessions:
                idle.put_nowait(s)
            tasks = set()

            async def run_one(s):
                try:
                    await self.turn(s, stats, a.decode_s, tick)
                finally:
                    idle.put_nowait(s)

            nxt = loop_start
            while True:
                tick()
                now = time.perf_counter()
                if now >= w1:
                    break
                if nxt > now:
                    await asyncio.sleep(nxt - now)
                nxt = max(nxt + every, time.perf_counter() - every)  # no backlog bursts
                if time.perf_counter() >= w1:
                    break
                try:
                    s = idle.get_nowait()
                except asyncio.QueueEmpty:
                    continue  # every session busy: the offered rate falls short
                t = asyncio.ensure_future(run_one(s))
                tasks.add(t)
                t.add_done_callback(tasks.discard)
            if tasks:
                await asyncio.wait(tasks, timeout=60)
        else:
            conc = a.saturated_concurrency or len(sessions)
            queue: asyncio.Queue = asyncio.Queue()
            for s in sessions:
                queue.put_nowait(s)

            async def loop_worker():
                while time.perf_counter() < w1:
                    s = await queue.get()
                    try:
                        await self.turn(s, stats, 0.0, tick)
                    finally:
                        queue.put_nowait(s)
                    # One pass through the loop per turn, so the sessions
                    # interleave even when a call completes synchronously.
                    await asyncio.sleep(0)

            await asyncio.wait([asyncio.ensure_future(loop_worker()) for _ in range(conc)], timeout=a.warmup + a.duration + 120)
        await asyncio.gather(*snappers)
        (t_a, cpu_a, mock_a, busy_a), (t_b, cpu_b, mock_b, busy_b) = snap["start"], snap["end"]
        wall = t_b - t_a
        st = stats.summary(t_a, t_b)
        lat = st["lat"]
        cpu = cpu_b - cpu_a
        out = {
            "mode": mode,
            "offered_rate": a.rate if mode == "paced" else None,
            "decode_s": a.decode_s if mode == "paced" else 0.0,
            "concurrency": None if mode == "paced" else (a.saturated_concurrency or len(sessions)),
            "window_s": round(wall, 3),
            "calls": st["calls"],
            "errors": st["errors"],
            "first_error": st["first_error"],
            "calls_per_s": round(st["calls"] / wall, 2) if wall > 0 else 0.0,
            "cpu_s": round(cpu, 3),
            "cpu_ms_per_call": round(1000 * cpu / st["calls"], 3) if st["calls"] else None,
            "cores_used": round(cpu / wall, 3) if wall > 0 else None,
            "p50_ms": round(1000 * percentile(lat, 0.50), 3),
            "p99_ms": round(1000 * percentile(lat, 0.99), 3),
            "max_ms": round(1000 * lat[-1], 3) if lat else 0.0,
            "mean_isl": round(st["isl"] / st["calls"], 1) if st["calls"] else 0.0,
            "kv_hit_ratio": round(st["matched"] / st["isl"], 4) if st["isl"] else 0.0,
            "mocker_cores": round((mock_b - mock_a) / wall, 3) if mock_a is not None and mock_b is not None else None,
        }
        if busy_a and busy_b:
            hz = os.sysconf("SC_CLK_TCK")
            busy = (busy_b[0] - busy_a[0]) / hz / wall
            out["machine_cores_busy"] = round(busy, 3)
            out["other_cores_busy"] = round(busy - out["cores_used"] - (out["mocker_cores"] or 0.0), 3)
        return out


async def wait_registered(svc, n: int, timeout: float = 60.0) -> None:
    deadline = time.perf_counter() + timeout
    while True:
        rows = sum(len(p["loads"]) for p in svc.loads())
        if rows >= n:
            return
        if time.perf_counter() > deadline:
            raise SystemExit(f"only {rows} of {n} workers became schedulable")
        await asyncio.sleep(0.05)


async def child_main(a: argparse.Namespace) -> Dict[str, Any]:
    form = a.input_form
    if form == "auto":
        form = "numpy" if a.impl == "kvselect" else "list"
    import numpy  # noqa: F401  (token generation; fail early)

    if a.impl == "dynamo":
        os.environ.setdefault("DYN_LOG", "error")
        from dynamo._core import SelectionService

        version = _dist_version("ai-dynamo-runtime")
        svc = SelectionService(indexer_threads=a.indexer_threads)
    elif a.impl == "kvselect":
        import kvselect

        version = getattr(kvselect, "__version__", "?")
        svc = kvselect.SelectionService(indexer_threads=a.indexer_threads)
    else:
        version = None
        svc = NullSelector(a.workers)
    modes = ["paced", "saturated"] if a.mode == "both" else [a.mode]
    budget = 600 + len(modes) * (a.warmup + a.duration + 180)
    t_setup = time.perf_counter()
    wl = Workload(a, form)
    mocker = Mocker(a.mocker, a.workers, a.block_size, a.capacity_blocks, budget)
    try:
        for ep in mocker.endpoints:
            rec = await svc.upsert_worker({
                "worker_id": ep["worker_id"],
                "endpoint": f"http://127.0.0.1:9/mock/{ep['worker_id']}",
                "block_size": a.block_size,
                "kv_events_endpoints": {0: ep["kv_events_endpoint"]},
                "replay_endpoint": ep["replay_endpoint"],
            })
            if a.impl != "null" and rec["lifecycle"] != "schedulable":
                raise SystemExit(f"worker {ep['worker_id']} not schedulable: {rec}")
        if a.impl != "null":
            await wait_registered(svc, a.workers)
        setup_s = time.perf_counter() - t_setup
        runner = Runner(a, svc, mocker, wl)
        prime_s = await runner.prime()
        results = []
        for mode in modes:
            _log(f"[{a.impl}/{form}] {mode}: warmup {a.warmup}s + {a.duration}s ...")
            r = await runner.run_mode(mode)
            _log(f"[{a.impl}/{form}] {mode}: {r['calls_per_s']} calls/s, "
                 f"{r['cpu_ms_per_call']} CPU ms/call, p50 {r['p50_ms']} ms, p99 {r['p99_ms']} ms, "
                 f"errors {r['errors']}, hit {r['kv_hit_ratio']}")
            results.append(r)
    finally:
        svc.shutdown()
        mock_summary = mocker.close()
    return {
        "impl": a.impl, "version": version, "input_form": form, "python": sys.version.split()[0],
        "workers": a.workers, "sessions": a.sessions, "prefix_tokens": a.prefix_tokens,
        "mean_isl_target": a.mean_isl, "turn_growth": a.turn_growth, "seed": a.seed,
        "indexer_threads": a.indexer_threads, "setup_s": round(setup_s, 2), "prime_s": round(prime_s, 2),
        "mocker": mock_summary, "modes": results,
    }


def _dist_version(name: str) -> Optional[str]:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:
        return None


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------
# Driver


def run_child(python: str, a: argparse.Namespace, impl: str, form: str) -> Optional[Dict[str, Any]]:
    args = [python, str(Path(__file__).resolve()), "--child", "--impl", impl, "--input-form", form]
    for k in ("mode", "mocker", "duration", "warmup", "rate", "decode_s", "saturated_concurrency", "workers",
              "sessions", "prefix_tokens", "mean_isl", "turn_growth", "block_size", "capacity_blocks",
              "indexer_threads", "prime_concurrency", "seed"):
        args += ["--" + k.replace("_", "-"), str(getattr(a, k))]
    env = dict(os.environ)
    env.setdefault("DYN_LOG", "error")
    _log(f"== {impl} ({form}) with {python}")
    proc = subprocess.run(args, stdout=subprocess.PIPE, env=env, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG):])
    _log(f"== {impl} failed (exit {proc.returncode})")
    return None


def ratio(x, y):
    if x is None or y in (None, 0):
        return None
    return round(x / y, 3)


def print_table(runs: List[Dict[str, Any]]) -> None:
    cols = [("impl", 16), ("mode", 10), ("calls/s", 9), ("CPU ms/call", 12), ("cores", 6), ("p50 ms", 9),
            ("p99 ms", 9), ("errors", 7), ("KV hit", 7), ("mean ISL", 9), ("other cores", 11)]
    print(" ".join(f"{c:>{w}}" for c, w in cols))
    for run in runs:
        for m in run["modes"]:
            vals = [f"{run['impl']}/{run['input_form']}", m["mode"], m["calls_per_s"], m["cpu_ms_per_call"],
                    m["cores_used"], m["p50_ms"], m["p99_ms"], m["errors"], m["kv_hit_ratio"], m["mean_isl"],
                    m.get("other_cores_busy")]
            print(" ".join(f"{str(v):>{w}}" for v, (_, w) in zip(vals, cols)))


def driver_main(a: argparse.Namespace) -> int:
    impls = ["kvselect", "dynamo"] if a.impl == "both" else [a.impl]
    runs: List[Dict[str, Any]] = []
    forms_used = []
    for impl in impls:
        python = a.python_dynamo if impl == "dynamo" else a.python_kvselect
        form = a.input_form if a.input_form != "auto" else ("numpy" if impl == "kvselect" else "list")
        forms_used.append(form)
        r = run_child(python, a, impl, form)
        if r is not None:
            runs.append(r)
    if a.impl != "null" and a.null_forms != "none":
        nf = {"auto": sorted(set(forms_used)), "both": ["list", "numpy"]}.get(a.null_forms, [a.null_forms])
        for form in nf:
            r = run_child(a.python_kvselect, a, "null", form)
            if r is not None:
                runs.append(r)
    if not runs:
        return 1
    print()
    print_table(runs)
    by = {r["impl"]: r for r in runs if r["impl"] != "null"}
    ratios = {}
    if "kvselect" in by and "dynamo" in by:
        for mk, md in zip(by["kvselect"]["modes"], by["dynamo"]["modes"]):
            ratios[mk["mode"]] = {
                "cpu_ms_per_call": ratio(mk["cpu_ms_per_call"], md["cpu_ms_per_call"]),
                "calls_per_s": ratio(mk["calls_per_s"], md["calls_per_s"]),
                "p50_ms": ratio(mk["p50_ms"], md["p50_ms"]),
                "p99_ms": ratio(mk["p99_ms"], md["p99_ms"]),
                "kv_hit_ratio": ratio(mk["kv_hit_ratio"], md["kv_hit_ratio"]),
            }
        print("\nkvselect / dynamo:")
        for mode, rr in ratios.items():
            print(f"  {mode:>10}: " + ", ".join(f"{k} x{v}" for k, v in rr.items()))
    out = {"bench": "embedded", "runs": runs, "ratios_kvselect_vs_dynamo": ratios or None}
    line = json.dumps(out, separators=(",", ":"))
    print(line)
    if a.json_out:
        Path(a.json_out).write_text(line + "\n")
    return 0


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.child:
        if a.impl == "both":
            raise SystemExit("--child needs one --impl")
        res = asyncio.run(child_main(a))
        print(RESULT_TAG + json.dumps(res, separators=(",", ":")), flush=True)
        return 0
    return driver_main(a)


if __name__ == "__main__":
    sys.exit(main())
