#!/usr/bin/python3
"""Decoding sessions and memories outlive a reload that replaces their model's weights.

A model `m` (E=32, 4 heads, float32) serves 32 decoding sessions stepping from threads (steps of 1-3
tokens, through the attnserve Python package) and a memory, with plain calls as extra load, while its
weights file is replaced and the server reloads (SIGHUP). Checks: no step fails (no NOT_FOUND);
every session's steps, before and after the reload, equal causal nn.MultiheadAttention over its whole
sequence with the weights it was opened on (float64 reference, max|out-ref|/max|ref| <= 1e-5), and each
answer names those weights (weights_hash); the memory likewise; sessions opened after the reload get
the new weights; attnserve_kv_model_entries counts the entries on the old weights while they live and
drops the series when the last one closes, while attnserve_model_info names only the new weights.

usage: python3 -m pytest kv_reload_test.py --attnserve PATH/TO/attnserve
"""
import os
import shutil
import signal
import sys
import threading
import time

import numpy as np
import torch

import pytest  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
import attnserve_py as lib  # noqa: E402

E, H = 32, 4
SESSIONS, STEPS = 32, 12


def weights(seed):
    torch.manual_seed(seed)
    mha = torch.nn.MultiheadAttention(E, H, bias=True)
    with torch.no_grad():
        mha.in_proj_bias.uniform_(-0.5, 0.5)
    return {k: v.detach().clone() for k, v in mha.state_dict().items()}


def module(w):
    m = torch.nn.MultiheadAttention(E, H, bias=True, batch_first=True).double()
    m.load_state_dict({k: v.double() for k, v in w.items()})
    return m


def causal_ref(w, x):
    n = x.shape[1]
    with torch.no_grad():
        xx = torch.from_numpy(x).double()
        return module(w)(xx, xx, xx, attn_mask=torch.ones(n, n, dtype=torch.bool).triu(1))[0].numpy()


def cross_ref(w, q, k, v):
    with torch.no_grad():
        t = lambda a: torch.from_numpy(a).double()
        return module(w)(t(q), t(k), t(v))[0].numpy()


def err(got, ref):
    return float(np.abs(np.asarray(got, np.float64) - ref).max() / np.abs(ref).max())


