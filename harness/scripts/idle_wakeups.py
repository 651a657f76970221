"""Wake-ups of an idle kvselect that holds many keep-alive connections.

Starts BIN (`BIN --port 0 --cores 0`), opens N connections, sends one
`GET /health` on each and keeps them open, then reads the process's
voluntary context switches (all threads) and CPU ticks from /proc over 10 s.

    python3 harness/scripts/idle_wakeups.py target/release/kvselect [N]
"""

import glob
import re
import resource
import socket
import subprocess
import sys
import time


def wakeups(pid):
    total = 0
    for path in glob.glob(f"/proc/{pid}/task/*/status"):
        with open(path) as f:
            for line in f:
                if line.startswith("voluntary_ctxt_switches"):
                    total += int(line.split()[1])
    return total


def cpu_ticks(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def start(binary, args, preexec_fn=None):
    """Starts `binary --port 0 ARGS`; returns the process and its address."""
    proc = subprocess.Popen(
        [binary, "--port", "0", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=preexec_fn,
    )
    for line in proc.stdout:
        m = re.search(r'addr="?([0-9.]+):([0-9]+)', line)
        if "listening" in line and m:
            return proc, (m.group(1), int(m.group(2)))
    proc.kill()
    sys.exit("kvselect did not start")


def main():
    binary = sys.argv[1]
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 1000
    resource.setrlimit(resource.RLIMIT_NOFILE, (n + 1024, n + 1024))
    proc, addr = start(binary, ["--cores", "0"])
    try:
        conns = []
        for _ in range(n):
            s = socket.create_connection(addr)
            s.sendall(b"GET /health HTTP/1.1\r\nHost: k\r\n\r\n")
            s.recv(4096)
            conns.append(s)
        time.sleep(3)
        w0, c0 = wakeups(proc.pid), cpu_ticks(proc.pid)
        time.sleep(10)
        w1, c1 = wakeups(proc.pid), cpu_ticks(proc.pid)
        print(
            f"{binary}: {n} idle connections, wake-ups/s {(w1 - w0) / 10:.1f}, "
            f"CPU ticks/s {(c1 - c0) / 10:.1f}"
        )
    finally:
        proc.kill()


if __name__ == "__main__":
    main()
