#!/usr/bin/python3
"""The Unix domain socket listener (`--address unix:PATH` beside TCP; docs/api.md "Unix domain
socket") through the real server.

- The same services on both: an Attend over the socket answers exactly what the same call over TCP
  answers (same bytes), a session stepped over one and read over the other, the CLI over the socket.
- The socket's permissions: --unix-socket-mode (0660 by default; 0600 given), and the file is gone
  after a graceful stop.
- Guarded like TCP: its connections count in attnserve_connections, and --max-connections-per-peer
  holds for them (every local caller is one peer, "unix").
- Paths it must not take, each refused at start naming the path and why: a regular file, a FIFO, a
  directory, a socket another server listens on (never taken over), a path longer than a socket
  address holds, and `--address unix:` with no path.

usage: python3 -m pytest unix_socket_test.py --attnserve build/attnserve --cli build/attnserve-cli
"""
import os
import socket
import stat
import subprocess

import grpc
import numpy as np

import attnserve_py as lib  # tests/lib, on the path by tests/conftest.py


def call(target, pb, rpc, request, metadata=None):
    with grpc.insecure_channel(target) as channel:
        return rpc.AttentionServiceStub(channel).Attend(request, timeout=30, metadata=metadata)


def test_the_same_services_over_the_socket(attnserve, cli, checks):
    pb, rpc = lib.load_stubs()
    tmp = lib.temp_dir("attnserve-unix-")
    path = os.path.join(tmp, "attnserve.sock")
    server = lib.Server(attnserve, "--address", f"unix:{path}")
    unix = f"unix:{path}"
    checks("the banner names the socket", f"unix socket {path}" in server.banner, server.banner)
    mode = stat.S_IMODE(os.stat(path).st_mode)
    checks("a socket with mode 0660 by default", stat.S_ISSOCK(os.stat(path).st_mode) and mode == 0o660, oct(mode))

    rng = np.random.default_rng(66)
    q = lib.to_wire(pb, rng.standard_normal((2, 5, 512)).astype(np.float32))
    over_tcp = call(server.target, pb, rpc, pb.AttendRequest(model="demo", query=q))
    over_unix = call(unix, pb, rpc, pb.AttendRequest(model="demo", query=q))
    checks("an Attend over the socket answers the same bytes as over TCP",
           over_unix.output.data == over_tcp.output.data and len(over_unix.output.data) == 2 * 5 * 512 * 4)

    with grpc.insecure_channel(unix) as channel:
        stub = rpc.AttentionServiceStub(channel)
        handle = stub.OpenSession(pb.OpenSessionRequest(model="demo", batch=1), timeout=30).handle
        step = lib.to_wire(pb, rng.standard_normal((1, 3, 512)).astype(np.float32))
        stub.Attend(pb.AttendRequest(session=handle, query=step), timeout=30)
    # The session opened over the socket, stepped again over TCP: one server, one store.
    again = call(server.target, pb, rpc, pb.AttendRequest(session=handle, query=step, session_length=3))
    checks("a session opened over the socket steps over TCP", again.session_length == 6, str(again.session_length))

    p = subprocess.run([cli, "--target", unix, "attend", "--model", "demo"], capture_output=True, text=True,
                       timeout=60)
    checks("attnserve-cli attend over the socket", p.returncode == 0 and "latency" in p.stdout, p.stdout + p.stderr)

    # Its connections are the guard's: counted, and bounded per peer (all local callers: "unix").
    # (Channels of their own: gRPC would share one connection between channels of one target.)
    held = [grpc.insecure_channel(unix, options=[("grpc.use_local_subchannel_pool", 1)]) for _ in range(3)]
    for ch in held:
        grpc.channel_ready_future(ch).result(timeout=30)
    counted = lib.wait_until(lambda: metric(server, "attnserve_connections") >= 3)
    checks("the socket's connections count in attnserve_connections", counted,
           str(metric(server, "attnserve_connections")))
    for ch in held:
        ch.close()
    server.stop()
    checks("the socket file is gone after a graceful stop", not os.path.exists(path))

    limited = lib.Server(attnserve, "--address", f"unix:{path}", "--max-connections-per-peer", "2",
                         "--unix-socket-mode", "0600")
    mode = stat.S_IMODE(os.stat(path).st_mode)
    checks("--unix-socket-mode 0600", mode == 0o600, oct(mode))
    socks = []
    for _ in range(4):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)
        socks.append(s)
    refused = lib.wait_until(
        lambda: metric(limited, "attnserve_connections_refused_total", 'reason="peer_connections"') >= 2)
    checks("--max-connections-per-peer holds on the socket (the third and fourth refused)", refused,
           str(metric(limited, "attnserve_connections_refused_total", 'reason="peer_connections"')))
    for s in socks:
        s.close()
    limited.stop()


def metric(server, name, label=""):
    return sum(float(line.split()[-1]) for line in lib.metrics_lines(server, name) if label in line)


def refusal(attnserve, *args):
    p = subprocess.run([attnserve, "--address", "127.0.0.1:0", "--metrics-address", "", *args],
                       capture_output=True, text=True, timeout=60)
    return p.returncode, p.stdout + p.stderr


def test_paths_the_socket_must_not_take(attnserve, checks):
    tmp = lib.temp_dir("attnserve-unix-")
    regular = os.path.join(tmp, "file")
    open(regular, "w").write("keep me")
    fifo = os.path.join(tmp, "fifo")
    os.mkfifo(fifo)
    for name, path, says in [("a regular file", regular, "something other than a socket"),
                             ("a FIFO", fifo, "something other than a socket"),
                             ("a directory", tmp, "something other than a socket"),
                             ("a path too long", os.path.join(tmp, "x" * 120), "at most 107")]:
        code, out = refusal(attnserve, "--address", f"unix:{path}")
        checks(f"{name}: refused at start, naming it", code != 0 and path in out and says in out, out[-300:])
    checks("the regular file is untouched", open(regular).read() == "keep me")
    checks("the FIFO is untouched", stat.S_ISFIFO(os.stat(fifo).st_mode))
    code, out = refusal(attnserve, "--address", "unix:")
    checks("unix: with no path refused", code != 0 and "unix:" in out, out[-300:])

    path = os.path.join(tmp, "live.sock")
    first = lib.Server(attnserve, "--address", f"unix:{path}")
    code, out = refusal(attnserve, "--address", f"unix:{path}")
    checks("another server's live socket is never taken over", code != 0 and "another process listens" in out,
           out[-300:])
    pb, rpc = lib.load_stubs()
    with grpc.insecure_channel(f"unix:{path}") as channel:
        ok = rpc.AttentionServiceStub(channel).ListModels(pb.ListModelsRequest(), timeout=30)
    checks("the first server still answers on its socket", any(m.name == "demo" for m in ok.models))
    first.stop()
