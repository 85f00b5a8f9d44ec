#!/usr/bin/python3
"""Batched steps (AttendRequest.steps, docs/api.md "Many sessions in one call") through the real
server and wire.

- Equal to one call each: sessions stepped in batched calls give, entry by entry, what the same
  steps give one Attend call each on twin sessions (same prompts): single tokens, prefill chunks and
  drafts of several tokens side by side, own positions, key padding; on nn.MultiheadAttention (the
  demo model) and on a decoder layer (grouped heads, RoPE); and memories' queries batched the same.
  Float32, fresh fixed-seed inputs; tolerance 1e-5 of the output's scale (tests/lib same_answer).
- An entry that fails answers its own error and changes nothing; the others are applied: an unknown
  handle, another tenant's, a handle named twice, a wrong session_length, a batch or dtype that does
  not match, another model's session, a budget that cannot hold a chunk; /metrics counts each entry
  by its own code (attnserve_step_entries_total).
- What is the call's refuses the call and applies nothing: fields of a single request beside steps,
  more entries than --max-steps-per-call, more tokens than --max-request-tokens or attention scores than
  --max-attention-scores in all; an entry whose error message is cut at the cap stays valid UTF-8; a deadline
  that passes during compute applies no entry.
- AttendStream: several batched steps in flight on one stream, each answered with its request_id.
- Under load: four callers' batched calls beside their twins' single calls and a plain caller, every
  entry equal to its twin's answer whatever shares its batch.
- Both again on a server with --varlen-attention emulate (kept runs: sessions in the CUDA engine's
  pool, a batch's steps attending together over it; per sequence on the CPU), which /metrics shows
  ran.

usage: python3 -m pytest batched_steps_test.py --attnserve PATH/TO/attnserve
"""
import os

import grpc
import numpy as np
import pytest

import attnserve_py as lib  # tests/lib, on the path by tests/conftest.py
import export_model  # tools/

E, H = 32, 4
HEADER = "attnserve-tenant"


@pytest.fixture(scope="module")
def stubs():
    return lib.load_stubs()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A model repository: nn.MultiheadAttention "mha" and a decoder layer "dec" (Llama-style: 4
    query heads on 2 key/value heads, RoPE), random weights."""
    import torch
    out = str(tmp_path_factory.mktemp("batched"))
    torch.manual_seed(5)
    export_model.export(torch.nn.MultiheadAttention(E, H, batch_first=True), os.path.join(out, "models", "mha"))
    lib.export_random_decoder(out, E, H, 2, np.random.default_rng(5))
    return os.path.join(out, "models")


@pytest.fixture(scope="module")
def server(attnserve, models):
    s = lib.Server(attnserve, "--models", models, "--tenant-header", HEADER, "--max-steps-per-call", "16",
                   "--max-request-tokens", "256", "--max-attention-scores", "20000", "--kv-budget-bytes", str(4 << 20), "--kv-max-entry-bytes", str(32 << 10))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def kept_server(attnserve, models):
    """The same server with --varlen-attention emulate: sessions' keys and values in the CUDA engine's
    pool, and batched steps attending in its kept runs (one launch per chunk there), per sequence on
    the CPU."""
    s = lib.Server(attnserve, "--models", models, "--tenant-header", HEADER, "--varlen-attention", "emulate",
                   "--kv-budget-bytes", str(4 << 20), "--kv-max-entry-bytes", str(32 << 10))
    yield s
    s.stop()


def tenant(name):
    return ((HEADER, name),)


def width(stub, pb, model):
    return stub.GetModel(pb.GetModelRequest(name=model), timeout=30).embed_dim


def connect(server, stubs, model="mha"):
    """The messages, a stub on the server, and `model`'s width."""
    pb, pb_grpc = stubs
    stub = pb_grpc.AttentionServiceStub(grpc.insecure_channel(server.target))
    return pb, stub, width(stub, pb, model)


