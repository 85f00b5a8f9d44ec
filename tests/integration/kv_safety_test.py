#!/usr/bin/python3
"""Kept keys and values under hostile input and races, through the real server and wire.

- A session step whose query shape claims ~2^62 tokens (batch-first, sequence-first, B=2; no data)
  is refused with INVALID_ARGUMENT and leaves the session and the byte budget as they were: the
  attnserve_kv_bytes gauge unchanged, the next step applied and equal to nn.MultiheadAttention's
  causal self-attention over the applied tokens; float32 and bfloat16 servers (on bfloat16 the
  budget then still holds: memories created after it never take the gauge over the budget).
- A negative session_length (-1, -2^62) is refused with INVALID_ARGUMENT and applies nothing.
- A memory whose CreateMemory waits in the queue longer than --kv-ttl-seconds is not expired under
  it: the server answers it (it crashed with SIGSEGV before) and keeps serving.
- Expiry does not wait for a busy entry: a session opened after another session's step went busy
  expires on time while that step is still queued.
- --kv-max-entries bounds the entries: OpenSession beyond it is RESOURCE_EXHAUSTED naming the flag,
  the server's memory stays flat while thousands more are refused, and closing one makes room.
Tolerances: float32 1e-5, bfloat16 2e-2 of the output's scale (max |out - ref| / max |ref|).

usage: python3 -m pytest kv_safety_test.py --attnserve PATH/TO/attnserve [-k NAME]
"""
import os
import sys
import time

import grpc
import numpy as np
import torch

import pytest

import attnserve_py as lib  # tests/lib, on the path by tests/conftest.py
import export_model  # tools/

E, H = 32, 4
HUGE = [  # (shape, layout): queries that claim ~2^62 tokens and carry no data
    ([1, 4611686018427387901, E], 1),
    ([1 << 62, 1, E], 2),
    ([2, 1 << 61, E], 1),
    ([1, (1 << 63) - 1, E], 1),
]


def kv_bytes(server):
    return float(lib.metrics_lines(server, "attnserve_kv_bytes")[0].split()[1])


def causal_reference(m, x):
    n = x.shape[1]
    mask = torch.triu(torch.ones(n, n, dtype=torch.bool), 1)
    with torch.no_grad():
        out, _ = m(*(torch.from_numpy(x),) * 3, attn_mask=mask, need_weights=False)
    return out.numpy()


def rel_err(got, want):
    return float(np.abs(got - want).max() / np.abs(want).max())


def huge_steps(pb, stub, server, module, dtype, tol, checks):
    """Steps that claim ~2^62 tokens between two good ones; then the budget under memories."""
    rng = np.random.default_rng(17)
    x = rng.standard_normal((1, 6, E)).astype(np.float32)
    h = stub.OpenSession(pb.OpenSessionRequest(model="small", batch=1), timeout=30).handle
    first = stub.Attend(pb.AttendRequest(session=h, query=lib.to_wire(pb, x[:, :3])), timeout=30)
    before = kv_bytes(server)
    for shape, layout in HUGE:
        req = pb.AttendRequest(session=h, layout=layout, query=pb.Tensor(dtype=1, shape=shape))
        try:
            stub.Attend(req, timeout=30)
            code, msg = "OK", ""
        except grpc.RpcError as e:
            code, msg = e.code().name, e.details()
        checks(f"{dtype}: a step of shape {shape} is INVALID_ARGUMENT", code == "INVALID_ARGUMENT",
               f"{code} {msg}")
        checks(f"{dtype}: ... and attnserve_kv_bytes stays {before:.0f}", kv_bytes(server) == before,
               f"now {kv_bytes(server)}")
    try:
        second = stub.Attend(pb.AttendRequest(session=h, query=lib.to_wire(pb, x[:, 3:]), session_length=3),
                             timeout=30)
        got = np.concatenate([lib.from_wire(pb, first.output), lib.from_wire(pb, second.output)], axis=1)
        err = rel_err(got, causal_reference(module, x))
        checks(f"{dtype}: the next step is applied (6 tokens) and equals nn.MultiheadAttention (error {err:.1e})",
               second.session_length == 6 and err <= tol, f"length {second.session_length}, error {err}")
    except grpc.RpcError as e:
        checks(f"{dtype}: the next step is applied", False, f"{e.code().name} {e.details()}")
    # The budget holds after them: 12 memories of 50 tokens, never more than the budget kept.
    k = lib.to_wire(pb, rng.standard_normal((1, 50, E)).astype(np.float32))
    over = []
    for _ in range(12):
        stub.CreateMemory(pb.CreateMemoryRequest(model="small", key=k, value=k), timeout=30)
        if not 0 <= kv_bytes(server) <= 20000:
            over.append(kv_bytes(server))
    checks(f"{dtype}: 12 memories later the gauge stayed within 0 to the 20,000-byte budget", not over, over)


