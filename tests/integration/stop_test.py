#!/usr/bin/python3
"""A stop after real traffic: every way a call can end, then SIGTERM on the real attnserve binary.

The stop must count what attnserve accepted and has not finished, not what the transport saw: a call
that dies on its client's deadline while its request is still arriving, one reset with RST_STREAM
before its message is whole, a message over the size limit, never reach attnserve, yet gRPC's own
per-server counts (channelz) kept them as started for ever, and every stop after such traffic waited
out 90% of its grace period and exited 1 naming calls that were never cut.

Every ending (each on a fresh server, then a stop with nothing in flight: exit 0 in under a second,
"attnserve: stopped"):
  client deadline before the server picked the call up (the request still uploading) and after (in
  compute); client cancel in compute; RST_STREAM mid-upload and in compute (raw HTTP/2, python3-h2);
  a client process SIGKILLed mid-upload and in compute; malformed messages (not protobuf, a field not
  UTF-8, a tensor of the wrong shape, a gRPC frame cut short, a compressed frame with no encoding, a
  message over --max-message-bytes, a unary call with no message); admission refusals
  (RESOURCE_EXHAUSTED: the in-flight byte budget, the queue); OIP ModelInfer and ModelStreamInfer;
  AttendStream cancelled, past its deadline, half-closed and read to the end, ended by an
  undecodable message; kept keys and values (CreateMemory past its deadline, a session's step);
  grpc.health.v1 Check and a Watch cancelled; reflection read to the end.
Then long-lived calls open across the stop (a health watch, a reflection stream, an idle
AttendStream): exit 0 in under a second. Then the cut: after all of the above, calls really in
flight when the grace period ends (two unary Attend, an AttendStream, an OIP ModelInfer): exit 1
naming exactly the calls the clients saw cut.

--soak N runs N stops instead, each after a random mix of the endings above and of calls left in
flight that finish within the grace period or are cut by it; each exit code, the count the log
names and the stop time are checked against what the clients saw (docs/shutdown.md "Shutdown").

usage: python3 -m pytest stop_test.py --attnserve PATH/TO/attnserve [-k NAME]
       stop_test.py PATH/TO/attnserve --soak N [--seed S]   (the soak; not part of the suite)
"""
import argparse
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import grpc
import h2.config
import h2.connection
import h2.events
import h2.exceptions
import numpy as np

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
import attnserve_py as lib  # noqa: E402  (tests/lib; tests/conftest.py puts it on the path under pytest)

check = lib.Checks()
STOP_LIMIT_S = 1.0
# A connection that carried an answer since the SIGTERM is held until its client has been quiet 1 s
# (it may still be reading; docs/shutdown.md "Shutdown"), unless the client closes it first, and the client's
# last flow-control bytes may come a little after the answer: a stop ends up to about 1.5 s after its
# last answer (the slowest of 460 soak rounds: 1.54 s). Far from the grace period either way.
AFTER_ANSWER_LIMIT_S = 2.0
ATTEND = "/attnserve.v1.AttentionService/Attend"
ATTEND_STREAM = "/attnserve.v1.AttentionService/AttendStream"
LIST_SERVICES = b"\x3a\x00"  # ServerReflectionRequest {list_services: ""}
BIG = [("grpc.max_receive_message_length", 128 << 20), ("grpc.max_send_message_length", 128 << 20)]
pb, _ = lib.load_stubs()
oip, _ = lib.load_stubs("inference/grpc_service.proto")
RNG = np.random.default_rng(31)


def attend_bytes(batch, length, request_id=0):
    q = RNG.standard_normal((batch, length, 512)).astype(np.float32)
    return pb.AttendRequest(model="demo", query=lib.to_wire(pb, q), request_id=request_id).SerializeToString()


SMALL = attend_bytes(1, 4)
UPLOAD = attend_bytes(1, 2048)  # 4 MiB: still arriving when a 1 ms deadline passes.
# Compute on two cores: ~0.3 s (MEDIUM), ~1 s (SLOW; with --workers 1 a little more).
MEDIUM = attend_bytes(4, 1024)
SLOW = attend_bytes(16, 1024)


def grpc_frame(message, compressed=False):
    return bytes([1 if compressed else 0]) + len(message).to_bytes(4, "big") + message


