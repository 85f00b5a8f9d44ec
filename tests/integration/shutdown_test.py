#!/usr/bin/python3
"""SIGTERM on the real attnserve binary with clients connected, as a rolling restart does it:

- idle: clients keep their channels open after their calls (a plain grpcio channel after a unary call,
  one after a stream it cancelled after the first answer, the attnserve package's client, whose channel
  also holds a health watch): the server stops in under a second with exit 0, at --shutdown-grace 2
  as at 30 (it used to wait ~5 s for grpcio to read its GOAWAY, and at grace 2 exit 1);
- busy: a request computing when SIGTERM comes is answered, and the process is gone within a second of
  the answer;
- slow link: an answer that ends after the SIGTERM and travels over a slow link (a relay that hands the
  client 8 MB/s) arrives whole: the server closes the connection only once the client has read it all
  (it used to lose the last 1.27 MB of 32 MiB: gRPC's close reset the connection on the client's next
  flow-control update);
- cut: work still computing when the grace period ends gets a status, the process exits 1 and says how
  many calls the grace period cut.

Prints the measured stop times (docs/shutdown.md "Shutdown" quotes them).

usage: python3 -m pytest shutdown_test.py --attnserve PATH/TO/attnserve [--busy-rounds N]   (N busy stops instead of one)
"""
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np

import pytest  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
import attnserve_py as lib  # noqa: E402

check = lib.Checks()
IDLE_LIMIT_S = 1.0


class SlowLink:
    """A TCP relay that hands the server's bytes to the client at `rate` bytes/s, as a slow network
    does; counts the bytes it delivered."""

    def __init__(self, upstream_port, rate):
        self.rate, self.delivered = rate, 0
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen()
        self.port = self.listener.getsockname()[1]
        self.upstream_port = upstream_port
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.upstream_port))
            threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, True), daemon=True).start()

    def _pump(self, src, dst, slow):
        try:
            while data := src.recv(16 << 10):
                dst.sendall(data)
                if slow:
                    self.delivered += len(data)
                    time.sleep(len(data) / self.rate)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self):
        self.listener.close()


def stop(server):
    """SIGTERM; the seconds until the process is gone, its exit code and its output."""
    start = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    code = server.proc.wait(timeout=60)
    took = time.monotonic() - start
    server._drain.join(timeout=10)
    return took, code, server.output()


def held(server, n):
    """Waits until `server` holds `n` Attend calls (admitted: computing or queued), as its
    attnserve_requests_in_flight gauge says; False after 30 s."""
    return lib.wait_until(lambda: lib.in_flight(server) >= n, timeout=30, step=0.02)


def idle_stop(binary, name, connect, grace="2"):
    """Starts a server, lets `connect(target)` make its calls and keep its channel (returns a closer),
    waits past the drain's quiet period, then SIGTERM: exit 0 in under IDLE_LIMIT_S."""
    server = lib.Server(binary, "--shutdown-grace", grace)
    close = connect(server.target)
    time.sleep(0.5)
    took, code, out = stop(server)
    close()
    print(f"  {name}, --shutdown-grace {grace}: stopped in {took:.3f} s, exit {code}")
    check(f"{name}, grace {grace}: exit 0", code == 0, f"exit {code}: {out[-600:]}")
    check(f"{name}, grace {grace}: stops in under {IDLE_LIMIT_S} s", took < IDLE_LIMIT_S, f"{took:.2f} s")
    check(f"{name}, grace {grace}: says it stopped", "attnserve: stopped" in out, out[-600:])
    return took


