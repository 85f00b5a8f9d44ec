#!/usr/bin/python3
"""Messages that do not decode, sent as raw bytes by a Python gRPC peer to the real attnserve binary:
a unary call gets INVALID_ARGUMENT with the reason and is counted; a stream answers the requests
before the bad message and ends with INVALID_ARGUMENT saying which message. Then SIGTERM with a stream
still open: the process exits 0 well within the grace period.

usage: python3 -m pytest wire_errors_test.py --attnserve PATH/TO/attnserve
"""
import os
import re
import signal
import sys
import threading
import time
import urllib.request

import grpc
import numpy as np

import pytest  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
import attnserve_py as lib  # noqa: E402

check = lib.Checks()


def counter(text, series):
    m = re.search("^" + re.escape(series) + r" (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def expect_refusal(name, call, code, says):
    """`call()` must fail with gRPC status `code` whose message contains `says`."""
    try:
        call()
        check(f"{name}: refused", False, "it was answered")
    except grpc.RpcError as e:
        check(f"{name}: {code.name}", e.code() == code, f"{e.code()} {e.details()!r}")
        check(f"{name}: says why", says in (e.details() or ""), repr(e.details()))


def test_undecodable_messages_and_a_stop_with_a_stream_open(attnserve):
    pb, _ = lib.load_stubs()
    server = lib.Server(attnserve, "--shutdown-grace", "10")
    channel = grpc.insecure_channel(server.target)
    attend = channel.unary_unary("/attnserve.v1.AttentionService/Attend")  # bytes in, bytes out
    stream = channel.stream_stream("/attnserve.v1.AttentionService/AttendStream")
    rng = np.random.default_rng(5)
    good = pb.AttendRequest(model="demo", query=lib.to_wire(pb, rng.standard_normal((1, 3, 512))))

    # A second server on a port already in use must refuse to start (gRPC's default SO_REUSEPORT let
    # it start and silently share the port with the first, each getting some of the connections).
    import subprocess
    second = subprocess.Popen([attnserve, "--address", server.target, "--metrics-address", "", "--http-address", ""],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        second_out, _ = second.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        second.kill()
        second_out, _ = second.communicate()
    check("a second server on a port in use: exit 2", second.returncode == 2,
          f"exit {second.returncode}: {second_out[-300:]!r}")
    check("a second server on a port in use: names the address",
          f"--address {server.target}" in second_out and "in use" in second_out, repr(second_out[-300:]))
    not_utf8 = b"\x0a\x02\xff\xfe"  # field 1 (model), 2 bytes that are not UTF-8
    truncated = good.SerializeToString()[:-7]

    # The reason names the field where protobuf says which (a string that is not UTF-8).
    for name, raw, says in (("model not UTF-8", not_utf8, "attnserve.v1.AttendRequest.model"),
                            ("truncated message", truncated, "do not decode as an attnserve.v1.AttendRequest")):
        expect_refusal(f"unary {name}", lambda: attend(raw, timeout=10), grpc.StatusCode.INVALID_ARGUMENT, says)
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics").read().decode()
    check("undecodable unary calls are counted",
          counter(metrics, 'attnserve_requests_total{code="INVALID_ARGUMENT",method="Attend",model=""}') == 2,
          metrics[:2000])

    # A client's bad input must not make the server write per request: an unread or slow log pipe
    # would block the server's threads (the soak stalled so at ~60,000 requests), and a client
    # could fill a log volume. 2,000 undecodable messages, then the server's output has grown by
    # at most a few lines.
    before = len(server.output())
    for _ in range(2000):
        try:
            attend(not_utf8, timeout=10)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.INVALID_ARGUMENT:
                check("2,000 undecodable messages: each refused", False, f"{e.code()} {e.details()!r}")
                break
    time.sleep(0.2)
    grown = server.output()[before:]
    check("2,000 undecodable messages: server output grows by at most 1 KiB", len(grown) <= 1024,
          f"{len(grown)} bytes, starting {grown[:300]!r}")

    # A unary call whose request message never arrives: the client half-closes without one, or
    # cancels before sending it, or its deadline passes first. None is a request for model "": the
    # first gets INVALID_ARGUMENT saying so, the others are counted as CANCELLED and as
    # DEADLINE_EXCEEDED (gRPC marks a call whose deadline passed cancelled too). attnserve.v1's
    # Attend and the Open Inference Protocol's ModelInfer alike.
    never = threading.Event()

    def no_request_yet():
        never.wait()
        yield b""

    methods = {"Attend": "/attnserve.v1.AttentionService/Attend",
               "ModelInfer": "/inference.GRPCInferenceService/ModelInfer"}
    for method, path in methods.items():
        no_message = channel.stream_unary(path)
        expect_refusal(f"{method} without a message", lambda: no_message(iter([]), timeout=10),
                       grpc.StatusCode.INVALID_ARGUMENT, "no request message")
        for _ in range(3):
            future = no_message.future(no_request_yet(), timeout=10)
            time.sleep(0.3)
            future.cancel()
        late = [no_message.future(no_request_yet(), timeout=0.2) for _ in range(2)]
        for future in late:
            check(f"{method} whose deadline passed before its request: the client's status",
                  future.exception() is not None and future.code() == grpc.StatusCode.DEADLINE_EXCEEDED,
                  str(future.exception()))
    time.sleep(0.5)
    never.set()
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics").read().decode()
    undecodable = {"Attend": 2002, "ModelInfer": 0}  # the 2 + 2,000 undecodable Attend messages above
    for method in methods:
        lines = "\n".join(l for l in metrics.splitlines() if f'method="{method}"' in l)
        series = 'attnserve_requests_total{code="%s",method="' + method + '",model=""}'
        check(f"{method}: no call counted as a request for model ''", counter(metrics, series % "NOT_FOUND") == 0,
              lines)
        check(f"{method}: the call without a message is counted",
              counter(metrics, series % "INVALID_ARGUMENT") == 1 + undecodable[method], lines)
        check(f"{method}: the cancelled calls are counted as CANCELLED", counter(metrics, series % "CANCELLED") == 3,
              lines)
        check(f"{method}: the calls whose deadline passed first are counted as DEADLINE_EXCEEDED",
              counter(metrics, series % "DEADLINE_EXCEEDED") == 2, lines)

    first = pb.AttendRequest()
    first.CopyFrom(good)
    first.request_id = 1
    third = pb.AttendRequest()
    third.CopyFrom(good)
    third.request_id = 3
    call = stream(iter([first.SerializeToString(), not_utf8, third.SerializeToString()]), timeout=10)
    answers = []
    expect_refusal("stream with an undecodable message",
                   lambda: answers.extend(pb.AttendResponse.FromString(raw) for raw in call),
                   grpc.StatusCode.INVALID_ARGUMENT, "message 2 on this stream")
    check("the request before it is answered",
          [a.request_id for a in answers] == [1] and not answers[0].HasField("error"),
          str([(a.request_id, a.error.code) for a in answers]))

    # SIGTERM with an idle stream open (its read outstanding): finished with UNAVAILABLE, exit 0.
    idle_results = []
    requests_done = threading.Event()

    def idle_requests():
        requests_done.wait()
        return
        yield  # noqa: unreachable: an iterator that sends nothing until released

    idle = stream(idle_requests(), timeout=30)

    def consume():
        try:
            for _ in idle:
                pass
            idle_results.append("OK")
        except grpc.RpcError as e:
            idle_results.append(e.code())

    reader = threading.Thread(target=consume)
    reader.start()
    time.sleep(0.3)
    start = time.time()
    out = server.stop()
    took = time.time() - start
    requests_done.set()
    reader.join(10)
    check("SIGTERM with an open stream exits 0 within the grace period", took < 10, f"{took:.1f} s {out}")
    check("the open stream was finished with UNAVAILABLE", idle_results == [grpc.StatusCode.UNAVAILABLE],
          str(idle_results))

    # A second SIGTERM (or Ctrl-C twice) while draining must not kill the process: a request in
    # flight is still answered and the exit is 0. (Threads created before main(), e.g. OpenBLAS's
    # pool, do not block the signal: without a handler the default action killed the process.)
    server = lib.Server(attnserve, "--shutdown-grace", "20")
    channel = grpc.insecure_channel(server.target, options=[("grpc.max_receive_message_length", 64 << 20)])
    slow = pb.AttendRequest(model="demo", query=lib.to_wire(pb, rng.standard_normal((8, 512, 512))))
    answer = channel.unary_unary("/attnserve.v1.AttentionService/Attend").future(
        slow.SerializeToString(), timeout=30)
    time.sleep(0.2)  # Accepted and computing.
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.05)
    server.proc.send_signal(signal.SIGTERM)
    code = server.proc.wait(timeout=30)
    check("a second SIGTERM while draining: exit 0", code == 0, f"exit {code}: {server.output()[-500:]}")
    try:
        answer.result()
        check("a second SIGTERM while draining: the request in flight is answered", True)
    except grpc.RpcError as e:
        check("a second SIGTERM while draining: the request in flight is answered", False,
              f"{e.code()} {e.details()!r}")
    channel.close()

    # Bad model files stop the start with exit code 2 and a message naming the file, never a hang
    # or a crash (a FIFO config.json used to hang, a symbolic-link loop to abort).
    import subprocess
    data = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data")
    for case in ("fifo", "symlink loop", "cut storage", "hostile pickle"):
        root = lib.temp_dir("attnserve-badmodels-")
        model = os.path.join(root, "m")
        os.mkdir(model)
        blame = os.path.join(model, "model.pt")
        with open(os.path.join(data, {"cut storage": "storage_cut_short.pt",
                                      "hostile pickle": "pickle_tuple1_on_empty_stack.pt"}.get(case, "mha_e8_h2.pt")), "rb") as f:
            open(blame, "wb").write(f.read())
        if case == "fifo":
            blame = os.path.join(model, "config.json")
            os.mkfifo(blame)
        else:
            open(os.path.join(model, "config.json"), "w").write('{"num_heads": 2}')
        if case == "symlink loop":
            os.symlink(os.path.join(root, "b"), os.path.join(root, "a"))
            os.symlink(os.path.join(root, "a"), os.path.join(root, "b"))
            blame = root + "/"  # either link of the loop, whichever the scan meets first
        try:
            r = subprocess.run([attnserve, "--models", root, "--address", "127.0.0.1:0",
                                "--metrics-address", "", "--http-address", ""], capture_output=True, text=True, timeout=20)
            check(f"bad model ({case}): exit 2 naming {os.path.basename(blame)}",
                  r.returncode == 2 and blame in r.stderr, f"exit {r.returncode}: {r.stderr[-500:]}")
        except subprocess.TimeoutExpired:
            check(f"bad model ({case}): exit 2", False, "start-up hung")


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
