"""Test helpers: Python stubs generated from the .proto at run time, and a real attnserve process."""
import atexit
import json
import os
import re
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import urllib.request
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def temp_dir(prefix):
    """A new private folder (tempfile.mkdtemp under $TMPDIR) removed with everything in it when this
    process exits, passed or failed: the test command fails on whatever a test leaves in its
    $TMPDIR (tools/build.sh, stage tempfiles)."""
    path = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, path, True)
    return path


def _protoc(out, proto):
    args = ["-I" + os.path.join(ROOT, "proto"), "--python_out=" + out, "--grpc_python_out=" + out, proto]
    try:
        from grpc_tools import protoc
        rc = protoc.main(["protoc"] + args)
    except ImportError:  # No grpcio-tools (the GPU machine): protoc and grpc_python_plugin on PATH.
        plugin = shutil.which("grpc_python_plugin")
        rc = subprocess.run(["protoc", f"--plugin=protoc-gen-grpc_python={plugin}"] + args).returncode
    if rc != 0:
        raise RuntimeError("protoc failed on " + proto)


def load_package():
    """The attnserve Python package (client/python) for this interpreter, without pip: its modules
    copied to a temp dir with stubs generated there by this interpreter's protoc (as its build does
    with a pinned one), and the service configs beside them. Not in one process with load_stubs(),
    whose generated `attnserve.v1` is another module of the same name."""
    out = temp_dir("attnserve-pkg-")
    package = os.path.join(out, "attnserve")
    shutil.copytree(os.path.join(ROOT, "client", "python", "attnserve"), package)
    _protoc(out, "attnserve/v1/attention.proto")
    for name in ("service-config.json", "service-config-proxy.json"):
        shutil.copy(os.path.join(ROOT, "deploy", "grpc", name), package)
    sys.path.insert(0, out)
    import attnserve
    import attnserve.aio  # noqa: F401
    return attnserve


def load_stubs(proto="attnserve/v1/attention.proto"):
    """Generates the Python gRPC stubs of `proto` (under proto/) into a temp dir and imports them:
    attnserve.v1's by default, or "inference/grpc_service.proto" (the Open Inference Protocol)."""
    import importlib
    module = proto[:-len(".proto")].replace("/", ".")
    # Imported, the files are not read again: their folder goes at once, not at exit (a client
    # process a test stops with a signal runs no exit handler).
    with tempfile.TemporaryDirectory(prefix="attnserve-py-") as out:
        _protoc(out, proto)
        sys.path.insert(0, out)
        try:
            return importlib.import_module(module + "_pb2"), importlib.import_module(module + "_pb2_grpc")
        finally:
            sys.path.remove(out)


class Server:
    """Starts `attnserve` on free ports and stops it with SIGTERM, checking the exit code."""

    def __init__(self, binary, *args, limits=None):
        """`limits`: resource limits the server starts under, as prlimit(1)'s options ({"as": bytes,
        "nofile": n}). Never a preexec_fn: that runs Python in the forked child, where grpcio's fork
        handlers restart its poller on a descriptor the child then closes (an abort before exec)."""
        if "--metrics-address" not in args:
            args = ("--metrics-address", "127.0.0.1:0") + tuple(args)
        if "--http-address" not in args:
            args = ("--http-address", "127.0.0.1:0") + tuple(args)
        self.proc = subprocess.Popen(with_limits(limits, [binary, "--address", "127.0.0.1:0", *args]),
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.banner = self.proc.stdout.readline()
        m = re.search(r" on [\d.]+:(\d+), (?:metrics on http://[\d.]+:(\d+)/metrics|metrics off)",
                      self.banner)
        if not m:
            rest = self.proc.stdout.read() if self.proc.poll() is not None else ""
            raise RuntimeError("attnserve did not start: " + self.banner + rest)
        self.port = int(m.group(1))
        self.metrics_port = int(m.group(2)) if m.group(2) else None
        self.target = f"127.0.0.1:{self.port}"
        h = re.search(r", HTTP on [\d.]+:(\d+)", self.banner)
        self.http_port = int(h.group(1)) if h else None  # The Open Inference Protocol over HTTP.
        self.http_url = f"http://127.0.0.1:{self.http_port}" if h else None
        # Drain the server's output as it comes: a full pipe would block the server's writes.
        self._output = []
        self._drain = threading.Thread(target=lambda: self._output.extend(self.proc.stdout), daemon=True)
        self._drain.start()
        atexit.register(self._end)  # A test that fails before stop() leaves no server behind.

    def _end(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=60)

    def output(self):
        """What the server printed after its start-up line, so far."""
        return "".join(self._output)

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=60)
        self._drain.join(timeout=10)
        out = self.output()
        if self.proc.returncode != 0:
            raise RuntimeError(f"attnserve exited {self.proc.returncode}: {out}")
        return out


