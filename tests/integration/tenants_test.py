#!/usr/bin/python3
"""Tenants and priorities through the real server and wire (docs/tenants.md).

- Who is calling: without --tenant-header, a client's `attnserve-tenant` metadata is ignored (every
  call is tenant "default": a session one client opens with the header "a" is usable with "b"); with
  it, the header names the tenant: another tenant's session is NOT_FOUND (no hint it exists), the
  maker's steps answer exactly (nn.MultiheadAttention, causal, float64; atol 2e-5 + rtol 1e-4), and
  attnserve_tenant_requests_total counts named tenants by name and unnamed ones as "other".
- A tenant at its kv_max_bytes is refused RESOURCE_EXHAUSTED naming the tenant and its cap.
- Priorities: with --priority-levels 2, priority 3 is INVALID_ARGUMENT naming the field; 1 and 2
  answer; a level's max_queue_size refuses by level.
- Every bad tenants file, --tenant-header and --queue-policy refuses to start with exit 2 naming the
  field; a bad file on reload (SIGHUP, AdminService.ReloadModels) keeps the old terms and says so;
  a good one replaces them.

usage: python3 -m pytest tenants_test.py --attnserve PATH/TO/attnserve
"""
import json
import os
import signal
import subprocess
import tempfile
import time

import grpc
import numpy as np
import pytest
import torch

import attnserve_py as lib  # tests/lib, on the path by tests/conftest.py
import export_model  # tools/

E, H = 32, 4
HEADER = "attnserve-tenant"


def as_tenant(name):
    return [(HEADER, name)] if name else []


def write(path, text):
    with open(path + ".new", "w") as f:
        f.write(text)
    os.replace(path + ".new", path)