class H2Call:
    """One gRPC call over raw HTTP/2 (python3-h2), for endings grpcio cannot make: RST_STREAM at a
    chosen moment, a frame cut short, a compressed flag without an encoding."""

    def __init__(self, port, path):
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        self.conn.initiate_connection()
        self.sid = self.conn.get_next_available_stream_id()
        self.conn.send_headers(self.sid, [(":method", "POST"), (":scheme", "http"), (":path", path),
                                          (":authority", f"127.0.0.1:{port}"), ("content-type", "application/grpc"),
                                          ("te", "trailers")])
        self.flush()
        self.status = None  # grpc-status of the trailers, or "RST_STREAM" / "closed"

    def flush(self):
        self.sock.sendall(self.conn.data_to_send())

    def pump(self, timeout=10.0):
        """Reads one chunk and handles its events; False when the connection closed."""
        self.sock.settimeout(timeout)
        data = self.sock.recv(1 << 16)
        if not data:
            self.status = self.status or "closed"
            return False
        for e in self.conn.receive_data(data):
            if isinstance(e, h2.events.DataReceived):
                self.conn.acknowledge_received_data(e.flow_controlled_length, e.stream_id)
            elif isinstance(e, h2.events.TrailersReceived):
                self.status = dict(e.headers).get("grpc-status")
            elif isinstance(e, h2.events.ResponseReceived) and "grpc-status" in dict(e.headers):
                self.status = dict(e.headers)["grpc-status"]  # trailers-only
            elif isinstance(e, h2.events.StreamReset):
                self.status = self.status or "RST_STREAM"
        self.flush()
        return True

    def send(self, data, end=False):
        """Sends `data` in frames as flow control allows."""
        while data:
            n = min(len(data), self.conn.local_flow_control_window(self.sid), self.conn.max_outbound_frame_size)
            if n == 0:
                if not self.pump():
                    return
                continue
            self.conn.send_data(self.sid, data[:n])
            data = data[n:]
            self.flush()
        if end:
            self.conn.end_stream(self.sid)
            self.flush()

    def reset(self):
        self.conn.reset_stream(self.sid, error_code=8)  # CANCEL
        self.flush()

    def finish(self, timeout=30.0):
        """Waits for the call's end; its grpc-status (a string), or how it ended."""
        end = time.monotonic() + timeout
        while self.status is None and time.monotonic() < end:
            try:
                if not self.pump(max(0.1, end - time.monotonic())):
                    break
            except socket.timeout:
                break
        return self.status

    def close(self):
        self.sock.close()


def rpc_code(fn):
    try:
        fn()
        return "OK"
    except grpc.RpcError as e:
        return e.code().name