def with_limits(limits, command):
    """`command` run under these resource limits (prlimit(1)'s options: {"as": bytes, "nofile": n})."""
    if not limits:
        return list(command)
    return ["prlimit", *(f"--{name}={value}" for name, value in limits.items()), "--", *command]


def free_port():
    """A TCP port on 127.0.0.1 free now (for a server started next)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_open(port):
    """Whether something accepts connections on 127.0.0.1:`port` now."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def metrics_lines(server, name):
    """The server's /metrics lines of the series `name` (with or without labels)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
    return [l for l in text.splitlines() if l.startswith(name + " ") or l.startswith(name + "{")]


def in_flight(server, method="Attend"):
    """The server's attnserve_requests_in_flight for `method` (None: every method): its calls
    admitted and not yet answered (computing or queued)."""
    return sum(float(l.split()[-1]) for l in metrics_lines(server, "attnserve_requests_in_flight")
               if method is None or f'method="{method}"' in l)


def all_reached(server, n, done, method="Attend", timeout=60):
    """Waits until `n` calls have reached `server`: `done()` of them answered, the rest held
    (computing or queued) as in_flight says. The answered are counted first, so a call that ends
    between the two reads is counted in neither (a wait one poll longer), never in both."""
    return wait_until(lambda: done() + in_flight(server, method) >= n, timeout=timeout, step=0.02)


class Checks:
    """Named checks that print ok/FAIL as they go and a closing "N passed, N failed" line; under
    pytest, the `checks` fixture (tests/conftest.py) fails the test with the ones that did not hold."""

    def __init__(self):
        self.passed = self.failed = 0
        self.failures = []  # "name: detail" of each check that did not hold

    def __call__(self, name, ok, detail=""):
        self.passed += bool(ok)
        self.failed += not ok
        if not ok:
            self.failures.append(f"{name}: {detail}")
        print(f"{'ok  ' if ok else 'FAIL'} {name} {detail if not ok else ''}")

    def summary(self, prefix):
        print(f"{prefix}: {self.passed} passed, {self.failed} failed")
        return 1 if self.failed else 0


def export_random_decoder(out, e, heads, kv_heads, rng, name="dec"):
    """A Llama-style decoder layer (`heads` query heads on `kv_heads` key/value heads, RoPE) with
    random weights from `rng` (numpy), exported as OUT/checkpoints/NAME and served as OUT/models/NAME
    (tools/export_model.py; needs torch)."""
    import torch
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import export_model
    d = e // heads
    shapes = {"q_proj": (e, e), "k_proj": (kv_heads * d, e), "v_proj": (kv_heads * d, e), "o_proj": (e, e)}
    state = {f"{n}.weight": torch.from_numpy((rng.standard_normal(s) / np.sqrt(e)).astype(np.float32))
             for n, s in shapes.items()}
    config = {"model_type": "llama", "hidden_size": e, "num_attention_heads": heads,
              "num_key_value_heads": kv_heads, "num_hidden_layers": 1, "rope_theta": 10000.0}
    export_model.export_decoder_weights(config, {0: state}, os.path.join(out, "checkpoints", name),
                                        {0: os.path.join(out, "models", name)})


def write_sparse_model(path, e, num_heads):
    """A model directory (nn.MultiheadAttention, bias=False) whose model.safetensors claims [3e, e]
    and [e, e] float32 projections (16 e^2 bytes: 16 GiB at e = 32768) as zeros in a sparse file of
    a few KiB on disk: for loads too large to allocate, or long to read and hash."""
    os.makedirs(path)
    header, offset = {}, 0
    for name, rows in (("in_proj_weight", 3 * e), ("out_proj.weight", e)):
        header[name] = {"dtype": "F32", "shape": [rows, e], "data_offsets": [offset, offset + 4 * rows * e]}
        offset += 4 * rows * e
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(os.path.join(path, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        f.truncate(8 + len(text) + offset)
    with open(os.path.join(path, "config.json"), "w") as f:
        f.write(json.dumps({"num_heads": num_heads}))


def status_kb(pid, field):
    """A field of /proc/PID/status in KiB (VmRSS, VmHWM, ...), 0 when absent."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