def open_sessions(stub, pb, model, n, batch=1, who="a"):
    return [stub.OpenSession(pb.OpenSessionRequest(model=model, batch=batch), metadata=tenant(who),
                             timeout=30).handle for _ in range(n)]


def length_of(stub, pb, handle, who="a"):
    """The tokens a session holds: TruncateSession to a length past any is refused naming it."""
    try:
        stub.TruncateSession(pb.TruncateSessionRequest(handle=handle, length=1 << 40),
                             metadata=tenant(who) if who else None, timeout=30)
    except grpc.RpcError as e:
        text = e.details()
        if "in flight" in text:
            return "busy"
        return int(text.split("0 to ")[1].split()[0].rstrip(",;)")) if "0 to " in text else text
    return None


def counter(server, name, model):
    """A counter's sum over every series of `model`."""
    return sum(float(line.split()[-1]) for line in lib.metrics_lines(server, name) if f'model="{model}"' in line)


def same(got, want):
    ok, detail = lib.same_answer(got, want)
    return ok, detail


@pytest.mark.parametrize("which", ["server", "kept_server"])
@pytest.mark.parametrize("model", ["mha", "dec"])
def test_batched_steps_equal_one_call_each(request, which, stubs, model, checks):
    server = request.getfixturevalue(which)
    pb, stub, e = connect(server, stubs, model)
    n = 6
    single, batched = open_sessions(stub, pb, model, n), open_sessions(stub, pb, model, n)
    rng = np.random.default_rng(11)
    held = [0] * n
    padded, never_padded = set(), 0  # Sessions that had key padding; entries of those that never did.
    # Rounds: prompts of different lengths, then one token each with a chunk or a draft riding along,
    # own positions (rotary) and key padding on some entries.
    rounds = [[5, 1, 7, 2, 3, 4]] + [[1, 1, 3, 1, 2, 1] for _ in range(4)]
    for r, lengths in enumerate(rounds):
        req = pb.AttendRequest(request_id=100 + r)
        refs = []
        ref_flops = -counter(server, "attnserve_flops_total", model)
        for i, t in enumerate(lengths):
            q = rng.standard_normal((1, t, e)).astype(np.float32)
            kpm = rng.random((1, t)) < 0.3 if (i + r) % 3 == 0 else None
            if kpm is not None:
                kpm[0, 0] = False  # every query keeps at least one key
            one = pb.AttendRequest(session=single[i], query=lib.to_wire(pb, q), session_length=held[i])
            step = req.steps.add(session=batched[i], query=lib.to_wire(pb, q), session_length=held[i])
            if kpm is not None:
                one.key_padding_mask.CopyFrom(lib.to_wire(pb, kpm))
                step.key_padding_mask.CopyFrom(lib.to_wire(pb, kpm))
                padded.add(i)
            never_padded += i not in padded
            if model == "dec" and i == 2:  # own positions: a gap, as a runner with padding sends
                pos = [held[i] + 3 + j for j in range(t)]
                one.positions.extend(pos)
                step.positions.extend(pos)
            refs.append(stub.Attend(one, metadata=tenant("a"), timeout=30))
        ref_flops += counter(server, "attnserve_flops_total", model)
        flops_before = counter(server, "attnserve_flops_total", model)
        backends_before = counter(server, "attnserve_attention_backend_total", model)
        got = stub.Attend(req, metadata=tenant("a"), timeout=30)
        # /metrics counts a batched call's entries as the same calls one by one would be counted.
        flops = counter(server, "attnserve_flops_total", model) - flops_before
        backends = counter(server, "attnserve_attention_backend_total", model) - backends_before
        checks(f"{model} round {r}: attnserve_flops_total counts every entry's work", flops == pytest.approx(ref_flops),
               f"{flops} for the batched call, {ref_flops} for the same calls one by one")
        checks(f"{model} round {r}: attnserve_attention_backend_total counts every entry", backends == n,
               f"{backends} for {n} entries")
        checks(f"{model} round {r}: one answer per entry, in order, the call's request_id",
               len(got.steps) == n and got.request_id == 100 + r, f"{len(got.steps)} answers, id {got.request_id}")
        for i, t in enumerate(lengths):
            s = got.steps[i]
            ok, detail = same(s.output.data, refs[i].output.data)
            checks(f"{model} round {r} entry {i} ({t} tokens) equals its own call", ok and not s.HasField("error"),
                   f"{detail}; error {s.error.message!r}")
            checks(f"{model} round {r} entry {i}: session_length and shape",
                   s.session_length == refs[i].session_length == held[i] + t
                   and list(s.output.shape) == list(refs[i].output.shape),
                   f"{s.session_length} vs {refs[i].session_length}, shape {list(s.output.shape)}")
            held[i] += t
    if which == "kept_server":
        kept = sum(float(line.split()[-1]) for line in lib.metrics_lines(server, "attnserve_attention_backend_total")
                   if f'model="{model}"' in line and 'backend="kept_emulated"' in line)
        checks(f"{model}: every batched entry of a session that never had key padding attended in a kept run",
               kept == never_padded, f"{kept} counted, {never_padded} such entries")