def catches(pid, sig):
    """Whether process `pid` has a handler for `sig` (its /proc status's SigCgt mask)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    except (OSError, StopIteration):
        return False
    return bool(mask >> (int(sig) - 1) & 1)


def test_sigterm_while_the_models_load(attnserve, checks):
    """A hostile review's finding (2026-12-02): a SIGTERM during start-up's model load waited for the
    whole load (48 s for a large model), then drained. Nothing listens while the models load, so the
    process ends there and then: exit 0, a line saying so, no banner. Here a model of 400 MiB of
    zeros (a sparse file: E=5120, about 4.5 s to load and hash here) and the SIGTERM as soon as the
    process catches it."""
    root = lib.temp_dir("attnserve-slow-load-")
    lib.write_sparse_model(os.path.join(root, "models", "big"), 5120, 40)
    proc = subprocess.Popen([attnserve, "--address", "127.0.0.1:0", "--metrics-address", "", "--http-address", "", "--no-warmup",
                             "--models", os.path.join(root, "models")], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    # The SIGTERM goes once the process catches it (/proc's SigCgt): one sent at a fixed time could
    # come before the handler on a busy host, and end the process by the default action.
    checks("SIGTERM caught before the load ends", lib.wait_until(lambda: catches(proc.pid, signal.SIGTERM), 20,
                                                                 0.005))
    checks("still loading when the SIGTERM goes", proc.poll() is None)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        out = proc.communicate(timeout=60)[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        out = proc.communicate()[0]
    took = time.monotonic() - sent
    print(f"  SIGTERM as the load began: gone in {took:.3f} s, exit {proc.returncode}")
    checks("SIGTERM while loading: exit 0", proc.returncode == 0, f"exit {proc.returncode}: {out[-600:]}")
    # (0.01-0.08 s alone here; 1.3-2.8 s in 3 of ~30 runs on a busy host: the loose bound is for
    # a hang; that it never served is what shows the load was not finished first.)
    checks("SIGTERM while loading: gone in under 5 s", took < 5.0, f"{took:.2f} s")
    checks("SIGTERM while loading: says so, and never served",
          "stopped while loading models" in out and "serving" not in out, out[-600:])


def test_sigterm_with_clients_connected(attnserve, request):
    binary = attnserve
    busy_rounds = request.config.getoption("--busy-rounds")
    attnserve = lib.load_package()
    import grpc
    from attnserve.v1 import attention_pb2 as pb
    rng = np.random.default_rng(22)
    small = pb.AttendRequest(model="demo", query=lib.to_wire(pb, rng.standard_normal((1, 4, 512))))
    # ~1 s of compute on two cores (16 x 1024 tokens of the demo model).
    slow = pb.AttendRequest(model="demo", query=lib.to_wire(pb, rng.standard_normal((16, 1024, 512))))
    big = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]

    def unary_then_idle(target):
        channel = grpc.insecure_channel(target)
        channel.unary_unary("/attnserve.v1.AttentionService/Attend")(small.SerializeToString(), timeout=10)
        return channel.close

    def cancelled_stream_then_idle(target):
        channel = grpc.insecure_channel(target)
        release = threading.Event()

        def requests():
            yield small.SerializeToString()
            release.wait(30)

        call = channel.stream_stream("/attnserve.v1.AttentionService/AttendStream")(requests(), timeout=30)
        next(call)  # The first answer ...
        call.cancel()  # ... then the client cancels and keeps its channel.
        release.set()
        return channel.close

    def package_client_then_idle(target):
        client = attnserve.Client(target)
        client.attend(rng.standard_normal((1, 4, 512)).astype(np.float32))
        return client.close

    # 1. Idle with connected clients: fast, exit 0.
    times = []
    for grace in ("2", "30"):
        times.append(idle_stop(binary, "idle grpcio channel after a unary call", unary_then_idle, grace))
    times.append(idle_stop(binary, "idle grpcio channel after a cancelled stream", cancelled_stream_then_idle))
    times.append(idle_stop(binary, "idle attnserve.Client (round_robin, health watch)", package_client_then_idle))
    print(f"  idle stops: {min(times):.3f} to {max(times):.3f} s")

    # 2. Busy: the request in flight is answered; the process goes right after. (--busy-rounds N
    #    repeats it: gRPC's clean-up used to add 10 s in about 1 stop in 9 under CPU load.)
    late = 0
    for _ in range(busy_rounds):
        server = lib.Server(binary, "--shutdown-grace", "20")
        channel = grpc.insecure_channel(server.target, options=big)
        answered = []
        future = channel.unary_unary("/attnserve.v1.AttentionService/Attend").future(slow.SerializeToString(),
                                                                                    timeout=60)
        future.add_done_callback(lambda f: answered.append(time.monotonic()))
        check("busy: the request is in flight before SIGTERM", held(server, 1))
        sigterm = time.monotonic()
        took, code, out = stop(server)
        gone = sigterm + took
        try:
            future.result()
            check("busy: the request in flight is answered", True)
        except grpc.RpcError as e:
            check("busy: the request in flight is answered", False, f"{e.code()} {e.details()!r}")
        check("busy: exit 0", code == 0, f"exit {code}: {out[-600:]}")
        after = gone - answered[0] if answered else float("inf")
        print(f"  busy (one ~1 s request in flight): stopped {took:.3f} s after SIGTERM, "
              f"{after:.3f} s after its answer")
        check(f"busy: gone within {IDLE_LIMIT_S} s of the last answer", after < IDLE_LIMIT_S, f"{after:.2f} s")
        late += after >= IDLE_LIMIT_S
        channel.close()
    if busy_rounds > 1:
        print(f"  busy: {late} of {busy_rounds} stops gone later than {IDLE_LIMIT_S} s after the answer")

    # 3. Slow link: the answer ends after the SIGTERM and crawls to the client; it arrives whole.
    server = lib.Server(binary, "--shutdown-grace", "20")
    link = SlowLink(server.port, 8 << 20)
    channel = grpc.insecure_channel(f"127.0.0.1:{link.port}", options=big)
    future = channel.unary_unary("/attnserve.v1.AttentionService/Attend").future(slow.SerializeToString(),
                                                                                timeout=60)
    check("slow link: the request is in flight before SIGTERM", held(server, 1))
    took, code, out = stop(server)
    try:
        answer = pb.AttendResponse.FromString(future.result(timeout=30))
        check("slow link: the answer in flight arrives whole", len(answer.output.data) == 16 * 1024 * 512 * 4,
              f"{len(answer.output.data)} bytes")
    except grpc.RpcError as e:
        check("slow link: the answer in flight arrives whole", False,
              f"{e.code()} {e.details()!r} after {link.delivered} bytes")
    print(f"  slow link (32 MiB answer at 8 MB/s): stopped {took:.3f} s after SIGTERM, exit {code}")
    check("slow link: exit 0", code == 0, f"exit {code}: {out[-600:]}")
    channel.close()
    link.close()

    # 4. Cut: the grace period ends with work in flight. Each call gets a status; exit 1; the log says
    #    how many calls were cut.
    server = lib.Server(binary, "--shutdown-grace", "0.5", "--workers", "1")
    channel = grpc.insecure_channel(server.target, options=big)
    futures = [channel.unary_unary("/attnserve.v1.AttentionService/Attend").future(slow.SerializeToString(),
                                                                                  timeout=60)
               for _ in range(3)]
    check("cut: all three in flight before SIGTERM (one computing, two queued)", held(server, 3))
    took, code, out = stop(server)
    codes = []
    for f in futures:
        try:
            f.result(timeout=30)
            codes.append("OK")
        except grpc.FutureTimeoutError:
            codes.append("no answer")
        except grpc.RpcError as e:
            codes.append(e.code().name)
    print(f"  cut (grace 0.5 s, three ~1 s requests): stopped in {took:.3f} s, exit {code}, calls {codes}")
    check("cut: exit 1", code == 1, f"exit {code}: {out[-600:]}")
    check("cut: gone by the end of the grace period (+0.5 s)", took < 1.0, f"{took:.2f} s")
    check("cut: every call gets a status", "no answer" not in codes, str(codes))
    m = re.search(r"the grace period .* cut (\d+) calls?", out)
    check("cut: the log says how many calls were cut",
          m is not None and int(m.group(1)) == sum(c != "OK" for c in codes), out[-600:])
    channel.close()



if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
