#!/usr/bin/python3
"""The gRPC port under attack: each way a hostile caller took the server down or slowed it for
everyone (a hostile review of 2026-12-05, docs/grpc-workarounds.md), at sizes that prove the bound in
seconds, against the real binary. Each test holds a well-behaved caller (a grpcio channel from
127.0.0.1 sending small Attend calls) through the attack and checks what the server held (its
resident memory, sampled) and whether it still takes connections; the attackers speak raw HTTP/2
(tests/lib/h2_raw.py), most from 127.0.0.2, another peer address on loopback. bench/attack.py runs
the same attacks at the review's sizes.

usage: python3 -m pytest attack_test.py --attnserve PATH/TO/attnserve
"""
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import numpy as np
import pytest  # noqa: F401

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
import attnserve_py as lib  # noqa: E402
import h2_raw as h2  # noqa: E402

PB = None
ATTACKER = "127.0.0.2"  # Loopback, another peer address than the well-behaved caller's.


def pb():
    global PB
    if PB is None:
        PB = lib.load_stubs()[0]
    return PB


def attend_bytes(rows, seed=1):
    rng = np.random.default_rng(seed)
    return pb().AttendRequest(model="demo", query=lib.to_wire(pb(), rng.standard_normal((1, rows, 512)))
                              ).SerializeToString()


class Rss:
    """Samples the server's resident memory (MiB) every 20 ms until stopped: the peak above the start."""

    def __init__(self, pid):
        self.pid, self.base, self.peak = pid, self.now(pid), 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def now(pid):
        return lib.status_kb(pid, "VmRSS") / 1024

    def _run(self):
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, self.now(self.pid) - self.base)
            except OSError:
                return
            self._stop.wait(0.02)

    def stop(self):
        self._stop.set()
        self._thread.join()
        return self.peak


def start(attnserve, *args, limits=None):
    return lib.Server(attnserve, "--no-warmup", *args, limits=limits)


def metric(server, name, **labels):
    """The value of one series of /metrics (0 when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in lib.metrics_lines(server, name):
        if (not want and line.startswith(name + " ")) or (want and "{" + want + "}" in line):
            return float(line.split()[-1])
    return 0.0


def stop_within(server, grace, checks, what):
    """SIGTERM: exit 0 within the grace period."""
    start_at = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    try:
        code = server.proc.wait(timeout=grace + 10)
    except Exception:
        server.proc.kill()
        code = server.proc.wait()
    took = time.monotonic() - start_at
    checks(f"{what}: SIGTERM exits 0", code == 0, f"exit {code}: {server.output()[-800:]}")
    checks(f"{what}: the stop within its grace ({grace} s)", took < grace, f"{took:.2f} s")


def well_behaved_holds(w, checks, what, p99_s=1.0):
    checks(f"{what}: the well-behaved caller answered throughout", w.count() > 0 and not w.errors, w.summary())
    checks(f"{what}: its p99 under {p99_s * 1e3:.0f} ms", w.percentile(99) < p99_s, w.summary())


def unloaded_p99(server, request, seconds=1.5):
    with h2.WellBehaved(server.target, request) as w:
        time.sleep(seconds)
    return w.percentile(99), w


def test_fd_flood_leaves_the_listener_accepting(attnserve, checks):
    """Row 1: idle connections past the descriptor limit. gRPC 1.51 logged accept4's EMFILE once and never
    accepted again (CVE-2023-4785). Now connections past --max-connections (lowered to half the descriptors the
    process may open) are closed as they arrive, and the listener accepts again within 1 s of the flood's end."""
    limit = 256
    server = start(attnserve, limits={"nofile": limit})
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4096)), hard))
    request = attend_bytes(4)
    flood = []
    with h2.WellBehaved(server.target, request) as w:
        for _ in range(3 * limit):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", server.port))
            flood.append(s)
        time.sleep(1.0)  # Held idle while the well-behaved caller goes on.
        for s in flood:
            s.close()
        ended = time.monotonic()
    well_behaved_holds(w, checks, "fd flood")
    # A new caller on a new connection, as soon as the flood is gone.
    import grpc
    answered_at = None
    while time.monotonic() - ended < 5 and answered_at is None:
        with grpc.insecure_channel(server.target) as channel:
            try:
                channel.unary_unary(h2.ATTEND)(request, timeout=0.5)
                answered_at = time.monotonic()
            except grpc.RpcError:
                pass
    took = (answered_at or float("inf")) - ended
    checks("fd flood: a new connection answered within 1 s of its end", took < 1.0, f"{took:.2f} s")
    refused = metric(server, "attnserve_connections_refused_total", reason="max_connections")
    checks("fd flood: connections past --max-connections refused as they came", refused > 0, str(refused))
    stop_within(server, 30, checks, "fd flood")