def test_memories_batch_the_same(server, stubs, checks):
    pb, stub, e = connect(server, stubs)
    rng = np.random.default_rng(12)
    memories = []
    for length in (3, 9, 5):
        kv = rng.standard_normal((1, length, e)).astype(np.float32)
        memories.append(stub.CreateMemory(pb.CreateMemoryRequest(model="mha", key=lib.to_wire(pb, kv),
                                                                 value=lib.to_wire(pb, kv)),
                                          metadata=tenant("a"), timeout=30).handle)
    sessions = open_sessions(stub, pb, "mha", 1)
    req = pb.AttendRequest()
    refs = []
    for i, m in enumerate(memories):
        q = rng.standard_normal((1, 2 + i, e)).astype(np.float32)
        req.steps.add(memory=m, query=lib.to_wire(pb, q))
        refs.append(stub.Attend(pb.AttendRequest(memory=m, query=lib.to_wire(pb, q)), metadata=tenant("a"),
                                timeout=30))
    q = rng.standard_normal((1, 1, e)).astype(np.float32)
    req.steps.add(session=sessions[0], query=lib.to_wire(pb, q))  # a session's step rides along
    got = stub.Attend(req, metadata=tenant("a"), timeout=30)
    for i in range(len(memories)):
        ok, detail = same(got.steps[i].output.data, refs[i].output.data)
        checks(f"memory entry {i} equals Attend(memory=...)", ok, detail)
    checks("the session's step beside them is applied", got.steps[3].session_length == 1,
           f"{got.steps[3].session_length}, {got.steps[3].error.message}")


