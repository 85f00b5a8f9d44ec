#!/usr/bin/python3
"""The hostile review of the gRPC port (2026-12-05) at its own sizes, against one attnserve binary run with
its default flags: each row starts a server, holds a well-behaved caller (a process of its own: small
Attend calls from 127.0.0.1, one after another) through the attack, samples the server's resident
memory, then sends SIGTERM while the attack still holds what it took. One line a row, and JSON.
tests/integration/attack_test.py runs the same attacks at small sizes in CI.

usage: bench/attack.py BUILD/attnserve [--rows 1,2,...] [--out DIR]
       (run it on the binary before and after a change, on the same machine: docs/benchmarks.md)
Row 1 opens 20,100 connections: the shell's hard limit on open files must allow 10,050 a process.
"""
import argparse
import json
import os
import platform
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "lib"))
import attnserve_py as lib  # noqa: E402
import h2_raw as h2  # noqa: E402
import numpy as np  # noqa: E402

ATTACKER = "127.0.0.2"
H2_RAW = os.path.join(HERE, "..", "tests", "lib", "h2_raw.py")


def request_file(rows, folder):
    pb = lib.load_stubs()[0]
    rng = np.random.default_rng(rows)
    body = pb.AttendRequest(model="demo", query=lib.to_wire(pb, rng.standard_normal((1, rows, 512)))
                            ).SerializeToString()
    path = os.path.join(folder, f"attend-{rows}.bin")
    with open(path, "wb") as f:
        f.write(body)
    return path, body


class Row:
    """One attack: a server, the well-behaved caller, the memory sampled, the stop."""

    def __init__(self, binary, small_path, seconds, *args):
        self.server = lib.Server(binary, "--no-warmup", *args)
        self.pid = self.server.proc.pid
        self.idle = lib.status_kb(self.pid, "VmRSS") / 1024
        self.peak = 0.0
        self._stop = threading.Event()
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()
        self.caller = subprocess.Popen([sys.executable, H2_RAW, "well-behaved", str(self.server.port), str(seconds),
                                        small_path], stdout=subprocess.PIPE, text=True)
        time.sleep(0.5)

    def _sample(self):
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, lib.status_kb(self.pid, "VmRSS") / 1024 - self.idle)
            except OSError:
                return
            self._stop.wait(0.05)

    def finish(self, **found):
        caller = json.loads(self.caller.communicate(timeout=120)[0] or "{}")
        t0 = time.monotonic()
        self.server.proc.send_signal(signal.SIGTERM)
        try:
            code = self.server.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.server.proc.kill()
            code = "killed after 60 s"
        self._stop.set()
        return dict(found, idle_mib=round(self.idle), peak_growth_mib=round(self.peak), caller=caller,
                    stop_s=round(time.monotonic() - t0, 2), exit=code)


def metric(server, name, **labels):
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    try:
        lines = lib.metrics_lines(server, name)
    except OSError:
        return None
    for line in lines:
        if (not want and line.startswith(name + " ")) or (want and "{" + want + "}" in line):
            return float(line.split()[-1])
    return 0.0


def row1(binary, small, big):
    """20,100 idle TCP connections (two processes of 10,050, each from 40 addresses 127.0.N.x), held 10 s,
    then closed."""
    r = Row(binary, small, 16)
    flood = []
    for n in range(2):
        script = (f"import resource, socket, time\n"
                  f"resource.setrlimit(resource.RLIMIT_NOFILE, (10100, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))\n"
                  f"s = []\n"
                  f"for i in range(10050):\n"
                  f"    c = socket.socket(); c.setblocking(False); c.bind(('127.0.{10 + n}.' + str(1 + i % 40), 0))\n"
                  f"    c.connect_ex(('127.0.0.1', {r.server.port})); s.append(c)\n"
                  f"time.sleep(10)\n")
        flood.append(subprocess.Popen([sys.executable, "-c", script]))
    time.sleep(5)
    held = metric(r.server, "attnserve_connections")
    for f in flood:
        f.wait()
    ended = time.monotonic()
    import grpc
    took = None
    while time.monotonic() - ended < 10 and took is None:
        with grpc.insecure_channel(r.server.target) as channel:
            try:
                channel.unary_unary(h2.ATTEND)(open(small, "rb").read(), timeout=0.5)
                took = time.monotonic() - ended
            except grpc.RpcError:
                pass
    refused = {k: metric(r.server, "attnserve_connections_refused_total", reason=k)
               for k in ("max_connections", "peer_connections", "fd_limit")}
    return r.finish(connections_held=held, new_connection_answered_s=took, refused=refused)


