"""Server CPU per small HTTP call, back to back and paced.

Starts BIN (`BIN --port 0 --cores 0`, the whole process on core 0), pins
this client to core 1 where there is one, and sends calls on one keep-alive connection: `GET
/health`, then `POST /reservations/nope/output_block` (a 404 through the
reservation table). Each kind runs back to back (20,000 calls) and paced
(3,000 calls with a 3 ms pause between them, as a paced turn's lifecycle
calls arrive); the server's CPU ticks are read from /proc around each run.

    python3 harness/scripts/small_call_cpu.py target/release/kvselect
"""

import os
import socket
import sys
import time

from idle_wakeups import cpu_ticks, start


def request(method, path):
    body = b"{}" if method == "POST" else b""
    head = (
        f"{method} {path} HTTP/1.1\r\nHost: k\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def call(s, req):
    """Sends `req` and reads its whole response; returns the status line."""
    s.sendall(req)
    buf = b""
    while True:
        chunk = s.recv(65536)
        if not chunk:
            sys.exit("the server closed the connection")
        buf += chunk
        head, sep, rest = buf.partition(b"\r\n\r\n")
        if not sep:
            continue
        lines = head.split(b"\r\n")
        length = next(
            int(l.split(b":")[1]) for l in lines if l.lower().startswith(b"content-length")
        )
        if len(rest) >= length:
            return lines[0].decode()


def main():
    binary = sys.argv[1]
    proc, addr = start(binary, ["--cores", "0"], lambda: os.sched_setaffinity(0, {0}))
    if 1 in os.sched_getaffinity(0):
        os.sched_setaffinity(0, {1})
    try:
        s = socket.create_connection(addr)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for method, path in [("GET", "/health"), ("POST", "/reservations/nope/output_block")]:
            req = request(method, path)
            for n, pause in [(20_000, 0.0), (3_000, 0.003)]:
                for _ in range(200):
                    call(s, req)
                t0 = cpu_ticks(proc.pid)
                for _ in range(n):
                    status = call(s, req)
                    if pause:
                        time.sleep(pause)
                t1 = cpu_ticks(proc.pid)
                # A tick is 10 ms: (ticks * 10,000 µs) / calls.
                print(
                    f"{method} {path} pause {pause * 1000:.0f} ms: {status}, "
                    f"server CPU per call {(t1 - t0) * 10_000 / n:.1f} us"
                )
    finally:
        proc.kill()


if __name__ == "__main__":
    main()