class Traffic:
    """A server and its clients' channels; each ending below is a method that makes its calls, waits
    for them to end at the client, and returns the codes the client saw."""

    def __init__(self, server):
        self.server = server
        self.channel = grpc.insecure_channel(server.target, options=BIG)
        self.keep = []  # Calls left open across the stop: closed after it.

    def unary(self, path=ATTEND):
        return self.channel.unary_unary(path)

    # --- deadlines, cancels, resets, killed clients
    def deadline_before_pickup(self):
        return [rpc_code(lambda: self.unary()(UPLOAD, timeout=0.001)) for _ in range(10)]

    def deadline_in_compute(self):
        return [rpc_code(lambda: self.unary()(SLOW, timeout=0.15))]

    def cancel_in_compute(self):
        f = self.unary().future(MEDIUM, timeout=30)
        time.sleep(0.1)
        f.cancel()
        return ["CANCELLED" if f.cancelled() else "not cancelled"]

    def rst_mid_upload(self):
        call = H2Call(self.server.port, ATTEND)
        call.send(grpc_frame(UPLOAD)[:40000])
        time.sleep(0.05)
        call.reset()
        time.sleep(0.05)
        call.close()
        return ["RST_STREAM"]

    def rst_in_compute(self):
        call = H2Call(self.server.port, ATTEND)
        call.send(grpc_frame(MEDIUM), end=True)
        time.sleep(0.1)
        call.reset()
        time.sleep(0.05)
        call.close()
        return ["RST_STREAM"]

    def killed(self, when):
        """A client process SIGKILLed while its request uploads, or while it computes."""
        code = ("import socket,sys,time\n"
                "sys.path.insert(0, %r)\n"
                "import stop_test as t\n"
                "c = t.H2Call(%d, t.ATTEND)\n"
                "m = t.grpc_frame(t.%s)\n"
                "c.send(m[:40000]) if %r == 'upload' else c.send(m, end=True)\n"
                "print('sent', flush=True)\n"
                "time.sleep(60)\n") % (os.path.dirname(os.path.abspath(__file__)), self.server.port,
                                       "UPLOAD" if when == "upload" else "MEDIUM", when)
        p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        p.stdout.readline()
        time.sleep(0.1)
        p.kill()
        p.wait()
        return ["KILLED"]

    # --- malformed messages
    def malformed(self):
        codes = [rpc_code(lambda: self.unary()(b"\xff\xff\xff", timeout=10)),  # not protobuf
                 rpc_code(lambda: self.unary()(b"\x0a\x02\xff\xfe", timeout=10))]  # model not UTF-8
        wrong = pb.AttendRequest(model="demo", query=lib.to_wire(pb, np.zeros((1, 3, 7), np.float32)))
        codes.append(rpc_code(lambda: self.unary()(wrong.SerializeToString(), timeout=10)))
        codes.append(rpc_code(lambda: self.channel.stream_unary(ATTEND)(iter([]), timeout=10)))  # no message
        for frame in (grpc_frame(SMALL)[:-9],  # a frame cut short, then the end of the stream
                      grpc_frame(SMALL, compressed=True)):  # compressed, with no grpc-encoding
            call = H2Call(self.server.port, ATTEND)
            call.send(frame, end=True)
            codes.append(f"h2 grpc-status {call.finish()}")
            call.close()
        return codes

    def oversize(self):
        """A message over --max-message-bytes (64 MiB)."""
        huge = pb.AttendRequest(model="demo", query=pb.Tensor(dtype=1, shape=[1, 1 << 15, 512],
                                                               data=bytes(65 << 20)))
        return [rpc_code(lambda: self.unary()(huge.SerializeToString(), timeout=30))]

    # --- admission
    def refused_inflight_bytes(self):
        """Under --max-inflight-bytes 1 MiB: the first request runs alone, the others are refused."""
        futures = [self.unary().future(MEDIUM, timeout=30) for _ in range(3)]
        return [rpc_code(f.result) for f in futures]

    def refused_queue_full(self):
        """Under --max-queue-size 1 --workers 1 --no-batching."""
        futures = [self.unary().future(MEDIUM, timeout=30) for _ in range(4)]
        return [rpc_code(f.result) for f in futures]

    # --- OIP
    def oip_request(self, length, batch=1):
        q = RNG.standard_normal((batch, length, 512)).astype(np.float32)
        return oip.ModelInferRequest(model_name="demo", inputs=[oip.ModelInferRequest.InferInputTensor(
            name="query", datatype="FP32", shape=[batch, length, 512])], raw_input_contents=[q.tobytes()])

    def oip_endings(self):
        infer = self.channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                                         request_serializer=oip.ModelInferRequest.SerializeToString)
        codes = [rpc_code(lambda: infer(self.oip_request(2048), timeout=0.001)),
                 rpc_code(lambda: infer(self.oip_request(4), timeout=10))]
        f = infer.future(self.oip_request(4096), timeout=30)
        time.sleep(0.1)
        f.cancel()
        codes.append("CANCELLED" if f.cancelled() else "not cancelled")
        stream = self.channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer",
                                            request_serializer=oip.ModelInferRequest.SerializeToString)
        call = stream(iter([self.oip_request(4), self.oip_request(4096)]), timeout=30)
        next(call)
        call.cancel()
        codes.append("stream CANCELLED")
        return codes

    # --- AttendStream
    def stream_endings(self):
        stream = self.channel.stream_stream(ATTEND_STREAM)
        release = threading.Event()

        def held(*messages):
            yield from messages
            release.wait(30)

        codes = []
        call = stream(held(attend_bytes(1, 4, 1), MEDIUM), timeout=30)
        next(call)
        time.sleep(0.05)
        call.cancel()  # cancelled with a request in compute
        codes.append("cancelled")
        call = stream(held(SLOW), timeout=0.2)  # past its deadline in compute
        codes.append(rpc_code(lambda: list(call)))
        call = stream(iter([attend_bytes(1, 4, i) for i in range(5)]), timeout=30)  # half-closed, read to the end
        codes.append(rpc_code(lambda: codes.append(f"{len(list(call))} answers")))
        call = stream(iter([SMALL, b"\xff\xff"]), timeout=30)  # ends on an undecodable message
        codes.append(rpc_code(lambda: list(call)))
        release.set()
        return codes

    # --- kept keys and values
    def kv_endings(self):
        create = self.channel.unary_unary("/attnserve.v1.AttentionService/CreateMemory")
        kv = lib.to_wire(pb, RNG.standard_normal((1, 4096, 512)))
        codes = [rpc_code(lambda: create(pb.CreateMemoryRequest(model="demo", key=kv, value=kv).SerializeToString(),
                                         timeout=0.005))]
        opened = self.channel.unary_unary("/attnserve.v1.AttentionService/OpenSession")(
            pb.OpenSessionRequest(model="demo", batch=1).SerializeToString(), timeout=10)
        handle = pb.KvHandle.FromString(opened).handle
        step = pb.AttendRequest(session=handle, query=lib.to_wire(pb, RNG.standard_normal((1, 3, 512))))
        codes.append(rpc_code(lambda: self.unary()(step.SerializeToString(), timeout=10)))
        # Batched steps: one answered, one past its deadline in compute (a 4,000-token chunk rides).
        others = [pb.KvHandle.FromString(self.channel.unary_unary("/attnserve.v1.AttentionService/OpenSession")(
            pb.OpenSessionRequest(model="demo", batch=1).SerializeToString(), timeout=10)).handle for _ in range(2)]
        batched, late = pb.AttendRequest(), pb.AttendRequest()
        for h in [handle] + others:
            batched.steps.add(session=h, query=lib.to_wire(pb, RNG.standard_normal((1, 1, 512))))
        late.steps.add(session=others[0], query=lib.to_wire(pb, RNG.standard_normal((1, 4000, 512))))
        late.steps.add(session=others[1], query=lib.to_wire(pb, RNG.standard_normal((1, 1, 512))))
        codes.append(rpc_code(lambda: self.unary()(batched.SerializeToString(), timeout=10)))
        codes.append(rpc_code(lambda: self.unary()(late.SerializeToString(), timeout=0.05)))
        return codes

    # --- gRPC's own services
    def health_and_reflection(self):
        codes = [rpc_code(lambda: self.unary("/grpc.health.v1.Health/Check")(b"", timeout=10))]
        watch = self.channel.unary_stream("/grpc.health.v1.Health/Watch")(b"", timeout=30)
        next(watch)
        watch.cancel()
        codes.append("watch cancelled")
        reflection = self.channel.stream_stream("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo")
        codes.append(f"{len(list(reflection(iter([LIST_SERVICES]), timeout=10)))} reflection answer")
        return codes

    # --- open across the stop (long-lived: the stop ends them, and counts none as cut)
    def open_across_the_stop(self):
        watch = self.channel.unary_stream("/grpc.health.v1.Health/Watch")(b"", timeout=60)
        next(watch)
        release = threading.Event()

        def held():
            yield LIST_SERVICES
            release.wait(60)

        reflection = self.channel.stream_stream("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo")(
            held(), timeout=60)
        next(reflection)
        idle = self.channel.stream_stream(ATTEND_STREAM)(held(), timeout=60)
        self.keep += [watch, reflection, idle, release]
        return ["watch open", "reflection open", "idle stream open"]

    def close(self):
        for k in self.keep:
            (k.set if isinstance(k, threading.Event) else k.cancel)()
        self.channel.close()