def row2(binary, small, big):
    """A header value announced as 2 GiB, its block sent on as CONTINUATION frames at ~1.5 MB/s a connection,
    from 2 connections, for 15 s (a connection the server closes is opened again)."""
    r = Row(binary, small, 16)
    stop, opened = threading.Event(), [0]

    def trickle():
        while not stop.is_set():
            c = h2.Conn(r.server.port, source=ATTACKER)
            opened[0] += 1
            c.settled.wait(5)
            c.send(h2.frame(h2.HEADERS, 0, 1, h2.request_headers() + b"\x00" + h2.hpack_int(9, 7) + b"x-padding" +
                            h2.hpack_int(2 << 30, 7)))
            while not stop.is_set() and c.send(h2.frame(h2.CONTINUATION, 0, 1, b"a" * 16384)):
                time.sleep(0.01)
            c.close()
    threads = [threading.Thread(target=trickle, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    time.sleep(15)
    stop.set()
    return r.finish(connections_opened=opened[0])


def row3(binary, small, big):
    """gzip: 4.17 MB to Attend and 1 MB to ModelInfer (zeros: ~4 GiB and ~1 GiB inflated)."""
    r = Row(binary, small, 12)
    outcome = {}
    for path, inflated in ((h2.ATTEND, 4 << 30), ("/inference.GRPCInferenceService/ModelInfer", 1 << 30)):
        bomb = h2.gzip_bomb(inflated, chunk=16 << 20)
        c = h2.Conn(r.server.port, source=ATTACKER)
        t0 = time.monotonic()
        sid = c.call(bomb, path=path, extra=[("grpc-encoding", "gzip")], compressed=True)
        lib.wait_until(lambda: sid in c.ended or sid in c.resets or c.closed.is_set(), 60, 0.02)
        outcome[path.rsplit("/", 1)[1]] = {"compressed_bytes": len(bomb), "ended_s": round(time.monotonic() - t0, 2)}
        c.close()
    time.sleep(2)
    return r.finish(**outcome)


def row4(binary, small, big):
    """HEADERS-only streams left open: 200,000 Attend and 100,000 AttendStream, on one connection each."""
    r = Row(binary, small, 14)
    outcome = {}
    conns = []
    for path, n in ((h2.ATTEND, 200000), (h2.ATTEND_STREAM, 100000)):
        c = h2.Conn(r.server.port, source=ATTACKER)
        block = h2.request_headers(path)
        sent = 0
        for at in range(0, n, 5000):
            if not c.send(b"".join(h2.frame(h2.HEADERS, h2.END_HEADERS, 2 * i + 1, block)
                                   for i in range(at, min(n, at + 5000)))):
                break
            sent = min(n, at + 5000)
        outcome[path.rsplit("/", 1)[1]] = {"sent": sent, "closed": c.wait_closed(3)}
        conns.append(c)
    time.sleep(6)
    result = r.finish(**outcome)
    for c in conns:
        c.close()
    return result


def row5(binary, small, big):
    """A caller announcing a receive window of zero and never reading, 80 calls asking 8 MiB answers each."""
    r = Row(binary, small, 14)
    body = open(big, "rb").read()
    c = h2.Conn(r.server.port, source=ATTACKER, settings={h2.SETTINGS_INITIAL_WINDOW_SIZE: 0})
    sids = []
    for _ in range(80):
        sid = c.open_stream()
        sids.append(sid)
        if not c.send_data(sid, h2.grpc_message(body), end=True, timeout=5):
            break
    time.sleep(8)
    refused = sum(s in c.ended for s in sids)
    result = r.finish(calls=len(sids), refused_at_once=refused, cancelled=sum(s in c.resets for s in sids),
                      send_timeouts=metric(r.server, "attnserve_send_timeouts_total"))
    c.close()
    return result


def row6(binary, small, big):
    """Uploads left one byte short: 120 x 60 MB on one connection."""
    r = Row(binary, small, 20)
    c = h2.Conn(r.server.port, source=ATTACKER)
    short = h2.grpc_message(bytes(60_000_000))[:-1]
    sids = [c.open_stream() for _ in range(120)]
    whole = [0]

    def upload(sid):
        if c.send_data(sid, short, timeout=5):
            whole[0] += 1
    threads = [threading.Thread(target=upload, args=(s,), daemon=True) for s in sids]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    time.sleep(2)
    result = r.finish(uploads=120, sent_whole_but_one_byte=whole[0], closed=c.closed.is_set())
    c.close()
    return result


def row7(binary, small, big):
    """Rapid reset: Attend calls sent and reset at once, 10 s, on one connection (reopened when closed)."""
    r = Row(binary, small, 14)
    time.sleep(1)
    out = subprocess.run([sys.executable, H2_RAW, "rapid-reset", str(r.server.port), "10", small, ATTACKER],
                         capture_output=True, text=True).stdout.strip()
    return r.finish(attacker=out)


def row8(binary, small, big):
    """One greedy caller: 1,500 small calls in flight at once (12 connections of 125), 10 s."""
    r = Row(binary, small, 12)
    out = subprocess.run([sys.executable, H2_RAW, "greedy", str(r.server.port), "11", small, ATTACKER],
                         capture_output=True, text=True).stdout.strip()
    return r.finish(attacker=out, refused={k: metric(r.server, "attnserve_rejections_total", model="demo", reason=k)
                                           for k in ("queue_full", "pushed_out")})


def row9(binary, small, big):
    """/metrics scraped every 50 ms while 2 connections trickle their requests a byte every 200 ms."""
    r = Row(binary, small, 12)
    url = f"http://127.0.0.1:{r.server.metrics_port}/metrics"

    def scrape():
        t0 = time.monotonic()
        try:
            urllib.request.urlopen(url, timeout=40).read()
        except OSError:
            return float("inf")
        return time.monotonic() - t0
    unloaded = sorted(scrape() for _ in range(20))
    stop = threading.Event()

    def trickle():
        while not stop.is_set():
            s = socket.create_connection(("127.0.0.1", r.server.metrics_port))
            try:
                for b in b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 4000:
                    if stop.is_set():
                        break
                    s.send(bytes([b]))
                    stop.wait(0.2)
            except OSError:
                pass
            s.close()
    threads = [threading.Thread(target=trickle, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    loaded, t0 = [], time.monotonic()
    while time.monotonic() - t0 < 10:
        loaded.append(scrape())
        time.sleep(0.05)
    stop.set()
    loaded.sort()
    return r.finish(scrape_unloaded_p99_ms=round(unloaded[-1] * 1e3, 1), scrapes=len(loaded),
                    scrape_p99_ms=round(loaded[min(len(loaded) - 1, int(len(loaded) * 0.99))] * 1e3, 1),
                    scrape_max_ms=round(loaded[-1] * 1e3, 1))


ROWS = {1: row1, 2: row2, 3: row3, 4: row4, 5: row5, 6: row6, 7: row7, 8: row8, 9: row9}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("binary")
    ap.add_argument("--rows", default="1,2,3,4,5,6,7,8,9")
    ap.add_argument("--out", default=os.path.join(HERE, "out-attack"))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    folder = lib.temp_dir("attnserve-attack-")
    small, _ = request_file(4, folder)
    big, _ = request_file(4096, folder)  # 8 MiB in, 8 MiB out
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    print(f"attack: {args.binary} on {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"open files {soft}/{hard}", flush=True)
    results = {}
    for n in (int(x) for x in args.rows.split(",")):
        t0 = time.monotonic()
        results[n] = ROWS[n](args.binary, small, big)
        print(f"row {n} ({time.monotonic() - t0:.0f} s): {json.dumps(results[n])}", flush=True)
    path = os.path.join(args.out, f"attack-{int(time.time())}.json")
    with open(path, "w") as f:
        json.dump({"binary": args.binary, "rows": results}, f, indent=1)
    print(f"attack: written {path}")


if __name__ == "__main__":
    main()