def test_a_header_block_trickled_or_too_big_is_cut(attnserve, checks):
    """Row 2: one header value announced as 2 GiB, sent on as CONTINUATION frames. gRPC 1.51 with its defaults
    copies what it has of the block again for each frame (CVE-2023-33953): a core busy, other callers
    unanswered. Now gRPC's own metadata bound is set (--max-metadata-bytes), and before its parser the guard
    cuts a block at --max-header-bytes as sent, at 16 frames, and at --header-timeout-seconds. Here the metadata
    bound is raised to 1 MiB, so that what cuts the blocks below 1 MiB is the guard's."""
    server = start(attnserve, "--header-timeout-seconds", "2", "--max-metadata-bytes", str(1 << 20))
    request = attend_bytes(4)
    headers = h2.request_headers()
    with h2.WellBehaved(server.target, request) as w:
        c = h2.Conn(server.port, source=ATTACKER)
        c.settled.wait(5)
        c.send(h2.frame(h2.HEADERS, 0, 1, headers + b"\x00" + h2.hpack_int(9, 7) + b"x-padding" +
                        h2.hpack_int(2 << 30, 7)))
        t0 = time.monotonic()
        while not c.closed.is_set() and time.monotonic() - t0 < 5:
            if not c.send(h2.frame(h2.CONTINUATION, 0, 1, b"a" * 16384)):
                break
        took = time.monotonic() - t0
        checks("a 2 GiB header value: the connection closed within 1 s", c.wait_closed(5) and took < 1,
               f"{took:.2f} s")
        # Valid headers, 96 KiB of them: past --max-header-bytes (64 KiB) before the block ends.
        big = h2.Conn(server.port, source=ATTACKER)
        big.settled.wait(5)
        pad = b"".join(h2.literal(f"x-pad-{i}", "v" * 90) for i in range(1000))
        big.send(h2.frame(h2.HEADERS, 0, 1, headers))
        for at in range(0, len(pad), 16384):
            big.send(h2.frame(h2.CONTINUATION, 0, 1, pad[at:at + 16384]))
        checks("96 KiB of headers: the connection closed", big.wait_closed(5))
        # A block of a few hundred bytes, a byte every quarter second: its time runs out.
        slow = h2.Conn(server.port, source=ATTACKER)
        slow.settled.wait(5)
        slow.send(h2.frame(h2.HEADERS, 0, 1, headers[:8]))
        t0 = time.monotonic()
        for b in headers[8:]:
            if slow.closed.is_set() or time.monotonic() - t0 > 8:
                break
            slow.send(h2.frame(h2.CONTINUATION, 0, 1, bytes([b])))
            time.sleep(0.25)
        took = time.monotonic() - t0
        checks("a header block trickled: closed at --header-timeout-seconds 2", slow.wait_closed(2) and took < 4,
               f"{took:.1f} s")
        # The same block begun, then nothing more: cut when its time is out, bytes or none.
        silent = h2.Conn(server.port, source=ATTACKER)
        silent.settled.wait(5)
        silent.send(h2.frame(h2.HEADERS, 0, 1, headers[:8]))
        t0 = time.monotonic()
        checks("a header block begun and left: closed within --header-timeout-seconds 2 and a second",
               silent.wait_closed(5) and time.monotonic() - t0 < 3.5, f"{time.monotonic() - t0:.1f} s")
        # The same block in 40 tiny frames at once: past 16 frames.
        tiny = h2.Conn(server.port, source=ATTACKER)
        tiny.settled.wait(5)
        tiny.send(h2.frame(h2.HEADERS, 0, 1, headers[:8]) +
                  b"".join(h2.frame(h2.CONTINUATION, 0, 1, headers[8 + i:9 + i]) for i in range(40)))
        checks("a header block in 40 tiny frames: closed", tiny.wait_closed(5))
    well_behaved_holds(w, checks, "header attacks")
    for reason in ("header_bytes", "header_timeout", "header_frames"):
        n = metric(server, "attnserve_connections_closed_total", reason=reason)
        checks(f"counted as {reason}", n >= 1, str(n))
    stop_within(server, 30, checks, "header attacks")