# Each ending: its name, the method of Traffic, the server flags it needs.
ENDINGS = [
    ("unary deadline before pickup (request uploading)", "deadline_before_pickup", ()),
    ("unary deadline in compute", "deadline_in_compute", ()),
    ("unary cancel in compute", "cancel_in_compute", ()),
    ("RST_STREAM mid-upload", "rst_mid_upload", ()),
    ("RST_STREAM in compute", "rst_in_compute", ()),
    ("client killed mid-upload", ("killed", "upload"), ()),
    ("client killed in compute", ("killed", "compute"), ()),
    ("malformed messages", "malformed", ()),
    ("message over --max-message-bytes", "oversize", ()),
    ("refused: in-flight bytes", "refused_inflight_bytes", ("--max-inflight-bytes", "1048576")),
    ("refused: queue full", "refused_queue_full",
     ("--max-queue-size", "1", "--workers", "1", "--no-batching")),
    ("OIP ModelInfer and ModelStreamInfer", "oip_endings", ()),
    ("AttendStream endings", "stream_endings", ()),
    ("kept keys and values (a memory past its deadline, a step, batched steps answered and late)",
     "kv_endings", ()),
    ("health and reflection", "health_and_reflection", ()),
]


def run(traffic, method):
    if isinstance(method, tuple):
        return getattr(traffic, method[0])(*method[1:])
    return getattr(traffic, method)()