def requests_by_tenant(server):
    out = {}
    for line in lib.metrics_lines(server, "attnserve_tenant_requests_total"):
        tenant = line.split('tenant="')[1].split('"')[0]
        out[tenant] = out.get(tenant, 0) + float(line.split()[-1])
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A repository of a small nn.MultiheadAttention (E=32, H=4) twice: `small`, and `ranked` whose
    config.json gives it 3 priority levels of its own: (dir, module)."""
    tmp = str(tmp_path_factory.mktemp("tenants"))
    torch.manual_seed(4100)
    module = torch.nn.MultiheadAttention(E, H, batch_first=True).eval()
    export_model.export(module, os.path.join(tmp, "small"))
    export_model.export(module, os.path.join(tmp, "ranked"))
    config = os.path.join(tmp, "ranked", "config.json")
    with open(config) as f:
        c = json.load(f)
    c["dynamic_batching"] = {"priority_levels": 3, "default_priority_level": 2,
                             "priority_queue_policy": {"1": {"max_queue_size": 4}}}
    write(config, json.dumps(c))
    return tmp, module


def stub_of(server, stubs):
    pb, rpc = stubs
    return pb, rpc.AttentionServiceStub(grpc.insecure_channel(server.target))


def test_an_untrusted_header_is_ignored(attnserve, stubs, checks):
    server = lib.Server(attnserve)
    pb, stub = stub_of(server, stubs)
    h = stub.OpenSession(pb.OpenSessionRequest(model="demo", batch=1), metadata=as_tenant("a"), timeout=30).handle
    x = lib.to_wire(pb, np.ones((1, 2, 512), np.float32))
    try:
        r = stub.Attend(pb.AttendRequest(session=h, query=x), metadata=as_tenant("b"), timeout=30)
        outcome = f"OK, length {r.session_length}"
    except grpc.RpcError as e:
        outcome = f"{e.code().name} {e.details()}"
    checks("without --tenant-header the header names nobody: 'b' steps 'a''s session", outcome == "OK, length 2",
           outcome)
    seen = requests_by_tenant(server)
    checks("... and every call is counted as tenant default", set(seen) == {"default"}, str(seen))
    server.stop()


def test_a_trusted_header_names_the_tenant_and_keeps_its_sessions_its_own(attnserve, stubs, models, checks,
                                                                          tmp_path):
    tenants = tmp_path / "tenants.json"
    tenants.write_text(json.dumps({"tenants": {"a": {"weight": 2}, "b": {"kv_max_bytes": 4000}}}))
    server = lib.Server(attnserve, "--models", models[0], "--tenant-header", HEADER, "--tenants", str(tenants))
    pb, stub = stub_of(server, stubs)
    h = stub.OpenSession(pb.OpenSessionRequest(model="small", batch=1), metadata=as_tenant("a"), timeout=30).handle
    rng = np.random.default_rng(41)
    x = rng.standard_normal((1, 3, E)).astype(np.float32)
    for who in ("b", "zed", None):
        try:
            stub.Attend(pb.AttendRequest(session=h, query=lib.to_wire(pb, x)), metadata=as_tenant(who), timeout=30)
            outcome = "OK"
        except grpc.RpcError as e:
            outcome = f"{e.code().name} {e.details()}"
        checks(f"tenant {who or 'default'} cannot step a's session: NOT_FOUND, as an unknown one",
               outcome.startswith("NOT_FOUND") and "unknown" in outcome, outcome)
    for rpc_name, req in (("ForkSession", pb.ForkSessionRequest(handle=h)),
                          ("TruncateSession", pb.TruncateSessionRequest(handle=h, length=0)),
                          ("CloseSession", pb.ReleaseRequest(handle=h))):
        try:
            getattr(stub, rpc_name)(req, metadata=as_tenant("b"), timeout=30)
            outcome = "OK"
        except grpc.RpcError as e:
            outcome = e.code().name
        checks(f"tenant b cannot {rpc_name} a's session", outcome == "NOT_FOUND", outcome)
    r = stub.Attend(pb.AttendRequest(session=h, query=lib.to_wire(pb, x)), metadata=as_tenant("a"), timeout=30)
    mha = models[1].double()
    mask = torch.triu(torch.ones(3, 3, dtype=torch.bool), 1)
    with torch.no_grad():
        t = torch.from_numpy(x).double()
        want = mha(t, t, t, attn_mask=mask, need_weights=False)[0].numpy()
    got = lib.from_wire(pb, r.output)
    checks("a's own step answers exactly (causal, float64 reference)",
           np.allclose(got, want, atol=2e-5, rtol=1e-4) and r.session_length == 3,
           f"max err {np.abs(got - want).max():.2e}, length {r.session_length}")
    # b's cap: 4,000 bytes of keys and values; a memory of 64 tokens (2 x 64 x 32 x 4 bytes) needs more.
    kv = rng.standard_normal((1, 64, E)).astype(np.float32)
    try:
        stub.CreateMemory(pb.CreateMemoryRequest(model="small", key=lib.to_wire(pb, kv), value=lib.to_wire(pb, kv)),
                          metadata=as_tenant("b"), timeout=30)
        outcome = "OK"
    except grpc.RpcError as e:
        outcome = f"{e.code().name} {e.details()}"
    checks("b past its kv_max_bytes is RESOURCE_EXHAUSTED naming it and its cap",
           outcome.startswith("RESOURCE_EXHAUSTED") and "tenant 'b'" in outcome and "kv_max_bytes 4000" in outcome,
           outcome)
    seen = requests_by_tenant(server)
    checks("metrics count a and b by name, zed as other, no header as default",
           {"a", "b", "other", "default"} <= set(seen) and "zed" not in seen, str(seen))
    server.stop()


def test_priorities_as_levels(attnserve, stubs, models, checks, tmp_path):
    log = tmp_path / "access.log"
    server = lib.Server(attnserve, "--models", models[0], "--priority-levels", "2", "--queue-policy",
                        "default:allow_timeout_override=true", "--tenant-header", HEADER, "--access-log", str(log))
    pb, stub = stub_of(server, stubs)
    x = lib.to_wire(pb, np.ones((1, 4, E), np.float32))
    stub.Attend(pb.AttendRequest(model="small", query=x, priority=1, request_id=77), metadata=as_tenant("t1"),
                timeout=30)
    x = lib.to_wire(pb, np.ones((1, 4, E), np.float32))
    for model, levels in (("small", 2), ("ranked", 3)):
        for p in range(levels + 1):
            r = stub.Attend(pb.AttendRequest(model=model, query=x, priority=p, queue_timeout_us=10_000_000),
                            timeout=30)
            checks(f"{model}: priority {p} answers", list(r.output.shape) == [1, 4, E], str(r.output.shape))
        for p in (levels + 1, (1 << 64) - 1):
            try:
                stub.Attend(pb.AttendRequest(model=model, query=x, priority=p), timeout=30)
                outcome = "OK"
            except grpc.RpcError as e:
                outcome = f"{e.code().name} {e.details()}"
            checks(f"{model}: priority {p} past {levels} levels is INVALID_ARGUMENT naming the field",
                   outcome.startswith("INVALID_ARGUMENT") and "priority: " + str(p) in outcome, outcome)
    server.stop()
    lines = [json.loads(l) for l in log.read_text().splitlines()]
    mine = [l for l in lines if l.get("request_id") == 77]
    checks("the access log names the tenant and the priority level",
           len(mine) == 1 and mine[0].get("tenant") == "t1" and mine[0].get("priority_level") == 1, str(mine))


def refused(binary, *args):
    p = subprocess.run([binary, "--address", "127.0.0.1:0", "--metrics-address", "", "--http-address", "", *args],
                       capture_output=True, text=True, timeout=60)
    return p.returncode, p.stdout + p.stderr


def test_bad_files_and_flags_refuse_to_start(attnserve, checks, tmp_path):
    cases = [
        ('{"tenants": {"a": {"weight": 0}}}', "tenants['a'].weight is 0"),
        ('{"default": {"max_queued_requests": -3}}', "default.max_queued_requests is -3"),
        ('{"tenants": {"a": {"kv_guaranteed_bytes": 9223372036854775807}}}', "add up to"),
        ('{"tenant": {}}', "unknown key 'tenant'"),
        ("not json", "tenants.json"),
    ]
    path = tmp_path / "tenants.json"
    for text, expected in cases:
        path.write_text(text)
        code, out = refused(attnserve, "--tenants", str(path))
        checks(f"tenants file {text!r} refuses to start (exit 2) naming {expected!r}",
               code == 2 and expected in out and str(path) in out, f"exit {code}: {out[-300:]}")
    code, out = refused(attnserve, "--tenants", str(tmp_path / "missing.json"))
    checks("a missing tenants file refuses to start naming it", code == 2 and "missing.json" in out, out[-300:])
    for flag, value, expected in (("--tenant-header", "grpc-tenant", "--tenant-header 'grpc-tenant'"),
                                  ("--tenant-header", "Tenant", "--tenant-header 'Tenant'"),
                                  ("--queue-policy", "3:timeout_action=DROP", "timeout_action='DROP'"),
                                  ("--queue-policy", "1:max_queue_size=1", "priority_queue_policy names level 1")):
        code, out = refused(attnserve, flag, value)
        checks(f"{flag} {value} refuses to start naming it", code == 2 and expected in out, f"exit {code}: {out[-300:]}")


def test_a_bad_file_on_reload_keeps_the_old_terms(attnserve, stubs, checks, tmp_path):
    tenants = str(tmp_path / "tenants.json")
    token = tmp_path / "token"
    token.write_text("t0ken")
    write(tenants, json.dumps({"tenants": {"a": {}}}))
    server = lib.Server(attnserve, "--tenant-header", HEADER, "--tenants", tenants, "--admin-token-file", str(token))
    pb, rpc = stubs
    channel = grpc.insecure_channel(server.target)
    stub = rpc.AttentionServiceStub(channel)
    admin = rpc.AdminServiceStub(channel)
    x = lib.to_wire(pb, np.ones((1, 2, 512), np.float32))

    def call_as(name):
        stub.Attend(pb.AttendRequest(model="demo", query=x), metadata=as_tenant(name), timeout=30)

    write(tenants, '{"tenants": {"a": {"weight": -1}}}')
    try:
        admin.ReloadModels(pb.ReloadModelsRequest(), metadata=[("authorization", "Bearer t0ken")], timeout=60)
        outcome = "OK"
    except grpc.RpcError as e:
        outcome = f"{e.code().name} {e.details()}"
    checks("ReloadModels with a bad tenants file is FAILED_PRECONDITION naming the field, nothing changed",
           outcome.startswith("FAILED_PRECONDITION") and "weight is -1" in outcome and "nothing changed" in outcome,
           outcome)
    server.proc.send_signal(signal.SIGHUP)
    lib.wait_until(lambda: "reload refused" in server.output(), timeout=20)
    checks("SIGHUP with a bad tenants file says it refused", "reload refused" in server.output(), server.output()[-300:])
    call_as("a")
    checks("the old terms still hold: 'a' is a named tenant", requests_by_tenant(server).get("a", 0) == 1,
           str(requests_by_tenant(server)))
    write(tenants, json.dumps({"tenants": {"c": {}}}))
    server.proc.send_signal(signal.SIGHUP)
    time.sleep(1)
    call_as("a")
    call_as("c")
    seen = requests_by_tenant(server)
    checks("a good file replaces them: 'c' named, 'a' now other", seen.get("c") == 1 and seen.get("other") == 1, str(seen))
    server.stop()


def causal(module, x):
    n = x.shape[1]
    mask = torch.triu(torch.ones(n, n, dtype=torch.bool), 1)
    with torch.no_grad():
        t = torch.from_numpy(x).double()
        return module.double()(t, t, t, attn_mask=mask, need_weights=False)[0].numpy()


def test_a_flood_never_evicts_another_tenants_guaranteed_sessions(attnserve, stubs, models, checks, tmp_path):
    """Tenant a keeps two sessions within its kv_guaranteed_bytes while tenant b floods memories and
    sessions through a small --kv-budget-bytes: b's own entries are evicted (or b refused), a's never,
    and every step of a's sessions after the flood answers exactly (causal self-attention over every token
    so far, float64 reference; atol 2e-5 + rtol 1e-4)."""
    tenants = tmp_path / "tenants.json"
    tenants.write_text(json.dumps({"tenants": {"a": {"kv_guaranteed_bytes": 16384}, "b": {}}}))
    server = lib.Server(attnserve, "--models", models[0], "--tenant-header", HEADER, "--tenants", str(tenants),
                        "--kv-budget-bytes", "65536", "--kv-max-entry-bytes", "32768")
    pb, stub = stub_of(server, stubs)
    rng = np.random.default_rng(4101)
    sessions = {}
    for i in range(2):  # 2 x 16 tokens of capacity x 2 x 32 x 4 bytes = 8 KiB, within the 16 KiB.
        h = stub.OpenSession(pb.OpenSessionRequest(model="small", batch=1), metadata=as_tenant("a"), timeout=30).handle
        x = rng.standard_normal((1, 8, E)).astype(np.float32)
        stub.Attend(pb.AttendRequest(session=h, query=lib.to_wire(pb, x)), metadata=as_tenant("a"), timeout=30)
        sessions[h] = x
    outcomes = {}
    for i in range(60):  # b: memories of 32 tokens (8 KiB each) and sessions, far past the budget.
        kv = rng.standard_normal((1, 32, E)).astype(np.float32)
        try:
            if i % 3:
                stub.CreateMemory(pb.CreateMemoryRequest(model="small", key=lib.to_wire(pb, kv),
                                                         value=lib.to_wire(pb, kv)), metadata=as_tenant("b"), timeout=30)
            else:
                h = stub.OpenSession(pb.OpenSessionRequest(model="small", batch=1), metadata=as_tenant("b"),
                                     timeout=30).handle
                stub.Attend(pb.AttendRequest(session=h, query=lib.to_wire(pb, kv)), metadata=as_tenant("b"), timeout=30)
            outcomes["OK"] = outcomes.get("OK", 0) + 1
        except grpc.RpcError as e:
            outcomes[e.code().name] = outcomes.get(e.code().name, 0) + 1
    evicted = sum(float(l.split()[-1]) for l in lib.metrics_lines(server, "attnserve_kv_ends_total")
                  if 'reason="evicted"' in l)
    checks("b's flood went on, evicting its own entries", outcomes.get("OK", 0) >= 30 and evicted >= 20,
           f"{outcomes}, {evicted:.0f} evicted")
    for h, x in sessions.items():
        step = rng.standard_normal((1, 4, E)).astype(np.float32)
        try:
            r = stub.Attend(pb.AttendRequest(session=h, query=lib.to_wire(pb, step), session_length=8),
                            metadata=as_tenant("a"), timeout=30)
        except grpc.RpcError as e:
            checks(f"a's session {h[:8]} survived the flood", False, f"{e.code().name} {e.details()}")
            continue
        want = causal(models[1], np.concatenate([x, step], axis=1))[:, 8:]
        got = lib.from_wire(pb, r.output)
        checks(f"a's session {h[:8]} survived the flood and answers exactly",
               r.session_length == 12 and np.allclose(got, want, atol=2e-5, rtol=1e-4),
               f"length {r.session_length}, max err {np.abs(got - want).max():.2e}")
    held = {l.split('tenant="')[1].split('"')[0]: float(l.split()[-1])
            for l in lib.metrics_lines(server, "attnserve_tenant_kv_bytes")}
    checks("attnserve_tenant_kv_bytes shows a within its guarantee", 0 < held.get("a", 0) <= 16384, str(held))
    server.stop()


def test_the_cli_names_its_tenant_and_priority(attnserve, cli, checks, tmp_path):
    """attnserve-cli attend --tenant NAME --priority N: the server's access log names both; a priority
    past the levels fails the command with INVALID_ARGUMENT naming it."""
    log = tmp_path / "access.log"
    server = lib.Server(attnserve, "--priority-levels", "2", "--tenant-header", HEADER, "--access-log", str(log))
    ok = subprocess.run([cli, "--target", server.target, "attend", "--tenant", "cli-tenant", "--priority", "1"],
                        capture_output=True, text=True, timeout=60)
    bad = subprocess.run([cli, "--target", server.target, "attend", "--priority", "3"],
                         capture_output=True, text=True, timeout=60)
    server.stop()
    lines = [json.loads(l) for l in log.read_text().splitlines() if '"Attend"' in l]
    checks("attnserve-cli attend --tenant --priority answers", ok.returncode == 0, ok.stdout + ok.stderr)
    checks("... and the access log names the tenant and the level",
           any(l.get("tenant") == "cli-tenant" and l.get("priority_level") == 1 for l in lines), str(lines))
    checks("--priority 3 past 2 levels fails naming it",
           bad.returncode != 0 and "INVALID_ARGUMENT" in bad.stdout + bad.stderr and "priority: 3" in bad.stdout + bad.stderr,
           bad.stdout + bad.stderr)


def test_hostile_tenant_headers_name_nobody(attnserve, stubs, models, checks):
    """Behind --tenant-header, a header sent twice (which value is meant?), an empty value, one with a
    space or over 128 characters name no tenant: INVALID_ARGUMENT naming the key (never tenant
    default, whose sessions such a call would reach); without the header the call is default's, and
    a's session is not found for it."""
    server = lib.Server(attnserve, "--models", models[0], "--tenant-header", HEADER)
    pb, stub = stub_of(server, stubs)
    h = stub.OpenSession(pb.OpenSessionRequest(model="small", batch=1), metadata=as_tenant("a"), timeout=30).handle
    x = lib.to_wire(pb, np.ones((1, 1, E), np.float32))
    for name, metadata in (("twice", [(HEADER, "a"), (HEADER, "a")]), ("empty", [(HEADER, "")]),
                           ("a space", [(HEADER, "a b")]), ("129 characters", [(HEADER, "a" * 129)]),
                           ("no header", [])):
        try:
            stub.Attend(pb.AttendRequest(session=h, query=x), metadata=metadata, timeout=30)
            outcome = "OK"
        except grpc.RpcError as e:
            outcome = f"{e.code().name} {e.details()}"
        if name == "no header":
            checks("no header: tenant default, a's session NOT_FOUND", outcome.startswith("NOT_FOUND"), outcome)
        else:
            checks(f"header {name}: INVALID_ARGUMENT naming {HEADER}",
                   outcome.startswith("INVALID_ARGUMENT") and HEADER in outcome, outcome)
    r = stub.Attend(pb.AttendRequest(session=h, query=x), metadata=as_tenant("a"), timeout=30)
    checks("tenant a itself steps it", r.session_length == 1, str(r.session_length))
    seen = requests_by_tenant(server)
    checks("only the call without a header counted as default", seen.get("default", 0) == 1, str(seen))
    server.stop()