def test_compressed_requests_are_refused_before_they_inflate(attnserve, checks):
    """Row 3: grpc-encoding gzip. gRPC 1.51 inflates a message whole before it checks its size: 4 MB of gzip
    held 4.5 GB. Now compressed requests are refused (UNIMPLEMENTED naming the algorithm), on every method."""
    import grpc
    server = start(attnserve)
    with grpc.insecure_channel(server.target) as channel:
        try:
            channel.unary_unary(h2.ATTEND)(attend_bytes(4), timeout=10, compression=grpc.Compression.Gzip)
            checks("a gzip-compressed Attend: refused", False, "answered OK")
        except grpc.RpcError as e:
            checks("a gzip-compressed Attend: UNIMPLEMENTED naming gzip",
                   e.code() == grpc.StatusCode.UNIMPLEMENTED and "gzip" in (e.details() or ""),
                   f"{e.code()}: {e.details()}")
    rss = Rss(server.proc.pid)
    bomb = h2.gzip_bomb(256 << 20)  # ~0.25 MB that inflates to 256 MiB.
    for path in (h2.ATTEND, "/inference.GRPCInferenceService/ModelInfer"):
        c = h2.Conn(server.port, source=ATTACKER)
        sid = c.call(bomb, path=path, extra=[("grpc-encoding", "gzip")], compressed=True)
        ended = lib.wait_until(lambda: sid in c.ended or sid in c.resets or c.closed.is_set(), 10, 0.02)
        checks(f"a 256 MiB gzip bomb to {path}: ended at once", ended)
        c.close()
    peak = rss.stop()
    checks("... and the server grew by under 64 MiB", peak < 64, f"+{peak:.0f} MiB")
    stop_within(server, 30, checks, "gzip bombs")


def test_requests_that_grow_when_parsed_are_refused_before(attnserve, checks):
    """A hostile review of the fixes (2026-12-05): a request of millions of empty repeated entries (2 bytes each
    on the wire, a heap object each once parsed) grew ~110x before any budget saw it: 16 MiB of empty OIP `inputs`
    held 1.8 GiB. Now a message that would hold over 4x its size (or 1 MiB) once parsed is refused before it is
    parsed, on both protocols."""
    server = start(attnserve)
    rss = Rss(server.proc.pid)
    model = b"\x0a\x04demo"  # ModelInferRequest.model_name / AttendRequest.model: "demo"
    for path, empty in (("/inference.GRPCInferenceService/ModelInfer", b"\x2a\x00"),   # inputs {}
                        (h2.ATTEND, b"\x1a\x00")):                                   # key {}, again
        c = h2.Conn(server.port, source=ATTACKER)
        sid = c.call(model + empty * (8 << 20), path=path)
        ended = lib.wait_until(lambda: sid in c.ended or sid in c.resets or c.closed.is_set(), 20, 0.02)
        checks(f"16 MiB of empty fields to {path.rsplit('/', 1)[1]}: answered", ended)
        c.close()
    peak = rss.stop()
    checks("... refused before parsing: the server grew by under 96 MiB", peak < 96, f"+{peak:.0f} MiB")
    import grpc
    with grpc.insecure_channel(server.target) as channel:
        try:
            channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")(model + b"\x2a\x00" * (8 << 20),
                                                                              timeout=20)
            checks("... with INVALID_ARGUMENT naming the growth", False, "answered OK")
        except grpc.RpcError as e:
            checks("... with INVALID_ARGUMENT naming the growth",
                   e.code() == grpc.StatusCode.INVALID_ARGUMENT and "once parsed" in (e.details() or ""),
                   f"{e.code()}: {e.details()}")
    stop_within(server, 30, checks, "requests that grow when parsed")