def settle(server):
    """Waits until attnserve has nothing in flight (compute of abandoned calls done) and a moment more
    (CreateMemory is not in the gauge; the hand-off's quiet period is 250 ms)."""
    lib.wait_until(lambda: lib.in_flight(server, None) == 0, timeout=30, step=0.05)
    time.sleep(0.5)


def stop(server):
    start = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    try:
        code = server.proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        code = "hung"
    took = time.monotonic() - start
    server._drain.join(timeout=10)
    return took, code, server.output()


CUT = ("CANCELLED", "UNAVAILABLE")  # What a client whose call the stop cut sees.


def cut_count(out):
    m = re.search(r"the grace period .* cut (\d+) calls?", out)
    return int(m.group(1)) if m else 0


def quiet_stop(binary, name, method, flags):
    server = lib.Server(binary, "--shutdown-grace", "10", *flags)
    traffic = Traffic(server)
    seen = run(traffic, method)
    settle(server)
    took, code, out = stop(server)
    traffic.close()
    print(f"  {name}: clients saw {seen}; stopped in {took:.3f} s, exit {code}")
    check(f"{name}: exit 0", code == 0, f"exit {code}: {out[-600:]}")
    check(f"{name}: stops in under {STOP_LIMIT_S} s", took < STOP_LIMIT_S, f"{took:.2f} s")
    check(f"{name}: says it stopped", "attnserve: stopped" in out, out[-600:])
    return took


class InFlight:
    """Calls left in flight at the stop: unary Attend, an AttendStream, an OIP ModelInfer, each with
    a request that computes for about `request`'s time. `outcomes()` is what their clients saw."""

    def __init__(self, traffic, kinds, batch):
        self.traffic, self.calls = traffic, []
        request = attend_bytes(batch, 1024)
        for kind in kinds:
            if kind == "attend":
                self.calls.append(("attend", traffic.unary().future(request, timeout=60)))
            elif kind == "stream":
                call = traffic.channel.stream_stream(ATTEND_STREAM)(iter([request]), timeout=60)
                box = []
                t = threading.Thread(target=lambda c=call, b=box: b.append(rpc_code(lambda: list(c))))
                t.start()
                self.calls.append(("stream", (t, box)))
            elif kind == "oip":
                infer = traffic.channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                                                    request_serializer=oip.ModelInferRequest.SerializeToString)
                self.calls.append(("oip", infer.future(traffic.oip_request(1024, batch), timeout=60)))
        self.answered_at = []
        for _, c in self.calls:
            if not isinstance(c, tuple):
                c.add_done_callback(lambda f: self.answered_at.append(time.monotonic()))

    def done(self):
        return sum(c[0].is_alive() is False if kind == "stream" else c.done() for kind, c in self.calls)

    def accepted(self):
        """Waits until attnserve counts in flight every call not already answered (a refusal)."""
        return lib.all_reached(self.traffic.server, len(self.calls), self.done, method=None, timeout=20)

    def outcomes(self):
        seen = []
        for kind, c in self.calls:
            if kind == "stream":
                c[0].join(60)
                seen.append(c[1][0] if c[1] else "no answer")
                self.answered_at.append(time.monotonic())
            else:
                seen.append(rpc_code(lambda: c.result(timeout=60)))
        return seen


def cut_after_traffic(binary):
    """Every ending's traffic, then four calls really in flight when a short grace period ends."""
    server = lib.Server(binary, "--shutdown-grace", "0.8", "--workers", "1")
    traffic = Traffic(server)
    for name, method, flags in ENDINGS:
        if not flags:
            run(traffic, method)
    settle(server)
    calls = InFlight(traffic, ["attend", "attend", "stream", "oip"], 16)
    check("cut: the four calls are accepted", calls.accepted(), f"in flight {lib.in_flight(server, None)}")
    took, code, out = stop(server)
    seen = calls.outcomes()
    traffic.close()
    cut = sum(s in CUT for s in seen)
    print(f"  cut after every ending (grace 0.8 s): calls {seen}; stopped in {took:.3f} s, exit {code}, "
          f"log names {cut_count(out)}")
    check("cut: every call in flight gets a status", "no answer" not in seen, str(seen))
    check("cut: exit 1", code == 1, f"exit {code}: {out[-600:]}")
    check("cut: the log names exactly the calls the clients saw cut",
          cut > 0 and cut_count(out) == cut, f"clients saw {cut} cut; {out[-600:]}")
    check("cut: gone by the end of the grace period (+0.5 s)", took < 1.3, f"{took:.2f} s")


