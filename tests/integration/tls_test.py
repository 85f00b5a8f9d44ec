#!/usr/bin/python3
"""TLS and mutual TLS, with certificates made at test time (openssl): a Python gRPC client and
attnserve-cli (the C++ client library) against real servers.

TLS server: plaintext refused, a client trusting another CA refused, the right CA served; the
plaintext --health-address answers grpc.health.v1 and nothing else. Mutual TLS server: no client
certificate, or one from another CA, refused; the right one served. Bad --tls-* flags stop the
server at start with a message naming the flag and file.

usage: python3 -m pytest tls_test.py --attnserve PATH/TO/attnserve --cli PATH/TO/attnserve-cli
"""
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import grpc
import numpy as np

import pytest  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
import attnserve_py as lib  # noqa: E402
from pki import make_pki  # noqa: E402


def read(path):
    with open(path, "rb") as f:
        return f.read()


class Pki:
    """Certificates made at test time, and clients and attnserve-cli calls that use them."""

    def __init__(self, d, cli, pb, rpc):
        self.d, self.cli, self.pb, self.rpc = d, cli, pb, rpc
        make_pki(d)
        q = np.random.default_rng(7).standard_normal((1, 4, 512)).astype(np.float32)
        self.q = q
        self.request = pb.AttendRequest(model="demo", query=lib.to_wire(pb, q))

    def attend(self, channel, request=None):
        """'' when served (an answer of the query's shape), else the gRPC status code's name."""
        request = request or self.request
        try:
            resp = self.rpc.AttentionServiceStub(channel).Attend(request, timeout=10)
            return "" if tuple(resp.output.shape) == tuple(request.query.shape) else f"shape {resp.output.shape}"
        except grpc.RpcError as e:
            return e.code().name

    def tls_channel(self, target, ca, cert=None):
        d = self.d
        creds = grpc.ssl_channel_credentials(read(f"{d}/{ca}.pem"),
                                             read(f"{d}/{cert}.key") if cert else None,
                                             read(f"{d}/{cert}.pem") if cert else None)
        return grpc.secure_channel(target, creds)

    def run_cli(self, target, *flags):
        r = subprocess.run([self.cli, "--target", target, "--deadline-ms", "5000", *flags, "health"],
                           capture_output=True, text=True)
        return r.returncode, (r.stdout + r.stderr).strip()


@pytest.fixture(scope="module")
def pki(cli, stubs, tmp_path_factory):
    return Pki(str(tmp_path_factory.mktemp("tls")), cli, *stubs)


def test_tls_with_a_plaintext_health_listener(attnserve, pki, checks):
    binary, d = attnserve, pki.d
    attend, tls_channel, run_cli = pki.attend, pki.tls_channel, pki.run_cli
    # 1. TLS, with a plaintext health listener.
    server = lib.Server(binary, "--tls-cert", f"{d}/server.pem", "--tls-key", f"{d}/server.key",
                        "--health-address", "127.0.0.1:0")
    try:
        print(f"server: {server.banner.strip()}")
        checks("start-up line says TLS", ", TLS," in server.banner, server.banner)
        health_port = int(re.search(r"plaintext health on [\d.]+:(\d+)", server.banner).group(1))
        t = server.target
        checks("plaintext client refused", attend(grpc.insecure_channel(t)) == "UNAVAILABLE")
        checks("client trusting another CA refused", attend(tls_channel(t, "other_ca")) == "UNAVAILABLE")
        checks("client trusting the server's CA served", attend(tls_channel(t, "ca")) == "")
        rc, out = run_cli(t, "--tls-ca", f"{d}/ca.pem")
        checks("attnserve-cli --tls-ca: health SERVING", rc == 0 and out == "SERVING", out)
        rc, out = run_cli(t, "--tls-ca", f"{d}/other_ca.pem")
        checks("attnserve-cli trusting another CA fails", rc != 0, out)
        rc, out = run_cli(t)
        checks("attnserve-cli in plaintext fails", rc != 0, out)
        h = grpc.insecure_channel(f"127.0.0.1:{health_port}")
        checks("plaintext health listener answers SERVING", lib.health_serving(f"127.0.0.1:{health_port}", 5))
        rc, out = run_cli(f"127.0.0.1:{health_port}")
        checks("attnserve-cli health on the health listener", rc == 0 and out == "SERVING", out)
        checks("health listener serves nothing else", attend(h) == "UNIMPLEMENTED")
    finally:
        server.stop()