def test_memories_and_sessions_keep_their_weights_across_a_reload(attnserve, checks):
    binary = attnserve
    attnserve = lib.load_package()
    tmp = lib.temp_dir("attnserve-kv-reload-")
    path = os.path.join(tmp, "models", "m")
    os.makedirs(path)
    old, new = weights(1), weights(2)
    with open(os.path.join(path, "config.json"), "w") as f:
        f.write('{"num_heads": %d}' % H)
    torch.save(old, os.path.join(path, "model.pt"))
    server = lib.Server(binary, "--models", os.path.join(tmp, "models"))
    client = attnserve.Client(server.target, deadline=60)
    old_hash = client.get_model("m").weights_hash
    rng = np.random.default_rng(20261124)
    halfway = threading.Barrier(SESSIONS + 1)
    reloaded = threading.Event()
    results, failures, lock = {}, [], threading.Lock()

    def decode(i, x, lengths):
        """One session: half its steps before the reload, the rest after."""
        try:
            with client.session("m", 1) as s:
                outs, hashes, t0 = [], set(), 0
                for n, t in enumerate(lengths):
                    if n == len(lengths) // 2:
                        halfway.wait(timeout=120)
                        reloaded.wait(timeout=120)
                    r = s.step(x[:, t0:t0 + t])
                    outs.append(r.output)
                    hashes.add(r.weights_hash)
                    t0 += t
            with lock:
                results[i] = (np.concatenate(outs, axis=1), hashes)
        except Exception as e:  # noqa: BLE001 -- every failure is the finding
            with lock:
                failures.append(f"session {i}: {e}")
            halfway.abort()

    def plain_load(stop):
        q = rng.standard_normal((2, 5, E)).astype(np.float32)
        while not stop.is_set():
            try:
                client.attend(q, model="m")
            except Exception as e:  # noqa: BLE001
                with lock:
                    failures.append(f"plain call: {e}")
                return

    inputs = {}
    for i in range(SESSIONS):
        lengths = [int(n) for n in rng.integers(1, 4, STEPS)]
        inputs[i] = (rng.standard_normal((1, sum(lengths), E)).astype(np.float32), lengths)
    mk = rng.standard_normal((1, 9, E)).astype(np.float32)
    mv = rng.standard_normal((1, 9, E)).astype(np.float32)
    mq = rng.standard_normal((1, 4, E)).astype(np.float32)
    memory = client.memory(mk, mv, model="m")
    stop = threading.Event()
    try:
        threads = [threading.Thread(target=decode, args=(i, *inputs[i])) for i in range(SESSIONS)]
        threads.append(threading.Thread(target=plain_load, args=(stop,), daemon=True))
        for t in threads:
            t.start()
        try:
            halfway.wait(timeout=120)
            held = lib.metrics_lines(server, "attnserve_kv_model_entries")
            replace = os.path.join(path, "model.pt.new")
            torch.save(new, replace)
            os.replace(replace, os.path.join(path, "model.pt"))
            server.proc.send_signal(signal.SIGHUP)
            ok = lib.wait_until(lambda: client.get_model("m").weights_hash != old_hash, timeout=60, step=0.1)
            new_hash = client.get_model("m").weights_hash
            checks("the reload serves the new weights", ok and new_hash != old_hash)
            during = lib.metrics_lines(server, "attnserve_kv_model_entries")
        except threading.BrokenBarrierError:
            held = during = []
            new_hash = None
        reloaded.set()
        for t in threads[:-1]:
            t.join(timeout=300)
        try:
            r = memory.attend(mq)
            got = (err(r.output, cross_ref(old, mq, mk, mv)), r.weights_hash)
            memory.delete()
        except attnserve.AttnserveError as e:
            got = (float("inf"), str(e))
        checks("the memory answers with the weights it was made with, after the reload",
               got[0] <= 1e-5 and got[1] == old_hash, str(got))
        # A session opened now gets the new weights.
        x, lengths = inputs[0]
        with client.session("m", 1) as s:
            outs = [s.step(x[:, :2]).output, s.step(x[:, 2:5]).output]
            fresh_hash = s.step(x[:, 5:6]).weights_hash
        fresh = np.concatenate(outs, axis=1)
        stop.set()
        threads[-1].join(timeout=60)

        checks(f"{SESSIONS} sessions crossing the reload under load: no step failed", not failures, "; ".join(failures[:3]))
        worst, pinned = 0.0, True
        for i, (got, hashes) in results.items():
            worst = max(worst, err(got, causal_ref(old, inputs[i][0])))
            pinned = pinned and hashes == {old_hash}
        checks(f"every step of every session equals causal MHA with the weights it was opened on (worst {worst:.1e})",
               len(results) == SESSIONS and worst <= 1e-5)
        checks("every answer names those weights (weights_hash)", pinned)
        checks("a session opened after the reload gets the new weights",
               err(fresh, causal_ref(new, x[:, :5])) <= 1e-5 and fresh_hash == new_hash)
        old_label = f'weights_hash="{old_hash}"'
        count = lambda lines: sum(float(l.split()[-1]) for l in lines if old_label in l)
        checks("attnserve_kv_model_entries counts the entries on the old weights across the reload",
               count(held) == SESSIONS + 1 and count(during) == SESSIONS + 1, f"{held} / {during}")
        after = lib.metrics_lines(server, "attnserve_kv_model_entries")
        info = lib.metrics_lines(server, "attnserve_model_info")
        checks("once they end the old weights' series is gone; attnserve_model_info names only the new",
               not any(old_label in l for l in after) and any(new_hash and new_hash in l for l in info) and
               not any(old_label in l for l in info), f"{after} / {info}")
    finally:
        stop.set()
        reloaded.set()
        client.close()
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)



if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