def soak(binary, rounds, seed):
    """`rounds` stops, each after a random mix of endings and of calls left in flight; each exit code,
    named count and stop time checked against what the clients saw."""
    rnd = random.Random(seed)
    worst = {"quiet": 0.0, "busy": 0.0, "cut": 0.0}
    rounds_of = {"quiet": 0, "busy": 0, "cut": 0}
    cut_seen = cut_named = 0
    for r in range(rounds):
        mode = rnd.choice(["quiet", "quiet", "busy", "cut"])
        grace = "0.6" if mode == "cut" else "10"
        mix = rnd.sample(ENDINGS, rnd.randint(1, 4))
        flags = [f for _, _, fs in mix for f in fs]  # A refusal's limits hold for the calls in flight too.
        server = lib.Server(binary, "--shutdown-grace", grace, *flags)
        traffic = Traffic(server)
        threads = [threading.Thread(target=run, args=(traffic, m)) for _, m, _ in mix]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        if rnd.random() < 0.3:
            traffic.open_across_the_stop()
        settle(server)
        kinds = [] if mode == "quiet" else rnd.choices(["attend", "stream", "oip"], k=rnd.randint(1, 3))
        calls = InFlight(traffic, kinds, 16 if mode == "cut" else 4)
        accepted = calls.accepted()
        sigterm = time.monotonic()
        took, code, out = stop(server)
        seen = calls.outcomes()
        traffic.close()
        cut = sum(s in CUT for s in seen)
        after_answer = sigterm + took - max(calls.answered_at, default=sigterm)
        label = f"round {r + 1} ({mode}; {', '.join(n for n, _, _ in mix)}; in flight {kinds})"
        ok = accepted and code == (1 if cut else 0) and cut_count(out) == cut
        if mode == "quiet":
            ok = ok and took < STOP_LIMIT_S
        elif mode == "busy":
            ok = ok and after_answer < AFTER_ANSWER_LIMIT_S
        else:
            ok = ok and took < float(grace) + 0.5
        worst[mode] = max(worst[mode], took if mode != "busy" else after_answer)
        rounds_of[mode] += 1
        cut_seen += cut
        cut_named += cut_count(out)
        check(label, ok, f"clients saw {seen}, exit {code}, log names {cut_count(out)}, stopped in {took:.2f} s "
                         f"({after_answer:.2f} s after the last answer): {out[-400:]}")
    print(f"  soak: {rounds_of['quiet']} quiet, {rounds_of['busy']} busy, {rounds_of['cut']} cut rounds; slowest "
          f"quiet stop {worst['quiet']:.3f} s; busy: {worst['busy']:.3f} s after the last answer; cut: "
          f"{worst['cut']:.3f} s (grace 0.6 s); calls the clients saw cut {cut_seen}, named in the logs {cut_named}")


@pytest.mark.parametrize("name,method,flags", ENDINGS, ids=[e[0] for e in ENDINGS])
def test_a_stop_after_each_way_a_call_ends_exits_0_at_once(attnserve, name, method, flags):
    quiet_stop(attnserve, name, method, flags)


def test_long_lived_calls_open_across_the_stop(attnserve):
    server = lib.Server(attnserve, "--shutdown-grace", "10")
    traffic = Traffic(server)
    seen = traffic.open_across_the_stop()
    time.sleep(0.5)
    took, code, out = stop(server)
    traffic.close()
    print(f"  open across the stop ({seen}): stopped in {took:.3f} s, exit {code}")
    check("long-lived calls open across the stop: exit 0", code == 0, f"exit {code}: {out[-600:]}")
    check(f"long-lived calls open across the stop: stops in under {STOP_LIMIT_S} s", took < STOP_LIMIT_S,
          f"{took:.2f} s")


def test_a_real_cut_names_exactly_the_calls_cut(attnserve):
    cut_after_traffic(attnserve)


def main():  # The soak (not part of the suite): stop_test.py PATH/TO/attnserve --soak N [--seed S]
    p = argparse.ArgumentParser()
    p.add_argument("binary")
    p.add_argument("--soak", type=int, required=True)
    p.add_argument("--seed", type=int, default=31)
    a = p.parse_args()
    soak(a.binary, a.soak, a.seed)
    return check.summary("stop_soak")


if __name__ == "__main__":
    sys.exit(main() if "--soak" in sys.argv else pytest.main([__file__, "--attnserve", *sys.argv[1:]]))