DTYPES = {"float32": (1, np.float32), "float16": (2, np.float16)}


def to_wire(pb, array, dtype=None):
    """A numpy array as an attnserve Tensor message (bool arrays become BOOL)."""
    a = np.ascontiguousarray(array)
    if a.dtype == np.bool_:
        return pb.Tensor(dtype=pb.DATA_TYPE_BOOL, shape=a.shape, data=a.astype(np.uint8).tobytes())
    code, np_type = DTYPES[dtype or "float32"]
    return pb.Tensor(dtype=code, shape=a.shape, data=a.astype(np_type).tobytes())


# The tolerance of an answer computed twice, by the conformance suite's measure (max|a - b| / max|b|):
# float32 rounding, or the wire's own rounding for float16 and bfloat16.
SAME_ANSWER_TOLERANCE = {"float32": 1e-5, "float16": 1e-3, "bfloat16": 1e-2}


def same_answer(a, b, dtype="float32"):
    """Whether two answers' raw bytes (of `dtype`) hold the same values to float rounding; and a detail.
    The engine cuts a request into query blocks by the cores idle when it runs, and a causal query that
    is one block takes the fused kernel's own causal mask: two calls of one request agree to float32
    rounding, not always to the bit."""
    if dtype == "bfloat16":
        import ml_dtypes  # numpy's bfloat16 (the OIP environment has it)
        np_type = ml_dtypes.bfloat16
    else:
        np_type = {"float32": np.float32, "float16": np.float16}[dtype]
    x = np.frombuffer(a, dtype=np_type).astype(np.float64)
    y = np.frombuffer(b, dtype=np_type).astype(np.float64)
    if x.shape != y.shape:
        return False, f"{x.size} values against {y.size}"
    if a == b:
        return True, "the same bytes"
    err = float(np.max(np.abs(x - y)) / max(float(np.max(np.abs(y))), 1e-30))
    return err <= SAME_ANSWER_TOLERANCE[dtype], f"relative difference {err:.2e}"


def from_wire(pb, t):
    np_type = {pb.DATA_TYPE_FLOAT32: np.float32, pb.DATA_TYPE_FLOAT16: np.float16}[t.dtype]
    return np.frombuffer(t.data, dtype=np_type).reshape(tuple(t.shape)).astype(np.float64)


def health_serving(target, timeout=1.0):
    """True when grpc.health.v1.Health/Check for service "" at `target` answers SERVING. Raw bytes,
    so no grpcio-health-checking is needed: the empty request is service ""; b"\x08\x01" is
    {status: SERVING}."""
    import grpc
    with grpc.insecure_channel(target) as channel:
        try:
            return channel.unary_unary("/grpc.health.v1.Health/Check")(b"", timeout=timeout) == b"\x08\x01"
        except grpc.RpcError:
            return False


