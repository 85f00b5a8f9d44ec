#!/usr/bin/python3
"""Decoding sessions through the attnserve Python package against several replicas, for
replicas_test.py (which loads the raw stubs, and the package cannot share its process): threads open
sessions one after another, each thread on one replica (sessions opened through the target land
where it sends them: one on another replica is closed and opened again, up to 12 times), step each (a 4-token prompt, then one token at a time, a short pause
between steps) and check every answered step against one causal call over the session's whole
sequence, sent as a plain Attend (any replica: they hold the same model). Writes one JSON record
per session: the replica it was opened on (KvHandle.replica), when it opened and ended (time.time),
the steps answered and when the last was, when the step that failed was sent, the worst difference from the causal call, and the error that ended it, if any.

usage: replica_sessions.py TARGET --replicas A,B,C --mode direct|proxy --seconds S --out FILE
                           [--threads-per-replica 2]
  direct: the package's defaults (round_robin over TARGET's addresses, each session's calls straight
          to its replica); proxy: TARGET is nginx (service_config "proxy", route_to_replica=False:
          sessions routed by their attnserve-route key)
"""
import argparse
import json
import os
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
import attnserve_py as lib  # noqa: E402

STEPS = 24       # steps per session after the prompt
PROMPT = 4
PAUSE = 0.02     # seconds between steps, so that sessions span the test's events
TOLERANCE = 2e-5  # float32: a step (over kept keys) vs one causal call over the same sequence


def open_on(client, replica, rec):
    """A session on `replica` if the target sends one there within 12 tries, else the last one opened.
    rec["replica"] names the replica of the session in hand, so that an error closing one that landed
    elsewhere (its replica stopped meanwhile) is put down to that replica."""
    for _ in range(11):
        s = client.session("demo")
        rec["replica"] = s.info.replica
        if s.info.replica == replica:
            return s
        s.close()
    s = client.session("demo")
    rec["replica"] = s.info.replica
    return s


def run_sessions(attnserve, client, replica, seed, stop, records, lock):
    rng = np.random.default_rng(seed)
    while not stop.is_set():
        rec = {"replica": None, "opened": time.time(), "ended": None, "steps": 0, "last_ok": None, "worst": 0.0,
               "error": None, "sent": None}
        outputs, tokens = [], []
        try:
            with open_on(client, replica, rec) as s:
                for step in range(STEPS + 1):
                    x = rng.standard_normal((1, PROMPT if step == 0 else 1, 512)).astype(np.float32)
                    rec["sent"] = time.time()  # The step in flight, if it fails.
                    outputs.append(s.step(x).output)
                    tokens.append(x)
                    rec["steps"] += 1
                    rec["last_ok"] = time.time()
                    time.sleep(PAUSE)
                whole = np.concatenate(tokens, axis=1)
                ref = client.attend(whole, is_causal=True).output
                rec["worst"] = float(np.abs(np.concatenate(outputs, axis=1) - ref).max())
        except attnserve.AttnserveError as e:
            rec["error"] = {"code": e.code.name, "message": e.message, "at": time.time(), "sent": rec["sent"]}
        rec["ended"] = time.time()
        with lock:
            records.append(rec)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("target")
    ap.add_argument("--mode", choices=("direct", "proxy"), required=True)
    ap.add_argument("--seconds", type=float, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--replicas", required=True)
    ap.add_argument("--threads-per-replica", type=int, default=2)
    args = ap.parse_args()
    attnserve = lib.load_package()
    if args.mode == "direct":
        client = attnserve.Client(args.target, deadline=20)
    else:
        client = attnserve.Client(args.target, deadline=20, service_config="proxy", route_to_replica=False)
    stop, lock, records = threading.Event(), threading.Lock(), []
    replicas = args.replicas.split(",")
    threads = [threading.Thread(target=run_sessions,
                                args=(attnserve, client, replicas[i % len(replicas)], 100 + i, stop, records, lock),
                                daemon=True) for i in range(args.threads_per_replica * len(replicas))]
    for t in threads:
        t.start()
    try:
        time.sleep(args.seconds)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
        with open(args.out, "w") as f:
            json.dump(records, f)
        client.close()


if __name__ == "__main__":
    main()