def negative_lengths(pb, stub, checks):
    x = np.random.default_rng(5).standard_normal((1, 2, E)).astype(np.float32)
    h = stub.OpenSession(pb.OpenSessionRequest(model="small", batch=1), timeout=30).handle
    stub.Attend(pb.AttendRequest(session=h, query=lib.to_wire(pb, x)), timeout=30)
    for bad in (-1, -(1 << 62), -(1 << 63)):
        try:
            r = stub.Attend(pb.AttendRequest(session=h, query=lib.to_wire(pb, x), session_length=bad), timeout=30)
            code, msg = "OK", f"applied: length {r.session_length}"
        except grpc.RpcError as e:
            code, msg = e.code().name, e.details()
        checks(f"session_length {bad} is INVALID_ARGUMENT naming the field", code == "INVALID_ARGUMENT" and
               "session_length" in msg, f"{code} {msg}")
    try:
        r = stub.Attend(pb.AttendRequest(session=h, query=lib.to_wire(pb, x), session_length=2), timeout=30)
        outcome = f"OK, length {r.session_length}"
    except grpc.RpcError as e:
        outcome = f"{e.code().name} {e.details()}"
    checks("... and applied nothing: the next step finds 2 tokens", outcome == "OK, length 4", outcome)


def channel(server):
    return grpc.insecure_channel(server.target, options=[("grpc.max_receive_message_length", 64 << 20)])


def late_step(binary, pb, rpc, checks):
    """A step whose deadline passes while it computes is answered DEADLINE_EXCEEDED: not applied."""
    server = lib.Server(binary)
    stub = rpc.AttentionServiceStub(channel(server))
    h = stub.OpenSession(pb.OpenSessionRequest(model="demo", batch=1), timeout=30).handle
    q = lib.to_wire(pb, np.random.default_rng(8).standard_normal((1, 5000, 512)).astype(np.float32))
    try:
        stub.Attend(pb.AttendRequest(session=h, query=q), timeout=0.05)  # ~0.3-0.6 s of compute
        outcome = "OK"
    except grpc.RpcError as e:
        outcome = e.code().name
    one = lib.to_wire(pb, np.ones((1, 1, 512), np.float32))
    end = time.time() + 30
    while True:  # The next step, once the late one's compute has ended.
        try:
            r = stub.Attend(pb.AttendRequest(session=h, query=one, session_length=0), timeout=30)
            after = f"OK, length {r.session_length}"
        except grpc.RpcError as e:
            after = f"{e.code().name} {e.details()}"
        if "already in flight" not in after or time.time() > end:
            break
        time.sleep(0.1)
    checks("a step answered DEADLINE_EXCEEDED during compute was not applied (the next finds 0 tokens)",
           outcome == "DEADLINE_EXCEEDED" and after == "OK, length 1", f"{outcome}; then {after}")
    server.stop()


LONG_L = 5000  # A self-attention call of [1, LONG_L, 512] keeps one worker busy (~0.1-3 s).


def long_call_seconds(pb, stub):
    """How long one long call takes here, answered alone (the second of two: the first warms up)."""
    q = lib.to_wire(pb, np.random.default_rng(3).standard_normal((1, LONG_L, 512)).astype(np.float32))
    for _ in range(2):
        start = time.monotonic()
        stub.Attend(pb.AttendRequest(model="demo", query=q), timeout=300)
    return time.monotonic() - start