def test_an_entry_that_fails_changes_nothing(server, stubs, checks):
    pb, stub, e = connect(server, stubs)
    rng = np.random.default_rng(13)
    good = open_sessions(stub, pb, "mha", 2)
    mine = open_sessions(stub, pb, "mha", 5)
    pair = open_sessions(stub, pb, "mha", 1, batch=2)
    theirs = open_sessions(stub, pb, "mha", 1, who="b")
    dec = open_sessions(stub, pb, "dec", 1)
    x = lambda t=1, w=e, b=1: lib.to_wire(pb, rng.standard_normal((b, t, w)).astype(np.float32))  # noqa: E731
    req = pb.AttendRequest()
    req.steps.add(session=good[0], query=x())
    bad = {
        "unknown handle": (pb.Step(session="0123456789abcdef0123456789abcdef", query=x()), "NOT_FOUND", ""),
        "another tenant's": (pb.Step(session=theirs[0], query=x()), "NOT_FOUND", ""),
        "named twice": (pb.Step(session=good[0], query=x()), "ABORTED", "steps[0] of this call"),
        "wrong session_length": (pb.Step(session=mine[0], query=x(), session_length=4), "ABORTED", "holds 0"),
        "batch that does not match": (pb.Step(session=pair[0], query=x()), "INVALID_ARGUMENT", "batch"),
        "dtype that does not match": (pb.Step(session=mine[1], query=lib.to_wire(pb, np.zeros((1, 1, e)),
                                                                                  "float16")),
                                      "INVALID_ARGUMENT", "dtype"),
        "another model's session": (pb.Step(session=dec[0], query=x(w=width(stub, pb, "dec"))),
                                    "INVALID_ARGUMENT", "one model version"),
        "a chunk past the budget": (pb.Step(session=mine[2], query=x(t=200)), "", ""),
        "no handle": (pb.Step(query=x()), "INVALID_ARGUMENT", "exactly one of session, memory"),
        "a query of the wrong width": (pb.Step(session=mine[3], query=x(w=e + 1)), "INVALID_ARGUMENT", "embed_dim"),
    }
    for step, _, _ in bad.values():
        req.steps.append(step)
    req.steps.add(session=good[1], query=x(t=2))
    got = stub.Attend(req, metadata=tenant("a"), timeout=30)
    code = {c.value[0]: c.name for c in grpc.StatusCode}
    for j, (name, (_, want, says)) in enumerate(bad.items(), start=1):
        err = got.steps[j].error
        name_of = code.get(err.code, str(err.code))
        if want:
            checks(f"{name}: its own {want}", name_of == want and says in err.message and
                   err.message.startswith(f"steps[{j}]"), f"{name_of}: {err.message}")
        else:
            checks(f"{name}: refused on its own", err.code != 0, f"{name_of}: {err.message}")
        checks(f"{name}: no output", not got.steps[j].HasField("output"), "")
    # /metrics counts the call's entries, each by its own code.
    entries = {line.split('code="')[1].split('"')[0]: float(line.split()[-1])
               for line in lib.metrics_lines(server, "attnserve_step_entries_total") if 'model="mha"' in line}
    checks("attnserve_step_entries_total counts entries by their own code",
           entries.get("OK", 0) >= 2 and entries.get("NOT_FOUND", 0) >= 2 and entries.get("ABORTED", 0) >= 2 and
           entries.get("INVALID_ARGUMENT", 0) >= 4, str(entries))
    checks("the good entries are applied", got.steps[0].session_length == 1 and
           got.steps[len(bad) + 1].session_length == 2,
           f"{got.steps[0].session_length}, {got.steps[len(bad) + 1].session_length}")
    for h in mine:
        checks(f"session {h[:8]} refused is as it was", length_of(stub, pb, h) == 0, str(length_of(stub, pb, h)))
    checks("another tenant's session is as it was", length_of(stub, pb, theirs[0], who="b") == 0, "")


def test_what_is_the_calls_refuses_the_call(server, stubs, checks):
    pb, stub, e = connect(server, stubs)
    rng = np.random.default_rng(14)
    sessions = open_sessions(stub, pb, "mha", 17)
    x = lambda t=1: lib.to_wire(pb, rng.standard_normal((1, t, e)).astype(np.float32))  # noqa: E731

    def refused(req, says, timeout=30):
        try:
            stub.Attend(req, metadata=tenant("a"), timeout=timeout)
            return "answered"
        except grpc.RpcError as err:
            return f"{err.code().name}: {err.details()}" if says in err.details() else err.details()

    req = pb.AttendRequest(query=x(), is_causal=True)
    req.steps.add(session=sessions[0], query=x())
    outcome = refused(req, "query, is_causal")
    checks("a single request's fields beside steps: INVALID_ARGUMENT naming them",
           outcome.startswith("INVALID_ARGUMENT"), outcome)
    req = pb.AttendRequest()
    for h in sessions:
        req.steps.add(session=h, query=x())
    outcome = refused(req, "--max-steps-per-call")
    checks("17 entries over --max-steps-per-call 16: refused naming the flag", outcome.startswith("INVALID_ARGUMENT"),
           outcome)
    req = pb.AttendRequest()
    for h in sessions[:5]:
        req.steps.add(session=h, query=x(t=60))
    outcome = refused(req, "--max-request-tokens")
    checks("300 tokens in all over --max-request-tokens 256: refused naming the flag",
           outcome.startswith("INVALID_ARGUMENT"), outcome)
    # Each entry within --max-attention-scores (4 heads x 60 x 60 = 14,400 of 20,000), the three
    # together over it: one call is one request (a review had 128 entries at the limit compute 128x it).
    req = pb.AttendRequest()
    for h in sessions[:3]:
        req.steps.add(session=h, query=x(t=60))
    outcome = refused(req, "--max-attention-scores")
    checks("43,200 attention scores in all over --max-attention-scores 20,000: refused naming the flag",
           outcome.startswith("INVALID_ARGUMENT"), outcome)
    lengths = [length_of(stub, pb, h) for h in sessions]
    checks("every refused call applied nothing", lengths == [0] * len(sessions), str(lengths))


