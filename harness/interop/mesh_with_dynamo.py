"""A kvselect replica and a Dynamo 1.6.1 replica on one mesh: bookings,
prefill completions, frees and session bindings must cross both ways.

    python3 harness/interop/mesh_with_dynamo.py [KVSELECT_BIN] [DYNAMO_PYTHON]

Defaults: target/release/kvselect and /opt/dynamo-venv/bin/python (a venv
with `pip install ai-dynamo-runtime==1.6.1`). Uses ports 19411-19422 and
39601-39602 on loopback. Exits 1 if anything did not cross.
"""
import json, subprocess, sys, time, urllib.request
BIN = sys.argv[1] if len(sys.argv) > 1 else "target/release/kvselect"
DYN_PY = sys.argv[2] if len(sys.argv) > 2 else "/opt/dynamo-venv/bin/python"
KV, DY = 19411, 19412          # HTTP ports
KVP, DYP = 19421, 19422        # replica PUB ports
FAILED = []
def req(port, method, path, body=None):
    data = None if body is None else json.dumps(body).encode()
    r = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(r, timeout=5) as f:
            return f.status, json.loads(f.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")
    except Exception as e:
        return "ERR", str(e)
procs = [
    subprocess.Popen([BIN, "--port", str(KV), "--replica-sync-port", str(KVP), "--replica-sync-peers", f"tcp://127.0.0.1:{DYP}", "--session-affinity-ttl-secs", "60"], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT),
    subprocess.Popen([DYN_PY, "-m", "dynamo.select_service", "--port", str(DY), "--replica-sync-port", str(DYP), "--replica-sync-peers", f"tcp://127.0.0.1:{KVP}", "--session-affinity-ttl-secs", "60"], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT),
]
def rows(port):
    s, v = req(port, "GET", "/loads")
    return {r["worker_id"]: (r["potential_prefill_tokens"], r["potential_decode_blocks"], r["active_requests"]) for p in v for r in p["loads"]} if s == 200 else v
def check(name, ok):
    if not ok:
        FAILED.append(name)
    return "crossed" if ok else "NOT crossed"
def wait(cond, t=5):
    end = time.time() + t
    while time.time() < end:
        if cond(): return True
        time.sleep(0.05)
    return False
try:
    for port in (KV, DY):
        assert wait(lambda: req(port, "GET", "/health")[0] == 200, 30), port
    for port in (KV, DY):
        for w in (1, 2):
            req(port, "POST", "/workers", {"worker_id": w, "model_name": "m", "endpoint": f"http://w{w}", "block_size": 16, "kv_events_endpoints": {"0": f"tcp://127.0.0.1:{39600+w}"}})
    time.sleep(2)
    print("peers kv", req(KV, "GET", "/replica_sync/peers"), "dy", req(DY, "GET", "/replica_sync/peers"))
    for src, dst, name in ((KV, DY, "kvselect->dynamo"), (DY, KV, "dynamo->kvselect")):
        sid = f"sel-{src}"
        s, r = req(src, "POST", "/select_and_reserve", {"model_name": "m", "selection_id": sid, "session_id": f"S{src}", "token_ids": list(range(1, 100))})
        w = r["worker_id"]
        ok = wait(lambda: rows(dst).get(w, (0, 0, 0))[2] == 1)
        print(name, "book:", s, "worker", w, "src", rows(src)[w], "dst", rows(dst)[w], check(name + " book", ok))
        s2, r2 = req(dst, "POST", "/select_and_reserve", {"model_name": "m", "selection_id": sid, "token_ids": [1]})
        print(name, "same id booked on the peer:", s2, r2 if s2 != 200 else "")
        req(src, "POST", f"/reservations/{sid}/prefill_complete")
        ok = wait(lambda: rows(dst).get(w, (1, 0, 0))[0] == 0)
        print(name, "prefill_complete:", "src", rows(src)[w], "dst", rows(dst)[w], check(name + " prefill", ok))
        # session binding: load w on dst so an unbound request would avoid it
        for i in range(3):
            req(dst, "POST", "/select_and_reserve", {"model_name": "m", "selection_id": f"pin-{src}-{i}", "pinned_worker": {"worker_id": w, "dp_rank": 0}, "token_ids": list(range(5000+100*i, 5064+100*i))})
        s3, r3 = req(dst, "POST", "/select", {"model_name": "m", "session_id": f"S{src}", "token_ids": [7, 8, 9]})
        s4, r4 = req(dst, "POST", "/select", {"model_name": "m", "token_ids": [7, 8, 9]})
        print(name, "session on peer ->", r3.get("worker_id"), "(bound", w, ") unbound ->", r4.get("worker_id"), "binding", check(name + " binding", r3.get("worker_id") == w and r4.get("worker_id") != w))
        for i in range(3):
            req(dst, "DELETE", f"/reservations/pin-{src}-{i}")
        req(src, "DELETE", f"/reservations/{sid}")
        ok = wait(lambda: rows(dst).get(w, (0, 0, 1))[2] == 0 and rows(src).get(w, (0,0,1))[2] == 0)
        print(name, "free:", "src", rows(src)[w], "dst", rows(dst)[w], check(name + " free", ok))
        if s2 != 409:
            FAILED.append(name + " id taken")
finally:
    for p in procs: p.terminate()
    for p in procs: p.wait()
print("FAILED: " + ", ".join(FAILED) if FAILED else "all crossed both ways")
sys.exit(1 if FAILED else 0)