def reached(server, futures):
    """Waits until every call of `futures` has reached `server` (answered, or in flight)."""
    assert lib.all_reached(server, len(futures), lambda: sum(f.done() for f in futures)), \
        f"{len(futures)} calls sent, not all reached the server in 60 s"


def long_queue(pb, stub, server, seconds, each):
    """Long calls that keep one worker busy for at least `seconds` (each takes `each` s), sent now
    on their own channel, returned once they reached `server`: their futures (cancel them to drop
    what is still queued). Sized to this machine rather than a fixed count, so a fast one is not
    left with too short a queue nor a slow one with minutes of work (48 calls of 10 MB took ~40 s
    here)."""
    n = max(2, int(seconds / each) + 2)
    q = lib.to_wire(pb, np.random.default_rng(3).standard_normal((1, LONG_L, 512)).astype(np.float32))
    futures = [stub.Attend.future(pb.AttendRequest(model="demo", query=q), timeout=300) for _ in range(n)]
    reached(server, futures)  # They reach the queue before what follows.
    return futures


def filler_stub(rpc, server):
    """A channel of its own: a call sent after the fillers must not wait behind their bytes."""
    return rpc.AttentionServiceStub(grpc.insecure_channel(server.target, options=[
        ("grpc.max_receive_message_length", 64 << 20), ("grpc.use_local_subchannel_pool", 1)]))


def settle(futures):
    """Cancels what is still queued and waits for the rest to end."""
    for f in futures:
        f.cancel()
    for f in futures:
        try:
            f.result()
        except (grpc.RpcError, grpc.FutureCancelledError):
            pass


def expiry_races(binary, pb, rpc, checks):
    # A memory created behind a long queue, with a TTL shorter than its wait (1.5 s of work queued
    # ahead of it against a TTL of 0.4 s; the check below says whether it did wait that long).
    server = lib.Server(binary, "--kv-ttl-seconds", "0.4", "--workers", "1")
    stub = rpc.AttentionServiceStub(channel(server))
    fillers = filler_stub(rpc, server)
    each = long_call_seconds(pb, fillers)
    queued = long_queue(pb, fillers, server, 1.5, each)
    k = lib.to_wire(pb, np.random.default_rng(4).standard_normal((1, 8, 512)).astype(np.float32))
    sent = time.monotonic()
    try:
        m = stub.CreateMemory(pb.CreateMemoryRequest(model="demo", key=k, value=k), timeout=300)
        outcome = f"OK {m.handle}"
    except grpc.RpcError as e:
        outcome = f"{e.code().name} {e.details()}"
    waited = time.monotonic() - sent
    settle(queued)
    alive = server.proc.poll() is None
    checks("a CreateMemory queued past the TTL is answered OK and the server lives", alive and
           outcome.startswith("OK"), f"{outcome}; server exit code {server.proc.poll()}")
    checks(f"... it did wait past the TTL ({waited:.2f} s, a long call {each:.2f} s)", waited > 0.4)
    if alive:
        server.stop()

    # A busy session at the back of the LRU list does not hold up the expiry of the others.
    server = lib.Server(binary, "--kv-ttl-seconds", "1", "--workers", "1")
    stub = rpc.AttentionServiceStub(channel(server))
    # A queue that outlasts the 2.9 s below (6 s of work), cancelled once the check is done (dropped
    # from the queue, so the busy step then runs).
    fillers = filler_stub(rpc, server)
    queued = long_queue(pb, fillers, server, 6.0, long_call_seconds(pb, fillers))
    a = stub.OpenSession(pb.OpenSessionRequest(model="demo", batch=1), timeout=30).handle
    x = lib.to_wire(pb, np.random.default_rng(6).standard_normal((1, 1, 512)).astype(np.float32))
    step = stub.Attend.future(pb.AttendRequest(session=a, query=x), timeout=300)
    reached(server, queued + [step])  # a is busy before b opens.
    b = stub.OpenSession(pb.OpenSessionRequest(model="demo", batch=1), timeout=30).handle
    time.sleep(2.6)  # Past b's TTL and the next sweep.
    busy = not step.done()
    try:
        stub.Attend(pb.AttendRequest(session=b, query=x), timeout=30)
        outcome = "OK"
    except grpc.RpcError as e:
        outcome = f"{e.code().name} {e.details()}"
    checks("with another session's step busy, an idle session expires on time (NOT_FOUND: expired)",
           busy and outcome.startswith("NOT_FOUND") and "expired" in outcome,
           f"the busy step {'still queued' if busy else 'already done: the queue was too short'}; {outcome}")
    settle(queued)
    checks("... and the busy step is applied", step.result().session_length == 1)
    server.stop()


