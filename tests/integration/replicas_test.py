#!/usr/bin/python3
"""Three attnserve replicas under steady load while one is restarted (SIGTERM, then started again)
and another is killed (SIGKILL, then started again); every request accounted for. Two modes:

Some of the load is Open Inference Protocol calls (ModelInfer) on the same channels and configs.

  nginx        Python gRPC client -> nginx (deploy/nginx/nginx.conf, grpc_pass) -> the replicas
               with deploy/grpc/service-config-proxy.json (retries, no client-side health checking)
  client-side  Python gRPC client balancing itself: target ipv4:a,b,c with
               deploy/grpc/service-config.json (round_robin, health checking, retries)

and, during the same events, attnserve-bench (the C++ client) with the same target (`--proxy`
behind nginx), and decoding sessions through the attnserve Python package (replica_sessions.py, in
a process of its own): straight to their replica in client-side mode, by their attnserve-route key
through nginx. Sessions on the replica never signalled must lose nothing; on the SIGTERMed one no
step in flight when the SIGTERM came fails (the drain answers it), and sessions on either signalled
replica then fail with a status that names a replica (UNAVAILABLE, or NOT_FOUND from another replica or the
restarted one); every step answered equals one causal call over the session's sequence. Before the
events, attnserve-cli's decode (C++ client) runs sessions through the same target. Answers report the attempts that failed before them
(ServerTiming.previous_attempts). SIGTERM must cost no request in either mode; what SIGKILL costs is
reported. First, behind the same nginx.conf, a replica that resets every call after reading it:
nginx must answer such calls as gRPC UNAVAILABLE, and the client's policy must retry every one; a
request over nginx's client_max_body_size gets RESOURCE_EXHAUSTED naming the limit. A
real Prometheus scrapes every replica through file-based targets and must hold per-replica series.
Loopback only; the load is bounded (a request budget and a time limit per phase).

usage: python3 -m pytest replicas_test.py --attnserve PATH/TO/attnserve --bench PATH/TO/attnserve-bench --cli PATH/TO/attnserve-cli [--threads 6]
"""
import types
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request

import grpc
import numpy as np

import pytest  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
import attnserve_py as lib  # noqa: E402

ROOT = lib.ROOT
MAX_REQUESTS = 60000  # Budget per mode, whatever happens.
PHASES = ("steady", "sigterm", "sigkill", "after")
# deploy/nginx/nginx.conf's grpc-message for calls no replica answered.
NGINX_UNAVAILABLE = "nginx: the replica did not answer this call (connection refused, lost or timed out); retry"


class Replica:
    """One attnserve on fixed ports, so a restart comes back where clients and nginx expect it."""

    def __init__(self, binary, index, tmp):
        self.binary, self.index = binary, index
        self.port, self.metrics_port = lib.free_port(), lib.free_port()
        self.log = open(os.path.join(tmp, f"replica{index}.log"), "a")
        self.proc = None

    def start(self):
        self.proc = subprocess.Popen(
            [self.binary, "--address", f"127.0.0.1:{self.port}", "--metrics-address",
             f"127.0.0.1:{self.metrics_port}", "--http-address", "", "--workers", "1", "--shutdown-grace", "30"],
            stdout=self.log, stderr=subprocess.STDOUT)
        if not lib.wait_until(lambda: lib.health_serving(f"127.0.0.1:{self.port}"), timeout=60, step=0.1):
            raise RuntimeError(f"replica {self.index} did not become SERVING")

    def stop(self, sig):
        self.proc.send_signal(sig)
        return self.proc.wait(timeout=60)


