#!/usr/bin/python3
"""Model lifecycle under load: versions, reloads (SIGHUP and AdminService.ReloadModels), a removed
model, a version that fails to load, while unary calls and streams run.

    reload_test.py ATTNSERVE_BINARY

A model repository of three models: `m` (versioned: m/1/), `legacy` (the unversioned layout) and
`gone`. Unary callers (m unpinned, m pinned to version 1, legacy, gone) and streams (m, gone) run
throughout while the test
  1. adds m/2/ (renamed into place) and sends SIGHUP: m serves version 2, pinned calls stay on 1;
  2. replaces m/2's weights file (atomic rename) and calls ReloadModels: m/2 is UPDATED;
  3. removes gone/ and calls ReloadModels: gone is UNLOADED, later calls to it get NOT_FOUND;
  4. adds a broken m/3/ and calls ReloadModels: FAILED, m/2 still serves; health and metrics say so;
  5. removes m/3/ and reloads: the repository is healthy again.
Every request is accounted for (answered, or NOT_FOUND for `gone` answered after its removal began);
every answer is checked against torch.nn.MultiheadAttention (float64) with the weights its
weights_hash names (tolerance: atol 2e-5 + rtol 1e-4; the server computes in float32); unary
callers never see older weights after newer ones; ListModels, GetModel, health and the
attnserve_model_info series agree after each step. Prints the figures; ends "N passed, N failed".
"""
import os
import queue
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import grpc
import numpy as np
import torch

import pytest  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
import attnserve_py as lib  # noqa: E402

E, H = 32, 4
ATOL, RTOL = 2e-5, 1e-4
TOKEN = "reload-test-token"
CODE_NAMES = {c.value[0]: c.name for c in grpc.StatusCode}


def make_weights(seed, e=E, h=H):
    torch.manual_seed(seed)
    mha = torch.nn.MultiheadAttention(e, h, bias=True)
    return {k: v.detach().clone() for k, v in mha.state_dict().items()}


def write_version(path, weights, heads=H):
    """Writes config.json and model.pt into a staging directory beside `path`, then renames it
    into place: the server never sees a half-written version."""
    staging = os.path.join(os.path.dirname(path), ".staging-" + os.path.basename(path))
    os.makedirs(staging)
    with open(os.path.join(staging, "config.json"), "w") as f:
        f.write('{"num_heads": %d}' % heads)
    torch.save(weights, os.path.join(staging, "model.pt"))
    os.rename(staging, path)


def replace_weights(path, weights):
    tmp = os.path.join(path, "model.pt.new")  # Not a weights file name while it is written.
    torch.save(weights, tmp)
    os.replace(tmp, os.path.join(path, "model.pt"))


def reference(weights, q):
    mha = torch.nn.MultiheadAttention(E, H, bias=True, batch_first=True).double()
    mha.load_state_dict({k: v.double() for k, v in weights.items()})
    with torch.no_grad():
        x = torch.from_numpy(q).double()
        return mha(x, x, x, need_weights=False)[0].numpy()


class Record:
    __slots__ = ("model", "version", "q", "sent", "done_at", "code", "hash", "answered_version", "output", "caller")