def test_streams_left_open_are_bounded(attnserve, checks):
    """Row 4: streams opened (HEADERS only) and never sent on, ~12 KB each inside gRPC: 500,000 held 6.1 GB
    and a stop took 31 s. gRPC 1.51 counts --max-concurrent-streams only once the client acknowledged it; now a
    connection past it is closed either way, and each peer address may hold at most --max-streams-per-peer."""
    server = start(attnserve, "--max-streams-per-peer", "600")
    request = attend_bytes(4)
    rss = Rss(server.proc.pid)
    with h2.WellBehaved(server.target, request) as w:
        block = h2.request_headers()
        for path, ack in ((h2.ATTEND, False), (h2.ATTEND, True), (h2.ATTEND_STREAM, False)):
            c = h2.Conn(server.port, source=ATTACKER, ack=ack)
            block = h2.request_headers(path)
            frames = b"".join(h2.frame(h2.HEADERS, h2.END_HEADERS, 2 * i + 1, block) for i in range(20000))
            c.send(frames)
            checks(f"20,000 streams of {path.rsplit('/', 1)[1]} (settings {'acknowledged' if ack else 'not'}): "
                   "connection closed", c.wait_closed(10))
            c.close()
        # Under each connection's bound, over the peer's: 8 connections of 100 open streams.
        conns = [h2.Conn(server.port, source=ATTACKER) for _ in range(8)]
        for c in conns:
            c.send(b"".join(h2.frame(h2.HEADERS, h2.END_HEADERS, 2 * i + 1, block) for i in range(100)))
        closed = lib.wait_until(lambda: any(c.closed.is_set() for c in conns), 10)
        checks("800 open streams from one peer address: a connection over --max-streams-per-peer closed", closed)
    peak = rss.stop()
    checks("the server grew by under 64 MiB", peak < 64, f"+{peak:.0f} MiB")
    well_behaved_holds(w, checks, "streams left open")
    n = metric(server, "attnserve_connections_closed_total", reason="peer_streams")
    checks("counted as peer_streams", n >= 1, str(n))
    stop_within(server, 30, checks, "streams left open")


def test_answers_a_caller_never_reads_stay_in_the_budget_until_taken(attnserve, checks):
    """Row 5: a caller that announces a receive window of zero and never reads, asking large answers. Their
    bytes left --max-inflight-bytes when handed to gRPC, before they left: 80 calls held 5.5 GB, and the stop
    waited out its grace. Now an answer counts until the caller has it, each caller (here each peer address)
    holds at most half the budget, one not taken within --send-timeout-seconds (and 4 s a MiB) is cancelled, and
    a stop ends such calls within 40% of its grace."""
    server = start(attnserve, "--max-inflight-bytes", str(16 << 20), "--send-timeout-seconds", "1",
                   "--shutdown-grace", "10")
    big = attend_bytes(256)  # 512 KiB in, 512 KiB out: 1 MiB in flight each; 1 + 4 s to be taken.
    rss = Rss(server.proc.pid)
    with h2.WellBehaved(server.target, attend_bytes(4)) as w:
        c = h2.Conn(server.port, source=ATTACKER, settings={h2.SETTINGS_INITIAL_WINDOW_SIZE: 0})
        sids = [c.call(big) for _ in range(24)]
        # Held: the answers sent nothing (a window of zero); refused: a trailers-only answer.
        lib.wait_until(lambda: sum(s in c.ended for s in sids) >= 12, 15, 0.05)
        refused = [s for s in sids if s in c.ended]
        checks("past its half of --max-inflight-bytes the caller's requests are refused", len(refused) >= 12,
               f"{len(refused)} of 24 refused")
        held = rss.peak
        checks("what the server holds stays within the in-flight budget (16 MiB) and 128 MiB of requests "
               "arriving", held < 16 + 128, f"+{held:.0f} MiB")
        cancelled = lib.wait_until(lambda: all(s in c.ended or s in c.resets for s in sids), 15)
        checks("answers not taken within --send-timeout-seconds 1 (and 4 s a MiB): their calls cancelled",
               cancelled, f"{sum(s in c.resets for s in sids)} reset")
        # Again, and the stop comes while they are held.
        for _ in range(4):
            c.call(big)
        time.sleep(0.5)
    well_behaved_holds(w, checks, "a caller that never reads")
    rss.stop()
    n = metric(server, "attnserve_send_timeouts_total")
    checks("counted in attnserve_send_timeouts_total", n >= 1, str(n))
    stop_within(server, 10, checks, "a caller that never reads")