def health_status(target, service=""):
    """grpc.health.v1 status of `service` at `target`: "SERVING", "NOT_SERVING", or the RPC's error
    code name (NOT_FOUND for a service name the server never reported on)."""
    import grpc
    name = service.encode()
    request = b"\x0a" + bytes([len(name)]) + name if name else b""
    with grpc.insecure_channel(target) as channel:
        try:
            answer = channel.unary_unary("/grpc.health.v1.Health/Check")(request, timeout=5)
        except grpc.RpcError as e:
            return e.code().name
    return {b"\x08\x01": "SERVING", b"\x08\x02": "NOT_SERVING"}.get(answer, repr(answer))


def wait_until(predicate, timeout=20.0, step=0.1):
    end = time.time() + timeout
    while time.time() < end:
        if predicate():
            return True
        time.sleep(step)
    return False


def start_nginx(prefix, upstream_ports, listen_port, tls=None, http_ports=(), http_listen_port=None):
    """nginx from deploy/nginx/nginx.conf with these upstreams and this port; its log in prefix/. With
    `tls` (certificate, key): TLS at nginx (`listen ... ssl http2`). `http_ports`: the replicas'
    --http-address ports behind its HTTP/1.1 server, listening on `http_listen_port` (a free port
    picked when not given)."""
    conf = open(os.path.join(ROOT, "deploy", "nginx", "nginx.conf")).read()
    begin, end = conf.index("  upstream attnserve_http {"), conf.index("  # --- end of the HTTP replicas")
    pool = "".join(f"    server 127.0.0.1:{p} max_fails=1 fail_timeout=2s;\n" for p in http_ports)
    if not http_ports:
        pool = "    server 127.0.0.1:1 down;\n"
    conf = conf[:begin] + "  upstream attnserve_http {\n" + pool + "    keepalive 32;\n  }\n" + conf[end:]
    if http_listen_port is None:
        http_listen_port = free_port()
    conf = conf.replace("listen 127.0.0.1:8081;", f"listen 127.0.0.1:{http_listen_port};")
    # Its replicas' section, rewritten for these: the pool, an upstream each, the map between.
    begin, end = conf.index("  upstream attnserve {"), conf.index("  # --- end of the replicas")
    pool = "".join(f"    server 127.0.0.1:{p} max_fails=1 fail_timeout=2s;\n" for p in upstream_ports)
    own = "".join(f"  upstream attnserve_{p} {{ server 127.0.0.1:{p}; keepalive 8; }}\n" for p in upstream_ports)
    entries = "".join(f"    127.0.0.1:{p} attnserve_{p};\n" for p in upstream_ports)
    conf = (conf[:begin] + "  upstream attnserve {\n" + pool + "    keepalive 32;\n    keepalive_timeout 60s;\n  }\n"
            + own + "  map $http_attnserve_replica $attnserve_upstream {\n    default attnserve;\n" + entries
            + "  }\n" + conf[end:])
    conf = conf.replace("listen 127.0.0.1:8080", f"listen 127.0.0.1:{listen_port}")
    if tls:
        conf = conf.replace(f"listen 127.0.0.1:{listen_port} http2;",
                            f"listen 127.0.0.1:{listen_port} ssl http2;\n    ssl_certificate {tls[0]};\n"
                            f"    ssl_certificate_key {tls[1]};")
    os.makedirs(os.path.join(prefix, "tmp"), exist_ok=True)
    with open(os.path.join(prefix, "nginx.conf"), "w") as f:
        f.write(conf)
    return subprocess.Popen(["nginx", "-p", prefix, "-c", "nginx.conf", "-g", "daemon off;"],
                            stdout=subprocess.DEVNULL, stderr=open(os.path.join(prefix, "error.log"), "w"))