class Load:
    """Threads sending small calls back to back until stopped, every third thread through the Open
    Inference Protocol (ModelInfer) and the others through attnserve.v1 Attend; every outcome recorded
    with the phase it started in, or "sigkill" for a call in flight when the SIGKILL came."""

    def __init__(self, pb, rpc, target, threads, service_config, oip):
        options = [("grpc.service_config", service_config)] if service_config else []
        self.channel = grpc.insecure_channel(target, options=options)
        self.stub = rpc.AttentionServiceStub(self.channel)
        q = np.random.default_rng(3).standard_normal((1, 8, 512)).astype(np.float32)
        self.request = pb.AttendRequest(model="demo", query=lib.to_wire(pb, q))
        opb, orpc = oip
        self.oip_stub = orpc.GRPCInferenceServiceStub(self.channel)
        self.oip_request = opb.ModelInferRequest(
            model_name="demo", inputs=[opb.ModelInferRequest.InferInputTensor(name="query", datatype="FP32",
                                                                               shape=[1, 8, 512])],
            raw_input_contents=[q.tobytes()])
        self.oip_answered = 0
        self.phase = "steady"
        self.results = []  # (phase, "OK" or "CODE: details", previous attempts)
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self.run, args=(i % 3 == 2,), daemon=True) for i in range(threads)]

    def run(self, oip):
        while not self.stopping.is_set():
            with self.lock:
                if len(self.results) >= MAX_REQUESTS:
                    return
            phase = self.phase
            try:
                if oip:
                    resp = self.oip_stub.ModelInfer(self.oip_request, timeout=20)
                    outcome = ("OK" if len(resp.raw_output_contents) == 1 else "no output", 0)
                    with self.lock:
                        self.oip_answered += 1
                else:
                    resp = self.stub.Attend(self.request, timeout=20)
                    outcome = ("OK", resp.timing.previous_attempts)
            except grpc.RpcError as e:
                outcome = (f"{'ModelInfer ' if oip else ''}{e.code().name}: {e.details()}", 0)
            if PHASES.index(phase) < PHASES.index("sigkill") <= PHASES.index(self.phase):
                phase = "sigkill"  # In flight when the SIGKILL came: what it costs is the SIGKILL's.
            with self.lock:
                self.results.append((phase,) + outcome)

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stopping.set()
        for t in self.threads:
            t.join(timeout=60)
        self.channel.close()

    def reach(self, phase, n=20, timeout=60):
        """Waits until `n` calls that started in `phase` have ended (answered or failed): on a slow
        machine a phase lasts until it has carried load, not only its planned time."""
        def ended():
            with self.lock:
                return sum(1 for r in self.results if r[0] == phase) >= n
        lib.wait_until(ended, timeout=timeout, step=0.05)

    def summary(self, phase=None):
        rows = [r for r in self.results if phase is None or r[0] == phase]
        failed = {}
        for _, code, _ in rows:
            if code != "OK":
                failed[code] = failed.get(code, 0) + 1
        retried = sum(1 for _, code, prev in rows if code == "OK" and prev > 0)
        return {"sent": len(rows), "ok": len(rows) - sum(failed.values()), "failed": failed,
                "answered after a retry": retried}