def test_streams_whose_answers_are_never_read_hold_only_the_budget(attnserve, checks):
    """A hostile review of the fixes (2026-12-05): AttendStreams whose client keeps its receive window at zero,
    each sending requests past the in-flight budget. A refused request waited with its decoded bytes for its
    error answer to be written, outside every budget: 8 addresses x 16 streams held +8.3 GiB. Now a refusal
    keeps only its few bytes of answer; what a stream's accepted requests hold is in --max-inflight-bytes."""
    server = start(attnserve, "--max-inflight-bytes", str(32 << 20))
    rss = Rss(server.proc.pid)
    pb_ = pb()
    rng = np.random.default_rng(5)
    with h2.WellBehaved(server.target, attend_bytes(4)) as w:
        c = h2.Conn(server.port, source=ATTACKER, settings={h2.SETTINGS_INITIAL_WINDOW_SIZE: 0})
        for _ in range(8):
            sid = c.open_stream(h2.ATTEND_STREAM)
            for i in range(16):
                r = pb_.AttendRequest(model="demo", request_id=i + 1,
                                      query=lib.to_wire(pb_, rng.standard_normal((1, 1024, 512))))
                c.send_data(sid, h2.grpc_message(r.SerializeToString()), timeout=2)
        time.sleep(2)
    peak = rss.stop()
    checks("8 streams x 16 requests of 2 MiB, answers never read: the server grew by under 128 MiB "
           "(the budget is 32 MiB)", peak < 128, f"+{peak:.0f} MiB")
    well_behaved_holds(w, checks, "streams never read")
    c.close()
    stop_within(server, 30, checks, "streams never read")


def test_uploads_left_short_are_bounded(attnserve, checks):
    """Row 6: messages announced and left one byte short: gRPC 1.51 reads a message whole before it checks its
    size, so 120 x 60 MB on one connection held 7.4 GB. Now one peer address holds at most
    --max-upload-bytes-per-peer of messages not yet whole, and a message announced over that (it could never
    arrive whole) closes its connection at its first bytes."""
    server = start(attnserve, "--transport-memory-bytes", str(96 << 20), "--max-upload-bytes-per-peer",
                   str(32 << 20))
    rss = Rss(server.proc.pid)
    with h2.WellBehaved(server.target, attend_bytes(4)) as w:
        c = h2.Conn(server.port, source=ATTACKER)
        sid = c.open_stream()
        c.send_data(sid, b"\x00" + (1 << 30).to_bytes(4, "big"))  # 1 GiB announced: over 32 MiB.
        checks("a message announced at 1 GiB: the connection closed at once", c.wait_closed(5))
        c = h2.Conn(server.port, source=ATTACKER)
        short = h2.grpc_message(bytes(12 << 20))[:-1]
        results = []
        sids = [c.open_stream() for _ in range(4)]
        threads = [threading.Thread(target=lambda sid=sid: results.append(c.send_data(sid, short))) for sid in sids]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        checks("4 uploads of 12 MiB left short from one peer: closed past --max-upload-bytes-per-peer 32 MiB",
               c.wait_closed(10), f"sent whole: {results}")
    peak = rss.stop()
    checks("the server grew by under 64 MiB", peak < 64, f"+{peak:.0f} MiB")
    well_behaved_holds(w, checks, "uploads left short")
    for reason in ("message_bytes", "peer_uploads"):
        n = metric(server, "attnserve_connections_closed_total", reason=reason)
        checks(f"counted as {reason}", n >= 1, str(n))
    stop_within(server, 30, checks, "uploads left short")