def test_versions_reloads_and_broken_models_under_load(attnserve, checks):
    binary = attnserve
    pb, rpc = lib.load_stubs()
    root = lib.temp_dir("attnserve-reload-")
    repo = os.path.join(root, "models")
    w = {"m1": make_weights(1), "m2": make_weights(2), "m3": make_weights(3), "legacy": make_weights(4),
         "gone": make_weights(5)}
    os.makedirs(os.path.join(repo, "m"))
    write_version(os.path.join(repo, "m", "1"), w["m1"])
    write_version(os.path.join(repo, "legacy"), w["legacy"])  # Unversioned: config.json at the top.
    write_version(os.path.join(repo, "gone"), w["gone"])
    token_file = os.path.join(root, "token")
    with open(token_file, "w") as f:
        f.write(TOKEN + "\n")

    server = lib.Server(binary, "--models", repo, "--admin-token-file", token_file, "--workers", "2")
    print(f"server: {server.banner.strip()}")
    channel = grpc.insecure_channel(server.target)
    stub = rpc.AttentionServiceStub(channel)
    admin = rpc.AdminServiceStub(channel)
    auth = (("authorization", "Bearer " + TOKEN),)
    hashes = {}  # weights_hash -> weights, filled as the server reports them

    def learn(name, version, key):
        info = stub.GetModel(pb.GetModelRequest(name=name, version=version), timeout=10)
        hashes[info.weights_hash] = w[key]
        return info.weights_hash

    h_m1, h_legacy, h_gone = learn("m", 1, "m1"), learn("legacy", 0, "legacy"), learn("gone", 0, "gone")
    checks("legacy layout serves as version 1", stub.GetModel(pb.GetModelRequest(name="legacy")).version == 1)

    # ---- load --------------------------------------------------------------------------------
    stop = threading.Event()
    records, records_mu = [], threading.Lock()
    removal_started = [float("inf")]

    def new_record(caller, model, version, rng):
        r = Record()
        r.caller, r.model, r.version = caller, model, version
        r.q = rng.standard_normal((2, int(rng.integers(3, 13)), E)).astype(np.float32)
        r.code, r.hash, r.answered_version, r.output = None, "", 0, None
        with records_mu:
            records.append(r)
        return r

    def answered(r, resp, code):
        r.code, r.done_at = code, time.time()
        if code == "OK":
            r.hash, r.answered_version = resp.weights_hash, resp.model_version
            r.output = lib.from_wire(pb, resp.output)

    def unary_caller(index):
        rng = np.random.default_rng(100 + index)
        targets = [("m", 0), ("m", 1), ("legacy", 0), ("gone", 0)]
        while not stop.is_set():
            model, version = targets[int(rng.integers(len(targets)))]
            r = new_record(f"unary{index}", model, version, rng)
            r.sent = time.time()
            req = pb.AttendRequest(model=model, model_version=version, query=lib.to_wire(pb, r.q))
            try:
                answered(r, stub.Attend(req, timeout=30), "OK")
            except grpc.RpcError as e:
                answered(r, None, e.code().name)

    def stream_caller(index):
        rng = np.random.default_rng(200 + index)
        window = threading.Semaphore(8)
        by_id = {}
        done = queue.Queue()

        def requests():
            n = 0
            while not stop.is_set():
                if not window.acquire(timeout=0.5):
                    continue
                model = ("m", "gone")[n % 2]
                r = new_record(f"stream{index}", model, 0, rng)
                r.sent = time.time()
                n += 1
                by_id[n] = r
                yield pb.AttendRequest(model=model, query=lib.to_wire(pb, r.q), request_id=n)

        try:
            for resp in stub.AttendStream(requests(), timeout=300):
                r = by_id.pop(resp.request_id)
                if resp.HasField("error"):
                    answered(r, None, CODE_NAMES.get(resp.error.code, str(resp.error.code)))
                else:
                    answered(r, resp, "OK")
                window.release()
        except grpc.RpcError as e:
            done.put(e.code().name)
        for r in by_id.values():
            r.code = r.code or "STREAM_ENDED"

    threads = [threading.Thread(target=unary_caller, args=(i,)) for i in range(3)]
    threads += [threading.Thread(target=stream_caller, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()

    def metrics():
        with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10) as f:
            return f.read().decode()

    def agree(step):
        """ListModels, GetModel, health and attnserve_model_info tell the same story."""
        listed = {(m.name, m.version, m.weights_hash) for m in stub.ListModels(pb.ListModelsRequest()).models}
        got = set()
        for name, version, _ in listed:
            info = stub.GetModel(pb.GetModelRequest(name=name, version=version))
            got.add((info.name, info.version, info.weights_hash))
        series = set()
        for line in metrics().splitlines():
            if line.startswith("attnserve_model_info{"):
                labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
                series.add((labels["model"], int(labels["version"]), labels["weights_hash"]))
        names = {n for n, _, _ in listed}
        healthy = all(lib.health_status(server.target, "attnserve.v1.AttentionService/" + n) == "SERVING"
                      for n in names)
        checks(f"{step}: ListModels = GetModel = attnserve_model_info, models' health SERVING",
               listed == got == series and healthy, f"listed {sorted(listed)} got {sorted(got)} "
               f"series {sorted(series)} healthy {healthy}")
        return listed

    def reload(step):
        start = time.time()
        resp = admin.ReloadModels(pb.ReloadModelsRequest(), metadata=auth, timeout=60)
        seconds = time.time() - start
        changes = {(c.name, c.version): (pb.ModelChange.Action.Name(c.action), c.weights_hash, c.message)
                   for c in resp.changes}
        print(f"{step}: ReloadModels took {seconds * 1000:.0f} ms: {changes}")
        return changes

    def served_since(t, model, h):
        with records_mu:
            return any(r.code == "OK" and r.model == model and r.hash == h and r.sent > t for r in records)

    try:
        time.sleep(2)
        phases = {"start": time.time()}
        # 1. A new version through SIGHUP.
        write_version(os.path.join(repo, "m", "2"), w["m2"])
        phases["sighup"] = t0 = time.time()
        server.proc.send_signal(signal.SIGHUP)
        ok = lib.wait_until(lambda: stub.GetModel(pb.GetModelRequest(name="m")).version == 2, timeout=30)
        print(f"1. SIGHUP: m version 2 served after {(time.time() - t0) * 1000:.0f} ms")
        checks("SIGHUP: m/2 serves", ok)
        h_m2 = learn("m", 2, "m2")
        checks("version 1 still listed, pinned", stub.GetModel(pb.GetModelRequest(name="m", version=1)).weights_hash == h_m1)
        checks("answers from m/2 under load", lib.wait_until(lambda: served_since(t0, "m", h_m2), timeout=20))
        agree("after SIGHUP")

        # 2. Changed weights through the admin RPC.
        for md, want in (((), "UNAUTHENTICATED"), ((("authorization", "Bearer wrong"),), "UNAUTHENTICATED"),
                         ((("authorization", "Basic " + TOKEN),), "UNAUTHENTICATED")):
            try:
                admin.ReloadModels(pb.ReloadModelsRequest(), metadata=md, timeout=10)
                code, details = "OK", ""
            except grpc.RpcError as e:
                code, details = e.code().name, e.details()
            checks(f"ReloadModels with {md or 'no credentials'}: {want}", code == want, f"{code}: {details}")
        replace_weights(os.path.join(repo, "m", "2"), w["m3"])
        phases["update"] = t1 = time.time()
        changes = reload("2. changed m/2")
        h_m3 = changes.get(("m", 2), ("", "", ""))[1]
        hashes[h_m3] = w["m3"]
        checks("ReloadModels: m/2 UPDATED to new weights", changes.get(("m", 2), ("",))[0] == "ACTION_UPDATED"
               and h_m3 not in ("", h_m2) and len(changes) == 1, str(changes))
        checks("GetModel(m) has the new weights", learn("m", 0, "m3") == h_m3)
        checks("answers from the new m/2 under load", lib.wait_until(lambda: served_since(t1, "m", h_m3), timeout=20))
        unchanged = reload("2b. nothing changed")
        checks("a reload with nothing changed changes nothing", unchanged == {}, str(unchanged))
        agree("after update")

        # 2c. A large model loads in the background while the others serve.
        w["big"] = make_weights(6, 2048, 16)  # 4 projections of 2048x2048: 64 MiB of float32
        write_version(os.path.join(repo, "big", "1"), w["big"], heads=16)
        t2 = time.time()
        changes = reload("2c. large model added")
        t3 = time.time()
        checks("ReloadModels: big LOADED", changes.get(("big", 1), ("",))[0] == "ACTION_LOADED", str(changes))
        with records_mu:
            during = [r.done_at - r.sent for r in records if r.code == "OK" and r.caller.startswith("unary")
                      and r.sent >= t2 and r.done_at <= t3]
            before = [r.done_at - r.sent for r in records if r.code == "OK" and r.caller.startswith("unary")
                      and t2 - 5 <= r.sent and r.done_at < t2]
        print(f"2c. unary calls answered while the 64 MiB model loaded ({(t3 - t2) * 1000:.0f} ms): {len(during)}, "
              f"p50 {np.median(during) * 1000:.1f} ms, max {max(during) * 1000:.1f} ms; in the 5 s before: "
              f"{len(before)}, p50 {np.median(before) * 1000:.1f} ms, max {max(before) * 1000:.1f} ms")
        checks("calls kept being answered while a model loaded", len(during) > 0, str(len(during)))
        shutil.rmtree(os.path.join(repo, "big"))
        changes = reload("2d. large model removed")
        checks("ReloadModels: big UNLOADED", changes == {("big", 1): ("ACTION_UNLOADED", "", "")}, str(changes))

        # 3. A removed model.
        removal_started[0] = phases["remove"] = time.time()
        shutil.rmtree(os.path.join(repo, "gone"))
        changes = reload("3. removed gone")
        checks("ReloadModels: gone UNLOADED", changes == {("gone", 1): ("ACTION_UNLOADED", "", "")}, str(changes))
        try:
            stub.GetModel(pb.GetModelRequest(name="gone"))
            code = "OK"
        except grpc.RpcError as e:
            code = e.code().name
        checks("GetModel(gone): NOT_FOUND", code == "NOT_FOUND", code)
        state = lib.health_status(server.target, "attnserve.v1.AttentionService/gone")
        checks("health of gone: NOT_SERVING", state == "NOT_SERVING", state)
        agree("after removal")

        # 4. A version that fails to load.
        write_version(os.path.join(repo, "m", "3"), w["m1"], heads=5)  # 5 does not divide 32
        phases["broken"] = time.time()
        changes = reload("4. broken m/3")
        action, _, message = changes.get(("m", 3), ("", "", ""))
        checks("ReloadModels: m/3 FAILED, naming its config", action == "ACTION_FAILED" and
               "m/3/config.json" in message and "num_heads 5" in message, str(changes))
        info = stub.GetModel(pb.GetModelRequest(name="m"))
        checks("m/2 still serves", info.version == 2 and info.weights_hash == h_m3)
        state = lib.health_status(server.target, "attnserve.v1.ModelRepository")
        checks("repository health: NOT_SERVING while a load failed", state == "NOT_SERVING", state)
        checks("server health stays SERVING", lib.health_status(server.target) == "SERVING")
        text = metrics()
        checks("attnserve_model_load_failures_total{model=\"m\"} counts it",
               re.search(r'attnserve_model_load_failures_total\{model="m"\} [1-9]', text) is not None)
        checks("attnserve_model_load_failing{model=\"m\"} is 1",
               'attnserve_model_load_failing{model="m"} 1' in text)
        checks("attnserve_model_reloads_total{outcome=\"failed\"} counts it",
               re.search(r'attnserve_model_reloads_total\{outcome="failed"\} [1-9]', text) is not None)
        checks("the server logs the failure", lib.wait_until(lambda: "m version 3: FAILED" in server.output(), 5))
        agree("after a failed load")

        # 5. Fixed by removing it.
        shutil.rmtree(os.path.join(repo, "m", "3"))
        changes = reload("5. m/3 removed")
        state = lib.health_status(server.target, "attnserve.v1.ModelRepository")
        checks("repository health SERVING again", state == "SERVING" and changes == {}, f"{state} {changes}")
        checks("attnserve_model_load_failing{model=\"m\"} back to 0",
               'attnserve_model_load_failing{model="m"} 0' in metrics())
        listed = agree("at the end")
        checks("served at the end: m/1, m/2 (new weights), legacy",
               listed == {("m", 1, h_m1), ("m", 2, h_m3), ("legacy", 1, h_legacy)}, str(listed))
        time.sleep(1)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
        out = server.stop()
    checks("callers finished", not any(t.is_alive() for t in threads))

    # ---- every request accounted for and checked -------------------------------------------
    with records_mu:
        all_records = list(records)
    codes = {}
    for r in all_records:
        codes[r.code] = codes.get(r.code, 0) + 1
    print(f"requests: {len(all_records)} sent: {codes}")
    for name, start in sorted(phases.items(), key=lambda kv: kv[1]):
        n = sum(1 for r in all_records if r.sent >= start)
        print(f"  sent since {name}: {n}")
    # A NOT_FOUND for gone is right when it was answered after its removal began: a call the client
    # stamped just before could reach the server only after the reload (a loaded 2-core machine
    # delayed one so, once in three full runs).
    lost = [r for r in all_records if r.code != "OK" and not (r.code == "NOT_FOUND" and r.model == "gone"
                                                               and r.done_at >= removal_started[0])]
    checks("zero lost requests (every one answered; NOT_FOUND only for gone, answered after its removal began)",
           not lost, f"{len(lost)}: " + ", ".join(f"{r.caller} {r.model} {r.code}" for r in lost[:5]))
    gone_late_ok = sum(1 for r in all_records if r.model == "gone" and r.code == "OK" and r.sent >= removal_started[0])
    print(f"gone: {gone_late_ok} answered after its removal began (accepted before the swap), "
          f"{codes.get('NOT_FOUND', 0)} NOT_FOUND")
    checks("some gone calls were refused after removal", codes.get("NOT_FOUND", 0) > 0)
    wrong, unknown, pinned_bad = 0, 0, 0
    worst = 0.0
    for r in all_records:
        if r.code != "OK":
            continue
        if r.hash not in hashes:
            unknown += 1
            continue
        if r.version == 1 and (r.hash != h_m1 or r.answered_version != 1):
            pinned_bad += 1
        want = reference(hashes[r.hash], r.q)
        err = np.abs(r.output - want) - (ATOL + RTOL * np.abs(want))
        worst = max(worst, float(np.max(np.abs(r.output - want))))
        wrong += bool((err > 0).any())
    answered_ok = codes.get("OK", 0)
    print(f"checked {answered_ok} answers against nn.MultiheadAttention: worst |diff| {worst:.2e}")
    checks("every answer's weights_hash is one the server reported", unknown == 0, str(unknown))
    checks("every answer matches nn.MultiheadAttention with the weights its hash names", wrong == 0, str(wrong))
    checks("pinned model_version 1 always answered by m/1", pinned_bad == 0, str(pinned_bad))
    order = {h_m1: 1, h_m2: 2, h_m3: 3}
    regress = 0
    for caller in {r.caller for r in all_records if r.caller.startswith("unary")}:
        last = 0
        for r in all_records:
            if r.caller == caller and r.model == "m" and r.version == 0 and r.code == "OK":
                regress += order[r.hash] < last
                last = max(last, order[r.hash])
    checks("unary callers never got older weights after newer ones", regress == 0, str(regress))
    checks("server exited cleanly after the reloads", "model reload" in out)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))