def test_a_long_error_message_is_cut_between_characters(server, stubs, checks):
    """An entry whose error message passes the 1 KiB cap (a handle of 400 three-byte characters) is cut
    between characters: the answer decodes, the other entry's output arrives (a review found the cut
    mid-character made protobuf refuse the whole answer, after the other step was applied)."""
    pb, stub, e = connect(server, stubs)
    good = open_sessions(stub, pb, "mha", 1)[0]
    q = lib.to_wire(pb, np.ones((1, 1, e), np.float32))
    outcomes = []
    for pad in range(3):
        req = pb.AttendRequest()
        req.steps.add(session=good, query=q)
        req.steps.add(session="x" * pad + "\u20ac" * 400, query=q)
        try:
            r = stub.Attend(req, metadata=tenant("a"), timeout=30)
            outcomes.append((r.steps[0].session_length, grpc.StatusCode.NOT_FOUND.value[0] == r.steps[1].error.code))
        except grpc.RpcError as err:
            outcomes.append(f"{err.code().name}: {err.details()}")
    checks("every answer decodes: the good entry applied once each, the long one NOT_FOUND",
           outcomes == [(1, True), (2, True), (3, True)], str(outcomes))


def test_a_call_answered_too_late_applies_no_entry(attnserve, stubs, checks):
    """A batched step whose deadline passes while it computes (a 4,000-token chunk rides along: ~0.3 s
    here) is answered DEADLINE_EXCEEDED and none of its entries is applied."""
    pb, pb_grpc = stubs
    server = lib.Server(attnserve)
    try:
        stub = pb_grpc.AttentionServiceStub(grpc.insecure_channel(server.target))
        sessions = [stub.OpenSession(pb.OpenSessionRequest(model="demo", batch=1), timeout=30).handle
                    for _ in range(4)]
        rng = np.random.default_rng(16)
        req = pb.AttendRequest()
        for i, h in enumerate(sessions):
            req.steps.add(session=h, query=lib.to_wire(pb, rng.standard_normal((1, 4000 if i == 0 else 1, 512))))
        try:
            stub.Attend(req, timeout=0.05)
            outcome = "OK"
        except grpc.RpcError as e:
            outcome = e.code().name
        lengths = []
        for h in sessions:  # each session's next step, once the late call's compute has ended
            lib.wait_until(lambda: length_of(stub, pb, h, who=None) != "busy", timeout=30)
            lengths.append(length_of(stub, pb, h, who=None))
        checks("answered DEADLINE_EXCEEDED during compute, and no entry applied",
               outcome == "DEADLINE_EXCEEDED" and lengths == [0, 0, 0, 0], f"{outcome}; lengths {lengths}")
    finally:
        server.stop()