class DyingReplica:
    """A TCP listener that takes each connection, reads what nginx sends (preface, headers, request)
    and resets it before answering: to nginx, a replica killed while a call is on it. Counts the
    connections, one per call nginx passes on."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            conn.settimeout(2)
            got = b""
            try:
                while len(got) < 200:  # The preface and SETTINGS are 33 bytes; a call's HEADERS and DATA follow.
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    got += chunk
            except OSError:
                pass
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            conn.close()  # With SO_LINGER 0: a reset, as from a killed process.

    def close(self):
        self.sock.close()


def check_replica_lost_mid_call(checks, pb, rpc, service_config, tmp, callers=8, calls=5):
    """nginx answers a call whose replica went away after the call was sent (nginx cannot resend a
    POST) with its own error; gRPC clients must get that as a gRPC status their retry policy acts
    on, every time. As an HTML error page (nginx's default) it was retried only sometimes: with
    calls in flight together, grpcio made 159 to 182 of the 200 attempts, and a replica
    SIGKILLed under load cost calls that the retry policy should have saved."""
    dying = DyingReplica()
    port = lib.free_port()
    nginx = lib.start_nginx(os.path.join(tmp, "nginx-dying"), [dying.port], port)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.service_config", service_config)])
    try:
        checks("nginx in front of a replica that resets every call is up",
               lib.wait_until(lambda: lib.port_open(port), timeout=30, step=0.2))
        stub = rpc.AttentionServiceStub(channel)
        q = np.random.default_rng(5).standard_normal((1, 8, 512)).astype(np.float32)
        request = pb.AttendRequest(model="demo", query=lib.to_wire(pb, q))
        outcomes, lock = {}, threading.Lock()

        def caller():
            for _ in range(calls):
                try:
                    stub.Attend(request, timeout=20)
                    outcome = "OK"
                except grpc.RpcError as e:
                    outcome = f"{e.code().name}: {e.details()}"
                with lock:
                    outcomes[outcome] = outcomes.get(outcome, 0) + 1

        threads = [threading.Thread(target=caller) for _ in range(callers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        attempts = json.loads(service_config)["methodConfig"][0]["retryPolicy"]["maxAttempts"]
        print(f"replica lost mid-call, through nginx: {outcomes}, {dying.connections} attempts reached it")
        checks("nginx: a call whose replica is lost gets UNAVAILABLE with nginx's message",
               list(outcomes) == [f"UNAVAILABLE: {NGINX_UNAVAILABLE}"], outcomes)
        checks(f"nginx: every such call is retried ({attempts} attempts each, {callers} callers at once)",
               dying.connections == attempts * callers * calls,
               f"{dying.connections} attempts for {callers * calls} calls")
    finally:
        channel.close()
        nginx.terminate()
        nginx.wait(timeout=30)
        dying.close()


def check_nginx_body_limit(checks, pb, proxy_port):
    """A request over nginx's client_max_body_size (40,000 tokens: 82 MB) gets a gRPC status naming the
    limit, not HTTP 413 with an HTML page (which grpcio reported as UNKNOWN "Received http2 header with
    status: 413")."""
    channel = grpc.insecure_channel(f"127.0.0.1:{proxy_port}")
    rng = np.random.default_rng(413)
    big = pb.AttendRequest(model="demo", query=lib.to_wire(pb, rng.standard_normal((1, 40000, 512))))
    try:
        channel.unary_unary("/attnserve.v1.AttentionService/Attend")(big.SerializeToString(), timeout=60)
        checks("nginx: a request over client_max_body_size is refused", False, "it was answered")
    except grpc.RpcError as e:
        checks("nginx: a request over client_max_body_size gets RESOURCE_EXHAUSTED",
               e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, f"{e.code()} {e.details()!r}")
        checks("nginx: ... naming the limit", "client_max_body_size (64m" in (e.details() or ""),
               repr(e.details()))
    channel.close()


def scenario(replicas, load, bench_cmd, sessions_cmd):
    """Steady, then SIGTERM + restart of replica 0, then SIGKILL + restart of replica 1. Returns the
    SIGTERMed replica's exit code, how long it took, and when (time.time) each was signalled."""
    bench = subprocess.Popen(bench_cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    sessions = subprocess.Popen(sessions_cmd)
    time.sleep(2)  # The sessions' client starts and opens its sessions.
    load.reach("steady")
    load.phase = "sigterm"
    t0, signalled = time.monotonic(), {}
    signalled[0] = time.time()
    rc = replicas[0].stop(signal.SIGTERM)
    took = time.monotonic() - t0
    print(f"SIGTERM to exit {rc}: {took:.1f} s (--shutdown-grace 30)")
    replicas[0].start()
    time.sleep(1.5)
    load.reach("sigterm")
    load.phase = "sigkill"
    signalled[1] = time.time()
    replicas[1].stop(signal.SIGKILL)
    time.sleep(0.5)
    replicas[1].start()
    time.sleep(1.5)
    load.reach("sigkill")
    load.phase = "after"
    time.sleep(1)
    load.reach("after")
    bench.communicate(timeout=120)
    sessions.wait(timeout=120)
    return rc, took, signalled


def check_cli_sessions(checks, cli, target, flags, mode, runs=6):
    """attnserve-cli decode (the C++ client) opens, steps, forks and truncates sessions through `target`:
    without routing, 2 in 3 calls would reach a replica that does not hold the session."""
    failed = []
    for i in range(runs):
        p = subprocess.run([cli, "--target", target, *flags, "decode", "--prompt-len", "4", "--steps", "6",
                            "--forks", "2", "--truncate", "3"], capture_output=True, text=True, timeout=60)
        if p.returncode != 0 or "fork 1:" not in p.stdout or "truncated to 7 tokens" not in p.stdout:
            failed.append((p.stdout + p.stderr).strip()[-300:])
    checks(f"{mode}: attnserve-cli decode: {runs} sessions, every step, fork and truncation answered", not failed,
           failed[:2])


def check_sessions(checks, mode, records, replicas, signalled, tolerance):
    """The sessions of replica_sessions.py against the events of scenario()."""
    addr = {i: f"127.0.0.1:{r.port}" for i, r in enumerate(replicas)}
    on = {i: [r for r in records if r["replica"] == a] for i, a in addr.items()}
    failed = [r for r in records if r["error"]]
    print(f"{mode}: sessions {len(records)} ({', '.join(f'replica {i}: {len(v)}' for i, v in on.items())}), "
          f"failed {len(failed)}: " + json.dumps(sorted({f['error']['code'] for f in failed})))
    checks(f"{mode}: sessions opened on every replica and decoded there",
           all(any(not r["error"] and r["steps"] >= 25 for r in on[i]) for i in addr),
           {i: len(v) for i, v in on.items()})
    answered = [r for r in records if r["steps"] > 0]
    worst = max((r["worst"] for r in answered), default=None)
    checks(f"{mode}: every session step answered equals one causal call over its sequence (tol {tolerance})",
           worst is not None and worst <= tolerance, worst)
    checks(f"{mode}: sessions on the replica never signalled lost nothing", not any(r["error"] for r in on[2]),
           [r["error"] for r in on[2] if r["error"]][:2])
    stray = [r for r in failed if r["replica"] not in (addr[0], addr[1])
             or r["error"]["at"] < signalled[0 if r["replica"] == addr[0] else 1]]
    checks(f"{mode}: only sessions on a signalled replica failed, and only after its signal", not stray,
           [(r["replica"], r["error"]) for r in stray][:2])
    unclear = [r["error"] for r in failed if r["error"]["code"] not in ("UNAVAILABLE", "NOT_FOUND")
               or "replica" not in r["error"]["message"]]
    checks(f"{mode}: every lost session's status names a replica (UNAVAILABLE or NOT_FOUND)", not unclear,
           unclear[:2])
    # The drain lets a step in flight at the SIGTERM finish: a session there fails only on a step sent
    # after it (and steps sent during the drain's hand-off are answered too, when there are any).
    cut = [r["error"] for r in on[0] if r["error"] and r["error"]["sent"] and r["error"]["sent"] < signalled[0]]
    checks(f"{mode}: no step in flight on the SIGTERMed replica when the SIGTERM came failed", not cut, cut[:2])
    drained = [r for r in on[0] if r["opened"] < signalled[0] and r["last_ok"] and r["last_ok"] > signalled[0]]
    print(f"{mode}: {len(drained)} sessions on the SIGTERMed replica answered steps after the SIGTERM")
    for i, what in ((0, "SIGTERM"), (1, "SIGKILL")):
        lost = [r for r in on[i] if r["error"]]
        if lost:
            print(f"{mode}: after the {what}, {len(lost)} sessions on replica {i} ended with, e.g., "
                  f"{lost[0]['error']['code']}: {lost[0]['error']['message'][:200]}")


def test_three_replicas_behind_nginx_and_client_side_balancing(attnserve, bench, cli, checks, request):
    """One flow, ~30 s on 2 cores, on purpose: three servers start and warm up once, and each step
    (balancing, a restart, a kill, sessions routed through each mode, the scrape) depends on the state
    the one before left; split into tests, every one would start the three replicas again."""
    args = types.SimpleNamespace(binary=attnserve, bench=bench, cli=cli,
                                 threads=request.config.getoption("--threads"))
    pb, rpc = lib.load_stubs()
    oip = lib.load_stubs("inference/grpc_service.proto")
    tmp = lib.temp_dir("attnserve-replicas-")
    configs = {name: open(os.path.join(ROOT, "deploy", "grpc", name)).read()
               for name in ("service-config.json", "service-config-proxy.json")}
    replicas = [Replica(args.binary, i, tmp) for i in range(3)]
    nginx = prom = None
    try:
        for r in replicas:
            r.start()
        ipv4 = "ipv4:" + ",".join(f"127.0.0.1:{r.port}" for r in replicas)

        check_replica_lost_mid_call(checks, pb, rpc, configs["service-config-proxy.json"], tmp)

        proxy_port = lib.free_port()
        nginx = lib.start_nginx(os.path.join(tmp, "nginx"), [r.port for r in replicas], proxy_port)
        checks("nginx proxies grpc.health.v1 to the replicas",
               lib.wait_until(lambda: lib.health_serving(f"127.0.0.1:{proxy_port}"), timeout=30, step=0.2))
        check_nginx_body_limit(checks, pb, proxy_port)

        # Prometheus with file-based targets: every replica's /metrics.
        prom_port = lib.free_port()
        with open(os.path.join(tmp, "targets.json"), "w") as f:
            json.dump([{"targets": [f"127.0.0.1:{r.metrics_port}" for r in replicas],
                        "labels": {"job": "attnserve"}}], f)
        with open(os.path.join(tmp, "prometheus.yml"), "w") as f:
            f.write("global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: attnserve\n"
                    f"    file_sd_configs:\n      - files: ['{tmp}/targets.json']\n")
        prom = subprocess.Popen(["prometheus", f"--config.file={tmp}/prometheus.yml", f"--storage.tsdb.path={tmp}/prom",
                                 f"--web.listen-address=127.0.0.1:{prom_port}"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        outcome = {}
        sessions_script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "replica_sessions.py")
        for mode, target, config, bench_flags, session_mode in (
                ("nginx", f"127.0.0.1:{proxy_port}", configs["service-config-proxy.json"], ["--proxy"], "proxy"),
                ("client-side", ipv4, configs["service-config.json"], [], "direct")):
            check_cli_sessions(checks, args.cli, target, bench_flags, mode)
            bench_cmd = [args.bench, "--target", target, *bench_flags, "--callers", "4", "--lengths", "fixed:8",
                         "--duration", "7", "--warmup", "0", "--label", f"cpp-{mode}", "--json", f"{tmp}/bench.jsonl"]
            sessions_out = os.path.join(tmp, f"sessions-{mode}.json")
            sessions_cmd = [sys.executable, sessions_script, target, "--mode", session_mode, "--seconds", "8",
                            "--replicas", ",".join(f"127.0.0.1:{r.port}" for r in replicas), "--out", sessions_out]
            with Load(pb, rpc, target, args.threads, config, oip) as load:
                rc, took, signalled = scenario(replicas, load, bench_cmd, sessions_cmd)
            with open(sessions_out) as f:
                check_sessions(checks, mode, json.load(f), replicas, signalled, 2e-5)
            checks(f"{mode}: OIP ModelInfer calls answered through the same target", load.oip_answered > 0,
                   f"{load.oip_answered}")
            checks(f"{mode}: SIGTERMed replica exited 0", rc == 0, f"exit {rc}")
            checks(f"{mode}: SIGTERMed replica left within 10 s", took < 10, f"{took:.1f} s")
            outcome[mode] = {p: load.summary(p) for p in PHASES}
            outcome[mode]["total"] = load.summary()
            print(f"{mode}: " + json.dumps(outcome[mode]))
            checks(f"{mode}: load ran in every phase", all(outcome[mode][p]["sent"] > 0 for p in outcome[mode]))
            sigterm, sigkill = outcome[mode]["sigterm"], outcome[mode]["sigkill"]
            checks(f"{mode}: SIGTERM cost no request", not sigterm["failed"], sigterm["failed"])
            print(f"{mode}: SIGKILL cost {sum(sigkill['failed'].values())} of {sigkill['sent']} requests "
                  f"({sigkill['answered after a retry']} answered after a retry)")
            checks(f"{mode}: steady and after: no failures",
                   not outcome[mode]["steady"]["failed"] and not outcome[mode]["after"]["failed"])
        with open(f"{tmp}/bench.jsonl") as f:
            for line in f:
                b = json.loads(line)
                print(f"{b['label']}: ok {b['ok']}, errors {b['errors']}")
                checks(f"{b['label']}: answers", b["ok"] > 0)

        # Per-replica series in Prometheus: every replica's requests over the run (a restarted
        # replica keeps its address; after a restart, clients reconnect only after gRPC's backoff,
        # so its new counters may still be empty), and every replica scraped as up at the end.
        def query(expr):
            url = f"http://127.0.0.1:{prom_port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
            try:
                res = json.load(urllib.request.urlopen(url, timeout=2))["data"]["result"]
            except OSError:
                return {}
            return {r["metric"]["instance"]: float(r["value"][1]) for r in res}

        want = {f"127.0.0.1:{r.metrics_port}" for r in replicas}
        seen, up = {}, {}
        ok = lib.wait_until(lambda: (seen.update(query(
            'sum by (instance) (max_over_time(attnserve_requests_total{method="Attend"}[10m]))')) or True)
            and want <= set(seen), timeout=30, step=0.5)
        checks("prometheus holds attnserve_requests_total for every replica", ok, seen)
        ok = lib.wait_until(lambda: (up.update(query('up{job="attnserve"}')) or True)
                            and all(up.get(w) == 1 for w in want), timeout=30, step=0.5)
        checks("prometheus scrapes every replica, restarted ones included (up == 1)", ok, up)
    finally:
        for r in replicas:
            if r.proc and r.proc.poll() is None:
                r.stop(signal.SIGTERM)
        for p in (nginx, prom):
            if p:
                p.terminate()
                p.wait(timeout=30)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