def attacker(kind, server, request, seconds):
    """h2_raw.py's `kind` attack from a process of its own (its threads take no time from the well-behaved
    caller's), from 127.0.0.2; its output line."""
    path = os.path.join(lib.temp_dir("attnserve-attack-"), "request.bin")
    with open(path, "wb") as f:
        f.write(request)
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib", "h2_raw.py")
    return subprocess.Popen([sys.executable, script, kind, str(server.port), str(seconds), path, ATTACKER],
                            stdout=subprocess.PIPE, text=True)


# Rows 7 and 8 share two cores between the server, the attacker (Python, a core of its own) and the
# well-behaved caller: "2x the unloaded p99" is the goal measured by bench/attack.py, not a bound a
# test can hold here. The bound below is what separates the fix from the flaw (seconds, refusals).
LOADED_P99_S = 0.5


def test_rapid_reset_is_cut(attnserve, checks):
    """Row 7: requests reset as soon as sent (CVE-2023-44487): RSS to 1.3 GB, calls past their deadline. Now a
    connection that resets streams faster than --max-resets-per-second (over 5 s) is closed."""
    server = start(attnserve)
    request = attend_bytes(4)
    base, _ = unloaded_p99(server, request)
    rss = Rss(server.proc.pid)
    with h2.WellBehaved(server.target, request) as w:
        out = attacker("rapid-reset", server, request, 10).communicate(timeout=60)[0]
        time.sleep(0.5)
    peak = rss.stop()
    checks("requests reset as sent: the connection closed", "connection closed" in out, out)
    checks(f"the well-behaved caller answered, p99 under {LOADED_P99_S * 1e3:.0f} ms (unloaded "
           f"{base * 1e3:.1f} ms)", w.percentile(99) < LOADED_P99_S and not w.errors, w.summary())
    checks("the server grew by under 64 MiB", peak < 64, f"+{peak:.0f} MiB")
    n = metric(server, "attnserve_connections_closed_total", reason="resets")
    checks("counted as resets", n >= 1, str(n))
    stop_within(server, 30, checks, "rapid reset")


def test_a_greedy_peer_does_not_take_the_queue(attnserve, checks):
    """Row 8: one client with 1,500 small calls in flight at once took the queue from everyone (another
    client's median 5 ms -> 3.3 s, 4 of 11 refused "queue full"). Now callers that name no tenant are told apart
    by their peer address, and the fair share puts another
    caller's request ahead of the greedy one's backlog. When the queue is full, another caller's request makes room
    by refusing the greedy caller's newest."""
    server = start(attnserve)
    request = attend_bytes(4)
    base, _ = unloaded_p99(server, request)
    greedy = attacker("greedy", server, request, 6)
    time.sleep(1.5)
    with h2.WellBehaved(server.target, request) as w:
        time.sleep(3.0)
    out = greedy.communicate(timeout=60)[0]
    refused = {r: metric(server, "attnserve_rejections_total", model="demo", reason=r)
               for r in ("queue_full", "pushed_out")}
    checks("the greedy peer's calls refused past the queue (or pushed out for the other caller's)",
           refused["queue_full"] + refused["pushed_out"] > 0, f"{refused}; {out}")
    checks("the other caller: no refusal", not w.errors, w.summary())
    checks(f"the other caller's p99 under {LOADED_P99_S * 1e3:.0f} ms (unloaded {base * 1e3:.1f} ms)",
           w.percentile(99) < LOADED_P99_S, w.summary())
    stop_within(server, 30, checks, "greedy peer")