def test_mutual_tls_and_the_admin_certificate(attnserve, pki, checks):
    binary, d, cli, pb, rpc, q = attnserve, pki.d, pki.cli, pki.pb, pki.rpc, pki.q
    request = pb.AttendRequest()
    request.CopyFrom(pki.request)  # Its own: this test sends model "m" queries.
    tls_channel, run_cli = pki.tls_channel, pki.run_cli

    def attend(channel):
        return pki.attend(channel, request)

    # 2. Mutual TLS; the certificate named "admin" may call AdminService.
    models = os.path.join(d, "models", "m")
    os.makedirs(models)
    shutil.copy(os.path.join(lib.ROOT, "tests", "data", "mha_e8_h2.safetensors"), models)
    with open(os.path.join(models, "config.json"), "w") as f:
        f.write('{"num_heads": 2}')
    server = lib.Server(binary, "--tls-cert", f"{d}/server.pem", "--tls-key", f"{d}/server.key",
                        "--tls-client-ca", f"{d}/ca.pem", "--admin-client-names", "admin",
                        "--models", os.path.dirname(models))
    try:
        print(f"server: {server.banner.strip()}")
        t = server.target
        checks("start-up line says mutual TLS", "mutual TLS" in server.banner, server.banner)
        checks("no client certificate refused", attend(tls_channel(t, "ca")) == "UNAVAILABLE")
        checks("client certificate from another CA refused",
               attend(tls_channel(t, "ca", "stranger")) == "UNAVAILABLE")
        request.model = "m"
        request.query.CopyFrom(lib.to_wire(pb, q[:, :, :8]))
        checks("client certificate from the CA served", attend(tls_channel(t, "ca", "client")) == "")

        def reload(cert, metadata=()):
            try:
                resp = rpc.AdminServiceStub(tls_channel(t, "ca", cert)).ReloadModels(
                    pb.ReloadModelsRequest(), metadata=metadata, timeout=10)
                return f"OK {resp.models_served}"
            except grpc.RpcError as e:
                return f"{e.code().name}: {e.details()}"
        got = reload("admin")
        checks("ReloadModels with the admin certificate: OK", got == "OK 1", got)
        got = reload("client")
        checks("ReloadModels with another certificate of the CA: PERMISSION_DENIED naming it",
               got.startswith("PERMISSION_DENIED") and "'client'" in got, got)
        got = reload("client", (("authorization", "Bearer x"),))
        checks("a bearer token where none is configured: UNAUTHENTICATED", got.startswith("UNAUTHENTICATED"), got)
        r = subprocess.run([cli, "--target", t, "--tls-ca", f"{d}/ca.pem", "--tls-cert", f"{d}/admin.pem",
                            "--tls-key", f"{d}/admin.key", "reload"], capture_output=True, text=True)
        checks("attnserve-cli reload with the admin certificate: exit 0", r.returncode == 0 and
               "1 model versions serving; nothing changed" in r.stdout, r.stdout + r.stderr)
        rc, out = run_cli(t, "--tls-ca", f"{d}/ca.pem", "--tls-cert", f"{d}/client.pem", "--tls-key", f"{d}/client.key")
        checks("attnserve-cli with its client certificate: SERVING", rc == 0 and out == "SERVING", out)
        rc, out = run_cli(t, "--tls-ca", f"{d}/ca.pem")
        checks("attnserve-cli without a client certificate fails", rc != 0, out)
        rc, out = run_cli(t, "--tls-ca", f"{d}/ca.pem", "--tls-cert", f"{d}/client.pem")
        checks("attnserve-cli with a certificate but no key: exit 2 naming it", rc == 2 and "key" in out, out)
    finally:
        server.stop()



def test_bad_tls_flags_stop_the_server_at_start_naming_flag_and_file(attnserve, pki, checks):
    binary, d = attnserve, pki.d
    # 3. Bad flags stop the server at start, naming flag and file (a FIFO must not block it).
    os.mkfifo(f"{d}/fifo")
    for flags, want in ((["--tls-cert", f"{d}/server.pem"], "--tls-cert and --tls-key go together"),
                        (["--tls-cert", f"{d}/missing.pem", "--tls-key", f"{d}/server.key"],
                         f"--tls-cert {d}/missing.pem: cannot open"),
                        (["--tls-cert", f"{d}/server.ext", "--tls-key", f"{d}/server.key"], "not PEM"),
                        (["--tls-cert", f"{d}/fifo", "--tls-key", f"{d}/server.key"],
                         f"--tls-cert {d}/fifo: not a regular file"),
                        (["--tls-client-ca", f"{d}/ca.pem"], "--tls-client-ca: needs --tls-cert"),
                        (["--admin-client-names", "admin"], "--admin-client-names: needs mutual TLS"),
                        (["--admin-token-file", f"{d}/missing"], f"--admin-token-file {d}/missing: cannot open"),
                        (["--admin-token-file", f"{d}/fifo"], f"--admin-token-file {d}/fifo: not a regular file"),
                        (["--tls-cert", f"{d}/client.pem", "--tls-key", f"{d}/server.key"], "do not match")):
        r = subprocess.run([binary, "--address", "127.0.0.1:0", "--metrics-address", "", "--http-address", "", *flags],
                           capture_output=True, text=True, timeout=60)
        checks(f"refused at start: {want}", r.returncode == 2 and want in r.stderr, r.stderr.strip()[:300])


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))


def test_the_client_certificate_names_the_tenant(attnserve, pki, checks, tmp_path):
    """Under mutual TLS the verified certificate's name is the tenant (docs/tenants.md), and a header
    claiming another tenant does not change it, even where the server trusts that header."""
    d, pb, rpc = pki.d, pki.pb, pki.rpc
    log = tmp_path / "access.log"
    server = lib.Server(attnserve, "--tls-cert", f"{d}/server.pem", "--tls-key", f"{d}/server.key",
                        "--tls-client-ca", f"{d}/ca.pem", "--tenant-header", "attnserve-tenant",
                        "--access-log", str(log))
    stub = rpc.AttentionServiceStub(pki.tls_channel(server.target, "ca", "client"))
    for request_id, metadata in ((1, ()), (2, (("attnserve-tenant", "admin"),))):
        request = pb.AttendRequest()
        request.CopyFrom(pki.request)
        request.request_id = request_id
        stub.Attend(request, metadata=metadata, timeout=10)
    server.stop()
    tenants = {l["request_id"]: l.get("tenant") for l in map(json.loads, log.read_text().splitlines())
               if l.get("method") == "Attend"}
    checks("the certificate's name is the tenant", tenants.get(1) == "client", str(tenants))
    checks("a header claiming another tenant does not change it", tenants.get(2) == "client", str(tenants))
