"""A hostile HTTP/2 peer (plaintext, or TLS with ALPN h2), frame by frame, for the attack suite (tests/integration/attack_test.py and
bench/attack.py): what grpcio and the C++ client never send (header blocks trickled as CONTINUATION
frames, streams opened and never sent on, a receive window held at zero, uploads left short,
streams reset as soon as opened, gzip-compressed messages), over plain sockets. And the
well-behaved caller whose latency the attacks must not reach. No dependency beyond the standard
library (and grpcio for the well-behaved caller)."""
import socket
import statistics
import struct
import threading
import time
import zlib

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = 0, 1, 3, 4, 6, 7, 8, 9
END_STREAM, ACK, END_HEADERS = 0x1, 0x1, 0x4
SETTINGS_MAX_CONCURRENT_STREAMS, SETTINGS_INITIAL_WINDOW_SIZE = 0x3, 0x4
ATTEND = "/attnserve.v1.AttentionService/Attend"
ATTEND_STREAM = "/attnserve.v1.AttentionService/AttendStream"


def frame(kind, flags, stream, payload=b""):
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


def hpack_int(value, prefix_bits, first=0):
    """HPACK's integer with an N-bit prefix (RFC 7541 5.1); `first` holds the bits above the prefix."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([first | value])
    out, value = [first | limit], value - limit
    while value >= 128:
        out.append(value % 128 + 128)
        value //= 128
    return bytes(out + [value])


def literal(name, value):
    """A literal header field without indexing, new name, no Huffman (RFC 7541 6.2.2)."""
    name, value = name.encode(), value if isinstance(value, bytes) else value.encode()
    return b"\x00" + hpack_int(len(name), 7) + name + hpack_int(len(value), 7) + value


def request_headers(path=ATTEND, authority="localhost", extra=()):
    block = b"".join(literal(n, v) for n, v in [(":method", "POST"), (":scheme", "http"), (":path", path),
                                                (":authority", authority), ("content-type", "application/grpc"),
                                                ("te", "trailers"), *extra])
    return block


def grpc_message(payload, compressed=False):
    return bytes([1 if compressed else 0]) + struct.pack(">I", len(payload)) + payload


def gzip_bomb(inflated_bytes, chunk=1 << 20):
    """A gzip stream (grpc-encoding gzip's format) of `inflated_bytes` zeros, built a chunk at a time:
    ~1 KB of it per MB inflated."""
    z = zlib.compressobj(9, zlib.DEFLATED, 31)
    zeros, out, left = bytes(chunk), [], inflated_bytes
    while left > 0:
        out.append(z.compress(zeros[:min(chunk, left)]))
        left -= chunk
    out.append(z.flush())
    return b"".join(out)


class Conn:
    """One raw HTTP/2 connection. `settings` go in the client's first SETTINGS frame; with `ack` the
    server's SETTINGS are acknowledged as they arrive (a reader thread reads everything the server sends
    and counts it), without, they never are. With `read=False` nothing is read at all: the socket's
    receive buffer fills and the server's writes stall (a caller that never reads). With `grant` (and a
    reader), what the server sends is acknowledged with WINDOW_UPDATE frames as a client that reads does."""

    def __init__(self, port, host="127.0.0.1", source=None, settings=None, ack=True, read=True, rcvbuf=None,
                 timeout=10, grant=True, tls_ca=None):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        if source:
            self.sock.bind((source, 0))
        self.sock.settimeout(timeout)
        self.sock.connect((host, port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if tls_ca:  # TLS with ALPN h2, the server's certificate checked against `tls_ca`.
            import ssl
            context = ssl.create_default_context(cafile=tls_ca)
            context.set_alpn_protocols(["h2"])
            self.sock = context.wrap_socket(self.sock, server_hostname=host)
        self.ack, self.grant = ack, grant
        self.next_id = 1
        self.closed = threading.Event()  # The server closed the connection (or reset it).
        # The server's SETTINGS arrived (and were acknowledged): nothing of ours comes between the
        # frames of a header block sent from now on.
        self.settled = threading.Event()
        self.goaway = None  # (last stream id, error code) of a GOAWAY received
        self.resets = {}  # stream id -> RST_STREAM error code received
        self.frames = 0
        self.received = 0
        self.ended = set()  # streams the server ended (END_STREAM on HEADERS or DATA)
        self._lock = threading.Lock()
        # Flow control of what we send: the connection's window and each stream's (RFC 9113 6.9).
        self._window = threading.Condition()
        self.conn_window, self.initial_window, self.stream_windows = 65535, 65535, {}
        body = b"".join(struct.pack(">HI", k, v) for k, v in (settings or {}).items())
        self.send(PREFACE + frame(SETTINGS, 0, 0, body))
        self.reader = None
        if read:
            self.reader = threading.Thread(target=self._read, daemon=True)
            self.reader.start()

    def send(self, data):
        """Sends; False once the server has closed or reset the connection."""
        try:
            with self._lock:
                self.sock.sendall(data)
            return True
        except OSError:
            self.closed.set()
            return False

    def _read(self):
        buffer = b""
        try:
            while True:
                chunk = self.sock.recv(1 << 16)
                if not chunk:
                    break
                self.received += len(chunk)
                buffer += chunk
                while len(buffer) >= 9:
                    length = int.from_bytes(buffer[:3], "big")
                    if len(buffer) < 9 + length:
                        break
                    kind, flags, stream = buffer[3], buffer[4], int.from_bytes(buffer[5:9], "big") & 0x7FFFFFFF
                    payload, buffer = buffer[9:9 + length], buffer[9 + length:]
                    self.frames += 1
                    self._on_frame(kind, flags, stream, payload)
        except OSError:
            pass
        self.closed.set()
        with self._window:
            self._window.notify_all()

    def _on_frame(self, kind, flags, stream, payload):
        if kind == SETTINGS and not flags & ACK:
            with self._window:
                for at in range(0, len(payload) - 5, 6):
                    key, value = struct.unpack(">HI", payload[at:at + 6])
                    if key == SETTINGS_INITIAL_WINDOW_SIZE:
                        for sid in self.stream_windows:
                            self.stream_windows[sid] += value - self.initial_window
                        self.initial_window = value
                self._window.notify_all()
            if self.ack:
                self.send(frame(SETTINGS, ACK, 0))
            self.settled.set()
        elif kind == WINDOW_UPDATE:
            with self._window:
                increment = struct.unpack(">I", payload[:4])[0] & 0x7FFFFFFF
                if stream == 0:
                    self.conn_window += increment
                else:
                    self.stream_windows[stream] = self.stream_windows.get(stream, self.initial_window) + increment
                self._window.notify_all()
        elif kind == PING and not flags & ACK:
            self.send(frame(PING, ACK, 0, payload))
        elif kind == GOAWAY:
            self.goaway = struct.unpack(">II", payload[:8])
        elif kind == RST_STREAM:
            self.resets[stream] = struct.unpack(">I", payload[:4])[0]
        if kind == DATA and payload and self.grant:
            update = struct.pack(">I", len(payload))
            self.send(frame(WINDOW_UPDATE, 0, 0, update) + frame(WINDOW_UPDATE, 0, stream, update))
        if kind in (HEADERS, DATA) and flags & END_STREAM:
            self.ended.add(stream)

    def open_stream(self, path=ATTEND, end_headers=True, extra=()):
        """HEADERS for a new stream, nothing else; its id."""
        sid, self.next_id = self.next_id, self.next_id + 2
        self.send(frame(HEADERS, END_HEADERS if end_headers else 0, sid, request_headers(path, extra=extra)))
        return sid

    def call(self, message, path=ATTEND, extra=(), end=True, compressed=False):
        """A whole unary request on a new stream (HEADERS, DATA with END_STREAM); its id."""
        sid = self.open_stream(path, extra=extra)
        self.send_data(sid, grpc_message(message, compressed), end)
        return sid

    def send_data(self, sid, data, end=False, frame_bytes=16384, timeout=10):
        """DATA within the windows the server gives (waiting up to `timeout` for more); False when the
        connection closed or the windows stayed shut."""
        at = 0
        while True:
            with self._window:
                window = self.stream_windows.setdefault(sid, self.initial_window)
                if not self._window.wait_for(lambda: self.closed.is_set() or at >= len(data) or
                                             min(self.conn_window, self.stream_windows[sid]) > 0, timeout):
                    return False
                n = min(frame_bytes, len(data) - at, self.conn_window, self.stream_windows[sid])
                self.conn_window -= n
                self.stream_windows[sid] -= n
            if self.closed.is_set():
                return False
            last = at + n >= len(data)
            if not self.send(frame(DATA, END_STREAM if end and last else 0, sid, data[at:at + n])):
                return False
            at += n
            if last:
                return True

    def reset(self, sid, code=8):
        return self.send(frame(RST_STREAM, 0, sid, struct.pack(">I", code)))

    def window_update(self, stream, increment):
        return self.send(frame(WINDOW_UPDATE, 0, stream, struct.pack(">I", increment)))

    def wait_closed(self, timeout):
        return self.closed.wait(timeout)

    def close(self):
        try:
            self.sock.close()
        except OSError:
            pass


class WellBehaved:
    """A grpcio caller that sends one small Attend after another on its own channel while an attack runs,
    and keeps each latency (seconds, failures as None with their codes in `errors`). Use as a context
    manager; percentile(99) after."""

    def __init__(self, target, request_bytes, timeout=10.0, pause=0.02):
        import grpc
        self.grpc = grpc
        self.channel = grpc.insecure_channel(target)
        self.call = self.channel.unary_unary(ATTEND)
        self.request, self.timeout, self.pause = request_bytes, timeout, pause
        self.latencies, self.errors = [], []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def one(self):
        start = time.monotonic()
        try:
            self.call(self.request, timeout=self.timeout)
            self.latencies.append(time.monotonic() - start)
            return True
        except self.grpc.RpcError as e:
            self.errors.append(e.code().name)
            return False

    def _run(self):
        while not self._stop.is_set():
            self.one()
            self._stop.wait(self.pause)

    def __enter__(self):
        self.one()  # Connected and warm before the attack.
        self.latencies.clear()
        self.errors.clear()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=30)
        self.channel.close()

    def count(self):
        return len(self.latencies)

    def percentile(self, p):
        if not self.latencies:
            return float("inf")
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(len(ordered) * p / 100))]

    def summary(self):
        if not self.latencies:
            return f"no answer ({len(self.errors)} failed: {sorted(set(self.errors))})"
        return (f"{len(self.latencies)} answered, {len(self.errors)} failed {sorted(set(self.errors))}, "
                f"median {statistics.median(self.latencies) * 1e3:.1f} ms, p99 {self.percentile(99) * 1e3:.1f} ms, "
                f"max {max(self.latencies) * 1e3:.1f} ms")


def greedy(port, request, seconds, source=None, connections=12, in_flight=125):
    """`connections` connections each keeping `in_flight` Attend calls of `request` open, for `seconds`:
    one caller with connections x in_flight calls at once. Returns the calls sent."""
    conns = [Conn(port, source=source) for _ in range(connections)]
    stop, sent = threading.Event(), [0] * connections

    def run(i, c):
        open_ids = []
        while not stop.is_set() and not c.closed.is_set():
            while len(open_ids) < in_flight:
                open_ids.append(c.call(request))
                sent[i] += 1
            time.sleep(0.002)
            open_ids = [s for s in open_ids if s not in c.ended and s not in c.resets]
    threads = [threading.Thread(target=run, args=(i, c), daemon=True) for i, c in enumerate(conns)]
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join(timeout=10)
    for c in conns:
        c.close()
    return sum(sent)


def rapid_reset(port, request, seconds, source=None, burst=100):
    """Attend calls sent and reset at once (HEADERS, DATA, RST_STREAM), `burst` at a time, on one connection
    for up to `seconds` or until the server closes it. Returns (calls sent, whether it was closed)."""
    c = Conn(port, source=source)
    block, message = request_headers(), grpc_message(request)
    sent, t0 = 0, time.monotonic()
    while not c.closed.is_set() and time.monotonic() - t0 < seconds:
        frames = []
        for _ in range(burst):
            sid, c.next_id = c.next_id, c.next_id + 2
            frames += [frame(HEADERS, END_HEADERS, sid, block), frame(DATA, END_STREAM, sid, message),
                       frame(RST_STREAM, 0, sid, struct.pack(">I", 8))]
        if not c.send(b"".join(frames)):
            break
        sent += burst
    closed = c.wait_closed(5)
    c.close()
    return sent, closed


if __name__ == "__main__":
    # An attacker, or the well-behaved caller, in a process of its own (its threads then take no time from
    # the other side's): h2_raw.py greedy|rapid-reset|well-behaved PORT SECONDS REQUEST_FILE [SOURCE_ADDRESS]
    # (well-behaved: one JSON line: answered, failed, codes, p50_ms, p99_ms, max_ms).
    import json
    import sys
    kind, port, seconds, path = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
    source = sys.argv[5] if len(sys.argv) > 5 else None
    with open(path, "rb") as f:
        body = f.read()
    if kind == "well-behaved":
        with WellBehaved(f"127.0.0.1:{port}", body) as w:
            time.sleep(seconds)
        ordered = sorted(w.latencies) or [float("nan")]
        print(json.dumps({"answered": len(w.latencies), "failed": len(w.errors), "codes": sorted(set(w.errors)),
                          "p50_ms": ordered[len(ordered) // 2] * 1e3, "p99_ms": w.percentile(99) * 1e3,
                          "max_ms": ordered[-1] * 1e3}), flush=True)
    elif kind == "greedy":
        print(f"greedy: {greedy(port, body, seconds, source)} calls sent", flush=True)
    else:
        n, was_closed = rapid_reset(port, body, seconds, source)
        print(f"rapid-reset: {n} calls sent and reset, connection {'closed' if was_closed else 'open'}", flush=True)