def test_a_version_too_big_for_memory_fails_and_the_others_serve(attnserve, checks):
    """A hostile review's finding (2026-12-02): a reload of a model whose weights the process cannot
    allocate (a sparse 16 GiB file, the server under an 8 GiB address-space limit) threw
    std::bad_alloc out of the reloading thread and ended the server, the models it served with it;
    at start-up the process aborted instead of exiting 2 with a message."""
    pb, rpc = lib.load_stubs()
    root = lib.temp_dir("attnserve-reload-oom-")
    repo = os.path.join(root, "models")
    w = make_weights(11)
    write_version(os.path.join(repo, "good"), w)
    token_file = os.path.join(root, "token")
    with open(token_file, "w") as f:
        f.write(TOKEN + "\n")
    limits = {"as": 8 << 30}
    server = lib.Server(attnserve, "--models", repo, "--admin-token-file", token_file, "--workers", "1",
                        limits=limits)
    try:
        channel = grpc.insecure_channel(server.target)
        stub, admin = rpc.AttentionServiceStub(channel), rpc.AdminServiceStub(channel)
        q = np.random.default_rng(11).standard_normal((1, 5, E)).astype(np.float32)
        lib.write_sparse_model(os.path.join(repo, "big"), 32768, 256)
        try:
            resp = admin.ReloadModels(pb.ReloadModelsRequest(), metadata=(("authorization", "Bearer " + TOKEN),),
                                      timeout=120)
            changes = {c.name: c for c in resp.changes}
            big = changes.get("big")
            checks(f"the reload reports big FAILED, out of memory: {big and big.message}",
                   big is not None and big.action == pb.ModelChange.ACTION_FAILED
                   and "out of memory loading its weights" in big.message and "big" in big.message)
            fd_dir = f"/proc/{server.proc.pid}/fd"
            open_files = [os.readlink(os.path.join(fd_dir, fd)) for fd in os.listdir(fd_dir)]
            left = [f for f in open_files if f.endswith("model.safetensors")]
            checks(f"no descriptor of big's weights is left open: {left}", not left)
        except grpc.RpcError as e:
            checks(f"ReloadModels answered: {e.code()} {e.details()}", False)
        try:
            got = lib.from_wire(pb, stub.Attend(pb.AttendRequest(model="good", query=lib.to_wire(pb, q)),
                                                timeout=30).output)
            checks("the model beside it still answers right",
                   np.allclose(got, reference(w, q), atol=ATOL, rtol=RTOL))
            names = [m.name for m in stub.ListModels(pb.ListModelsRequest(), timeout=10).models]
            checks(f"big is not served: {names}", "big" not in names and "good" in names)
        except grpc.RpcError as e:
            checks(f"the model beside it answers: {e.code()} {e.details()}", False)
        checks(f"the server still runs (exit code {server.proc.poll()})", server.proc.poll() is None)
    finally:
        if server.proc.poll() is None:
            server.stop()
    # At start-up: exit 2 with the message, not an abort.
    proc = subprocess.run(lib.with_limits(limits, [attnserve, "--address", "127.0.0.1:0", "--metrics-address", "",
                                                   "--http-address", "", "--models", repo]),
                          capture_output=True, text=True, timeout=120)
    checks(f"a start-up with it exits 2 naming it: {proc.returncode} {proc.stderr.strip()[-300:]}",
           proc.returncode == 2 and "out of memory loading its weights" in proc.stderr)