def entry_bound(binary, pb, rpc, checks):
    server = lib.Server(binary, "--kv-max-entries", "1000")
    stub = rpc.AttentionServiceStub(grpc.insecure_channel(server.target))
    handles = [stub.OpenSession(pb.OpenSessionRequest(model="demo", batch=1), timeout=30).handle
               for _ in range(1000)]
    codes, msg, rss = {}, "", []
    for i in range(90):  # 100 at a time, concurrently; the first 1,000 warm gRPC up.
        futures = [stub.OpenSession.future(pb.OpenSessionRequest(model="demo", batch=1), timeout=60)
                   for _ in range(100)]
        for f in futures:
            try:
                f.result()
                code = "OK"
            except grpc.RpcError as e:
                code, msg = e.code().name, e.details()
            codes[code] = codes.get(code, 0) + 1
        if i % 10 == 9:
            rss.append(lib.status_kb(server.proc.pid, "VmRSS"))
    # gRPC alone moves it by ~2 MiB over as many refused GetModel calls.
    growth = (rss[-1] - rss[0]) / 1024
    checks("9,000 OpenSession beyond --kv-max-entries 1000: each RESOURCE_EXHAUSTED naming the flag",
           codes == {"RESOURCE_EXHAUSTED": 9000} and "--kv-max-entries" in msg, f"{codes} {msg}")
    # An entry costs ~1.5 KiB: 8,000 kept by mistake would add ~12 MiB.
    checks(f"... with the server's memory flat over the last 8,000 (+{growth:.1f} MiB, at most 6)", growth <= 6,
           [r // 1024 for r in rss])
    stub.CloseSession(pb.ReleaseRequest(handle=handles[0]), timeout=30)
    try:
        stub.OpenSession(pb.OpenSessionRequest(model="demo", batch=1), timeout=30)
        ok = True
    except grpc.RpcError:
        ok = False
    checks("... and closing one makes room for one", ok)
    server.stop()


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    """A small nn.MultiheadAttention (E=32, H=4), exported to a model repository: (dir, module)."""
    tmp = str(tmp_path_factory.mktemp("kv-safety"))
    torch.manual_seed(1700)
    module = torch.nn.MultiheadAttention(E, H, batch_first=True).eval()
    for p in module.parameters():
        torch.nn.init.normal_(p, std=0.2)
    export_model.export(module, os.path.join(tmp, "small"))
    return tmp, module


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("bfloat16", 2e-2)])
def test_huge_steps_change_nothing_and_the_budget_holds(attnserve, stubs, small_model, dtype, tol, checks):
    pb, rpc = stubs
    models, module = small_model
    server = lib.Server(attnserve, "--models", models, "--dtype", dtype, "--kv-budget-bytes", "20000",
                        "--kv-max-entry-bytes", "20000")
    stub = rpc.AttentionServiceStub(grpc.insecure_channel(server.target))
    huge_steps(pb, stub, server, module, dtype, tol, checks)
    server.stop()


def test_negative_session_lengths_are_refused(attnserve, stubs, small_model, checks):
    pb, rpc = stubs
    server = lib.Server(attnserve, "--models", small_model[0])
    negative_lengths(pb, rpc.AttentionServiceStub(grpc.insecure_channel(server.target)), checks)
    server.stop()


def test_a_step_answered_too_late_is_not_applied(attnserve, stubs, checks):
    late_step(attnserve, *stubs, checks)


def test_expiry_races_with_queues_and_busy_sessions(attnserve, stubs, checks):
    expiry_races(attnserve, *stubs, checks)


def test_the_entry_bound_holds_and_memory_stays_flat(attnserve, stubs, checks):
    entry_bound(attnserve, *stubs, checks)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "--attnserve", *sys.argv[1:]]))