def test_metrics_answer_under_trickling_clients(attnserve, checks):
    """Row 9: two connections trickling their requests left /metrics blind for ~30 s (civetweb's 2 threads and
    30 s request timeout). Now 8 threads and a request must arrive within 5 s."""
    server = start(attnserve)
    url = f"http://127.0.0.1:{server.metrics_port}/metrics"

    def scrape():
        t0 = time.monotonic()
        urllib.request.urlopen(url, timeout=10).read()
        return time.monotonic() - t0
    unloaded = sorted(scrape() for _ in range(20))[-1]
    stop = threading.Event()

    def trickle():
        s = socket.create_connection(("127.0.0.1", server.metrics_port))
        for b in b"GET /metrics HTTP/1.1\r\nHost: x\r\n":
            if stop.is_set():
                break
            try:
                s.send(bytes([b]))
            except OSError:
                s = socket.create_connection(("127.0.0.1", server.metrics_port))
            stop.wait(0.2)
        s.close()
    tricklers = [threading.Thread(target=trickle, daemon=True) for _ in range(4)]
    for t in tricklers:
        t.start()
    time.sleep(0.5)
    times = [scrape() for _ in range(20)]
    stop.set()
    worst = max(times)
    checks(f"/metrics under 4 trickling clients: every scrape within 2x the unloaded worst ({unloaded * 1e3:.1f} ms;"
           " at least 100 ms)", worst < max(2 * unloaded, 0.1), f"worst {worst * 1e3:.0f} ms")
    stop_within(server, 30, checks, "metrics trickle")


def test_behind_nginx_with_tls_the_header_attack_is_cut(attnserve, checks):
    """On a TLS listener the guard sees only encrypted bytes: an exposed TLS server goes behind deploy/nginx
    (TLS at nginx, plaintext to attnserve), whose limits this sends the header attack through. nginx closes
    the attacker's connection at its header bound; callers through nginx are answered throughout."""
    import grpc
    import pki
    tmp = lib.temp_dir("attnserve-nginx-attack-")
    pki.make_pki(tmp)
    server = start(attnserve)
    port = lib.free_port()
    nginx = lib.start_nginx(os.path.join(tmp, "nginx"), [server.port], port,
                            tls=(os.path.join(tmp, "server.pem"), os.path.join(tmp, "server.key")))
    try:
        def listening():
            try:
                socket.create_connection(("127.0.0.1", port), 1).close()
                return True
            except OSError:
                return nginx.poll() is not None
        assert lib.wait_until(listening, 10) and nginx.poll() is None, "nginx did not start"
        ca = os.path.join(tmp, "ca.pem")
        creds = grpc.ssl_channel_credentials(open(ca, "rb").read())
        channel = grpc.secure_channel(f"127.0.0.1:{port}", creds)
        call = channel.unary_unary(h2.ATTEND)
        request = attend_bytes(4)
        call(request, timeout=10)
        latencies, errors, stop = [], [], threading.Event()

        def well_behaved():
            while not stop.is_set():
                t0 = time.monotonic()
                try:
                    call(request, timeout=10)
                    latencies.append(time.monotonic() - t0)
                except grpc.RpcError as e:
                    errors.append(e.code().name)
                stop.wait(0.02)
        caller = threading.Thread(target=well_behaved, daemon=True)
        caller.start()
        c = h2.Conn(port, tls_ca=ca)
        c.settled.wait(5)
        c.send(h2.frame(h2.HEADERS, 0, 1, h2.request_headers() + b"\x00" + h2.hpack_int(9, 7) + b"x-padding" +
                        h2.hpack_int(2 << 30, 7)))
        t0 = time.monotonic()
        while not c.closed.is_set() and time.monotonic() - t0 < 5:
            if not c.send(h2.frame(h2.CONTINUATION, 0, 1, b"a" * 16384)):
                break
        closed = c.wait_closed(5)
        took = time.monotonic() - t0
        time.sleep(1.0)
        stop.set()
        caller.join(timeout=20)
        channel.close()
        checks("through nginx (TLS): a 2 GiB header value, the connection closed within 1 s",
               closed and took < 1, f"{took:.2f} s")
        ordered = sorted(latencies) or [float("inf")]
        checks("callers through nginx answered throughout, p99 under 1 s", not errors and ordered[-1] < 1,
               f"{len(latencies)} answered, failed {errors[:3]}, max {ordered[-1] * 1e3:.0f} ms")
    finally:
        nginx.terminate()
        nginx.wait(timeout=10)
    stop_within(server, 30, checks, "behind nginx")