def test_several_batched_steps_in_flight_on_one_stream(server, stubs, checks):
    pb, stub, e = connect(server, stubs)
    rng = np.random.default_rng(15)
    groups = [open_sessions(stub, pb, "mha", 3) for _ in range(4)]
    twins = [open_sessions(stub, pb, "mha", 3) for _ in range(4)]
    requests, refs = [], {}
    for g, group in enumerate(groups):
        req = pb.AttendRequest(request_id=g + 1)
        for i, h in enumerate(group):
            q = rng.standard_normal((1, 1 + i, e)).astype(np.float32)
            req.steps.add(session=h, query=lib.to_wire(pb, q))
            refs[(g + 1, i)] = stub.Attend(pb.AttendRequest(session=twins[g][i], query=lib.to_wire(pb, q)),
                                           metadata=tenant("a"), timeout=30)
        requests.append(req)
    answers = list(stub.AttendStream(iter(requests), metadata=tenant("a"), timeout=60))
    checks("one answer per batched step", sorted(a.request_id for a in answers) == [1, 2, 3, 4],
           str([a.request_id for a in answers]))
    for a in answers:
        for i in range(3):
            ok, detail = same(a.steps[i].output.data, refs[(a.request_id, i)].output.data)
            checks(f"stream request {a.request_id} entry {i} equals its own call", ok, detail)


def test_the_cli_decodes_sessions_together(server, cli, checks):
    """attnserve-cli decode --sessions N: every step of N sessions in one batched call."""
    import subprocess
    p = subprocess.run([cli, "--target", server.target, "decode", "--model", "mha", "--sessions", "3",
                        "--prompt-len", "4", "--steps", "2"], capture_output=True, text=True, timeout=60)
    lines = [line for line in p.stdout.splitlines() if line.startswith("step ")]
    checks("attnserve-cli decode --sessions 3: a prompt and two steps, each one call for the three",
           p.returncode == 0 and len(lines) == 3 and all("3 sessions" in line and "in one call" in line
                                                         for line in lines), p.stdout + p.stderr)


@pytest.mark.parametrize("which", ["server", "kept_server"])
def test_batched_answers_hold_under_concurrent_load(request, which, stubs, checks):
    """Four callers each step sessions of their own in batched calls while their twin sessions take
    the same tokens one call each and a fifth caller sends plain requests: every batched entry
    equals its twin's answer (float32 rounding) whatever else shares its batch, and no caller ever
    gets another's rows."""
    import threading
    server = request.getfixturevalue(which)
    pb, stub, e = connect(server, stubs)
    failures, done, shared = [], [], []

    def caller(c):
        rng = np.random.default_rng(100 + c)
        mine, twins = open_sessions(stub, pb, "mha", 3), open_sessions(stub, pb, "mha", 3)
        for r in range(6):
            req, refs = pb.AttendRequest(request_id=c * 100 + r), []
            for i in range(3):
                q = lib.to_wire(pb, rng.standard_normal((1, 1 + (i + r) % 3, e)))
                req.steps.add(session=mine[i], query=q)
                refs.append(stub.Attend(pb.AttendRequest(session=twins[i], query=q), metadata=tenant("a"),
                                        timeout=30))
            got = stub.Attend(req, metadata=tenant("a"), timeout=30)
            shared.append(got.timing.batch_size)
            for i in range(3):
                ok, detail = same(got.steps[i].output.data, refs[i].output.data)
                if not ok or got.request_id != c * 100 + r:
                    failures.append(f"caller {c} round {r} entry {i}: {detail}")
        done.append(c)

    def plain():
        rng = np.random.default_rng(7)
        while len(done) < 4:
            stub.Attend(pb.AttendRequest(model="mha", query=lib.to_wire(pb, rng.standard_normal((2, 5, e)))),
                        metadata=tenant("a"), timeout=30)

    threads = [threading.Thread(target=caller, args=(c,)) for c in range(4)] + [threading.Thread(target=plain)]
    [t.start() for t in threads]
    [t.join(timeout=120) for t in threads]
    checks("4 callers x 6 batched calls under load: every entry equals its twin's one call",
           not failures and len(done) == 4,
           f"{failures[:3]} done {done}; batch sizes seen {sorted(set(shared))}")
    print(f"batched calls' batch sizes: {sorted(set(shared))} (more than 1: it shared its batch)")
