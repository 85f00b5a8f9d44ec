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
  directory, a symlink, a socket another server listens on (never taken over, also spelled with
  %XX, which gRPC would decode), a socket whose listener never accepts (refused at once, no hang),
  a path longer than a socket address holds, `--address unix:` with no path, other gRPC schemes
  (unix-abstract:), and a path whose lock another server holds though its socket was removed.
- A hostile review's findings (2026-12-05), each a check here: the socket reaches PATH with its
  mode already set (never with the umask's); a stop removes PATH only while it is this server's
  socket (not a successor's); --unix-socket-mode takes only octal 0-0777 and refuses the rest
  naming it (8, 999, 7a, 0x1ff, empty) instead of crashing or misreading; each local user is a peer
  of its own (one user's connections cannot lock another out); the Unix socket's share of
  --max-connections is a quarter, TCP's the rest.

usage: python3 -m pytest unix_socket_test.py --attnserve build/attnserve --cli build/attnserve-cli
"""
import os
import pwd
import socket
import stat
import subprocess
import time

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
    p = subprocess.run([attnserve, "--address", "127.0.0.1:0", "--metrics-address", "", "--http-address", "", *args],
                       capture_output=True, text=True, timeout=60)
    return p.returncode, p.stdout + p.stderr


def test_paths_the_socket_must_not_take(attnserve, checks):
    tmp = lib.temp_dir("attnserve-unix-")
    regular = os.path.join(tmp, "file")
    open(regular, "w").write("keep me")
    fifo = os.path.join(tmp, "fifo")
    os.mkfifo(fifo)
    for name, path, says in [("a regular file", regular, "a file is there, not a socket"),
                             ("a FIFO", fifo, "a FIFO is there, not a socket"),
                             ("a directory", tmp, "a directory is there, not a socket"),
                             ("a path too long", os.path.join(tmp, "x" * 120), "a socket address holds 107")]:
        code, out = refusal(attnserve, "--address", f"unix:{path}")
        checks(f"{name}: refused at start, naming it", code != 0 and path in out and says in out, out[-300:])
    checks("the regular file is untouched", open(regular).read() == "keep me")
    checks("nothing made beside a path refused for what is there (no lock file)",
           not any(os.path.exists(p + ".lock") for p in (regular, fifo, tmp)))
    checks("the FIFO is untouched", stat.S_ISFIFO(os.stat(fifo).st_mode))
    code, out = refusal(attnserve, "--address", "unix:")
    checks("unix: with no path refused", code != 0 and "unix:" in out, out[-300:])

    path = os.path.join(tmp, "live.sock")
    first = lib.Server(attnserve, "--address", f"unix:{path}")
    code, out = refusal(attnserve, "--address", f"unix:{path}")
    checks("another attnserve's socket is never taken over", code != 0 and "another process listens" in out,
           out[-300:])
    other = os.path.join(tmp, "other.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(other)
    listener.listen(4)
    code, out = refusal(attnserve, "--address", f"unix:{other}")
    checks("another program's live socket is never taken over", code != 0 and "another process listens" in out
           and os.path.exists(other), out[-300:])
    listener.close()
    pb, rpc = lib.load_stubs()
    with grpc.insecure_channel(f"unix:{path}") as channel:
        ok = rpc.AttentionServiceStub(channel).ListModels(pb.ListModelsRequest(), timeout=30)
    checks("the first server still answers on its socket", any(m.name == "demo" for m in ok.models))
    first.stop()


def test_what_a_hostile_review_found(attnserve, checks):
    tmp = lib.temp_dir("attnserve-unix-")
    path = os.path.join(tmp, "a.sock")

    # The socket reaches PATH with its mode already set: watched from before the start, every
    # moment it exists it has --unix-socket-mode, even under a umask of 000.
    seen, observed = set(), 0
    proc = subprocess.Popen([attnserve, "--address", "127.0.0.1:0", "--address", f"unix:{path}",
                             "--metrics-address", "", "--http-address", "", "--unix-socket-mode", "0600"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            umask=0)
    end = time.time() + 60
    while time.time() < end and observed < 50:  # Until it has been seen there 50 times.
        try:
            seen.add(stat.S_IMODE(os.lstat(path).st_mode))
            observed += 1
        except FileNotFoundError:
            pass
    banner = proc.stdout.readline()
    checks("under umask 000 the socket never had another mode than 0600", seen == {0o600},
           f"{sorted(oct(m) for m in seen)}; {banner[:120]}")
    # A successor at PATH (this one's socket removed by someone) keeps its socket when this one stops.
    os.unlink(path)
    lock_held, out = refusal(attnserve, "--address", f"unix:{path}")
    checks("its lock keeps another server off PATH while it runs", lock_held != 0 and "holds" in out, out[-300:])
    successor = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    successor.bind(path)
    successor.listen(4)
    proc.terminate()
    proc.wait(timeout=60)
    checks("a stop leaves a socket at PATH that is not its own", os.path.exists(path))
    successor.close()
    os.unlink(path)

    # A live socket spelled with %XX (gRPC decodes it) is not taken over.
    victim_path = os.path.join(tmp, "v.sock")
    victim = lib.Server(attnserve, "--address", f"unix:{victim_path}")
    literal = os.path.join(tmp, "v%2esock")
    spelled = lib.Server(attnserve, "--address", f"unix:{literal}")
    pb, rpc = lib.load_stubs()
    with grpc.insecure_channel(f"unix:{victim_path}") as channel:
        alive = rpc.AttentionServiceStub(channel).ListModels(pb.ListModelsRequest(), timeout=30)
    checks("a %XX spelling of another server's socket is a path of its own, the other untouched",
           os.path.exists(victim_path) and any(m.name == "demo" for m in alive.models) and
           stat.S_ISSOCK(os.lstat(literal).st_mode))
    spelled.stop()
    victim.stop()

    # A socket whose listener never accepts (its backlog full): refused at once, no hang.
    stuck = os.path.join(tmp, "stuck.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(stuck)
    listener.listen(0)
    queued = []
    for _ in range(8):
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        c.setblocking(False)
        try:
            c.connect(stuck)
        except BlockingIOError:
            pass
        queued.append(c)
    start = time.time()
    code, out = refusal(attnserve, "--address", f"unix:{stuck}")
    checks("a listener that never accepts: refused within seconds", code != 0 and time.time() - start < 30
           and "another process listens" in out, f"{time.time() - start:.1f} s: {out[-200:]}")
    for c in queued:
        c.close()
    listener.close()

    link = os.path.join(tmp, "link.sock")
    os.symlink(victim_path, link)
    code, out = refusal(attnserve, "--address", f"unix:{link}")
    checks("a symlink at PATH: refused, left as it is", code != 0 and "symlink" in out and os.path.islink(link),
           out[-200:])
    for mode in ["8", "999", "7a", "0x1ff", "", "1777", "0o600"]:
        code, out = refusal(attnserve, "--address", f"unix:{path}", "--unix-socket-mode", mode)
        checks(f"--unix-socket-mode {mode!r}: refused naming it (a flag's error, no crash)",
               0 < code < 128 and "--unix-socket-mode" in out and "octal" in out, f"exit {code}: {out[-200:]}")
    for address in ["unix-abstract:attnserve", "vsock:1:2", "dns:///localhost:1"]:
        code, out = refusal(attnserve, "--address", address)
        checks(f"--address {address}: refused", 0 < code < 128 and "expected host:port or unix:PATH" in out,
               out[-200:])

    # Each local user is a peer of its own: one user's connections up to the bound lock no other
    # user out. (Root runs the server; `nobody` floods.)
    os.chmod(tmp, 0o755)
    shared = lib.Server(attnserve, "--address", f"unix:{path}", "--unix-socket-mode", "0666",
                        "--max-connections-per-peer", "3")
    nobody = pwd.getpwnam("nobody").pw_uid
    flood = subprocess.Popen(["/usr/bin/python3", "-c", f"""
import os, socket, time
os.setuid({nobody})
held = []
for _ in range(6):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); s.connect({path!r}); held.append(s)
print("held", flush=True)
time.sleep(60)
"""], stdout=subprocess.PIPE, text=True)
    flood.stdout.readline()
    lib.wait_until(lambda: metric(shared, "attnserve_connections_refused_total", 'reason="peer_connections"') >= 3)
    with grpc.insecure_channel(f"unix:{path}") as channel:
        try:
            mine = rpc.AttentionServiceStub(channel).ListModels(pb.ListModelsRequest(), timeout=10)
            ok = any(m.name == "demo" for m in mine.models)
        except grpc.RpcError as e:
            ok = False
            print(e)
    checks("another user's flood up to its bound leaves this user's calls answered", ok)
    flood.kill()
    shared.stop()
