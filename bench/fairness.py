#!/usr/bin/python3
"""Tenants and priorities on one server: FCFS (--scheduling fcfs) against fair (the default), each
tenant an attnserve-bench process (its name in the attnserve-tenant header the server trusts with
--tenant-header). Prints, per scenario, the paper's metrics ("Fairness in Serving LLMs", OSDI 2024):
the service gap between two backlogged tenants per 1 s window (max, mean) in FLOPs over weight, each
tenant's share of the served FLOPs against its weight, each tenant's p50/p99 and the total
throughput; then the goals of issue 41 as ratios, and exits 1 when one is missed.

Scenarios (demo model, E=512, float32; D seconds each after 2 s of warm-up):
  backlogged 1:1 and 3:1  tenants a and b, 16 callers each, lengths 256-1,024 (always backlogged)
  light beside heavy      light: 2 callers, 16 tokens; heavy: 32 callers, 256-1,024; and light alone
  priority                high (priority 1): 2 callers, 16 tokens, under a low (priority 2) flood of
                          32 callers, 256-1,024; and high alone
  throughput              W1 (32 callers, 8-64) and W2 (32 callers, 16-512, half cross-attention)
                          split over two tenants, fair against FCFS
"One largest batch's compute time" is the longest batch compute of that same run (the server's access
log, compute_ms): what a request that arrives as every worker starts one must wait, under that load on
those cores. A lone 1,024-token request (one caller) is printed beside it. Writes bench/out-fairness/.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

E = 512
OUT = "bench/out-fairness"


def flops(lq, lk=None):
    lk = lq if lk is None else lk
    return 2.0 * lq * E * E * 2 + 2.0 * lk * E * E * 2 + 4.0 * lq * lk * E


class Server:
    def __init__(self, build, name, *args):
        self.log = open(os.path.join(OUT, f"server-{name}.log"), "w")
        self.access = os.path.join(OUT, f"access-{name}.log")
        if os.path.exists(self.access):
            os.remove(self.access)
        self.proc = subprocess.Popen([f"{build}/attnserve", "--address", "127.0.0.1:0", "--metrics-address", "", "--http-address", "",
                                      "--tenant-header", "attnserve-tenant", "--access-log", self.access,
                                      "--access-log-max-lines", "1000000", *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        banner = self.proc.stdout.readline()
        self.log.write(banner)
        m = re.search(r" on [\d.]+:(\d+)", banner)
        if not m:
            raise RuntimeError("attnserve did not start: " + banner + self.proc.stdout.read())
        self.target = f"127.0.0.1:{m.group(1)}"

    def stop(self):
        self.proc.terminate()
        self.log.write(self.proc.communicate(timeout=60)[0])
        self.log.close()

    def largest_compute_ms(self):
        """The longest batch compute of the run (the access log's compute_ms): "one largest batch's
        compute time" as it was under this load, on these cores."""
        return max(json.loads(l).get("compute_ms", 0) for l in open(self.access))


def run(build, server, duration, tenants):
    """tenants: {name: [bench args]}, all at once. Returns {name: (json row, samples)}."""
    procs = {}
    for name, args in tenants.items():
        samples = os.path.join(OUT, f"samples-{name}.txt")
        js = os.path.join(OUT, f"row-{name}.json")
        for p in (samples, js):
            if os.path.exists(p):
                os.remove(p)
        procs[name] = (subprocess.Popen([f"{build}/attnserve-bench", "--target", server.target, "--label", name,
                                         "--duration", str(duration), "--warmup", "2", "--tenant", name,
                                         "--samples", samples, "--json", js, *args],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL), samples, js)
    out = {}
    for name, (p, samples, js) in procs.items():
        if p.wait(timeout=duration + 300) != 0:
            raise RuntimeError(f"attnserve-bench for {name} exited {p.returncode}")
        rows = [l.split() for l in open(samples)]
        out[name] = (json.loads(open(js).read().splitlines()[-1]),
                     [(float(t), float(ms), float(f), int(c)) for t, ms, f, c in rows])
    return out


def gaps(result, weights):
    """Per whole 1 s window of the measured time (both tenants backlogged throughout):
    |served_a/w_a - served_b/w_b| in FLOPs, a window where one got nothing included."""
    (a, b) = sorted(weights)
    # Where both measured (each bench process measures its own D seconds).
    t0 = max(min(s[0] for s in result[n][1]) for n in (a, b))
    t1 = min(max(s[0] for s in result[n][1]) for n in (a, b))
    windows = []
    w = t0
    while w + 1 <= t1:
        served = {n: sum(f for t, _, f, c in result[n][1] if w <= t < w + 1 and c == 0) / weights[n] for n in (a, b)}
        windows.append(abs(served[a] - served[b]))
        w += 1
    return (max(windows), statistics.mean(windows)) if windows else (float("nan"), float("nan"))


def share(result, weights):
    """Each tenant's served FLOPs over the run, and (F_a/F_b)/(w_a/w_b)."""
    served = {n: sum(f for _, _, f, c in result[n][1] if c == 0) for n in weights}
    (a, b) = sorted(weights)
    return served, (served[a] / served[b]) / (weights[a] / weights[b])


def row(name, r):
    j = r[0]
    return (f"  {name:<10} {j['requests_per_s']:9.1f} req/s {j['tflops'] * 1e3:9.1f} GFLOP/s "
            f"p50 {j['latency_ms']['p50']:8.2f} p99 {j['latency_ms']['p99']:8.2f} ms  errors {j['errors']}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    ap.add_argument("--duration", type=float, default=10)
    ap.add_argument("--only-throughput", action="store_true",
                    help="only the throughput scenario (W1, W2 over two tenants), --rounds times")
    ap.add_argument("--rounds", type=int, default=1,
                    help="throughput: FCFS and fair alternate this many times; the ratio of the medians")
    a = ap.parse_args()
    if a.only_throughput:
        os.makedirs(OUT, exist_ok=True)
        goals = []
        throughput(a, goals)
        return report_goals(goals, {})
    os.makedirs(OUT, exist_ok=True)
    d = a.duration
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    print(next((l for l in cpu.splitlines() if l.startswith("Model name")), "Model name: ?"))
    goals, report = [], {}
    heavy = ["--callers", "32", "--lengths", "uniform:256:1024"]
    half = ["--callers", "16", "--lengths", "uniform:256:1024"]
    light = ["--callers", "2", "--lengths", "fixed:16"]

    tmp = tempfile.mkdtemp(prefix="attnserve-fairness-")
    files = {}
    for wa in (1, 3):
        files[wa] = os.path.join(tmp, f"tenants-{wa}.json")
        with open(files[wa], "w") as f:
            json.dump({"tenants": {"a": {"weight": wa}, "b": {"weight": 1}, "heavy": {}, "light": {}}}, f)

    # One largest batch's compute: a lone 1,024-token request.
    s = Server(a.build, "largest", "--tenants", files[1])
    largest = run(a.build, s, d / 2, {"largest": ["--callers", "1", "--lengths", "fixed:1024"]})
    alone = run(a.build, s, d, {"light": light})
    s.stop()
    largest_ms = largest["largest"][0]["latency_ms"]["p50"]
    largest_flops = flops(1024)
    print(f"one largest batch (1,024 tokens alone): {largest_ms:.1f} ms, {largest_flops / 1e9:.2f} GFLOP")
    print(row("light alone", alone["light"]))

    print("\nbacklogged tenants a and b (16 callers each, 256-1,024 tokens): service gap per 1 s window "
          "(GFLOP over weight), share of FLOPs against the weights")
    for wa in (1, 3):
        for mode in ("fcfs", "fair"):
            s = Server(a.build, f"backlogged-{wa}-{mode}", "--tenants", files[wa], "--scheduling", mode)
            r = run(a.build, s, d, {"a": half, "b": half})
            s.stop()
            weights = {"a": wa, "b": 1}
            worst, mean = gaps(r, weights)
            served, ratio = share(r, weights)
            total = sum(x[0]["tflops"] for x in r.values())
            print(f" weights {wa}:1 {mode:<4}  gap max {worst / 1e9:7.2f} mean {mean / 1e9:7.2f}  "
                  f"share a/b over weights {ratio:5.3f}  total {total * 1e3:7.1f} GFLOP/s")
            for n in ("a", "b"):
                print(row(n, r[n]))
            report[f"backlogged-{wa}-{mode}"] = {"gap_max": worst, "gap_mean": mean, "ratio": ratio,
                                                 "total_tflops": total}
            if mode == "fair":
                goals.append((f"weights {wa}:1: served FLOPs over weights a/b within 10%", ratio, 0.9, 1.1))
                goals.append((f"weights {wa}:1: worst 1 s gap / (2 x largest batch FLOPs over weight b)",
                              worst / (2 * largest_flops), None, 1.0))

    print("\nlight (2 callers, 16 tokens) beside heavy (32 callers, 256-1,024), weights 1:1")
    light_p99 = {}
    for mode in ("fcfs", "fair"):
        s = Server(a.build, f"light-{mode}", "--tenants", files[1], "--scheduling", mode)
        r = run(a.build, s, d, {"heavy": heavy, "light": light})
        s.stop()
        light_p99[mode] = r["light"][0]["latency_ms"]["p99"]
        print(f" {mode}")
        for n in ("heavy", "light"):
            print(row(n, r[n]))
        if mode == "fair":
            fair_largest = s.largest_compute_ms()
    bound = alone["light"][0]["latency_ms"]["p99"] + fair_largest
    print(f" one largest batch's compute in the fair run: {fair_largest:.1f} ms")
    goals.append(("light p99 with heavy / (alone p99 + one largest batch)", light_p99["fair"] / bound, None, 1.0))
    report["light"] = {"alone_p99": alone["light"][0]["latency_ms"]["p99"], "largest_ms": largest_ms, **light_p99}

    print("\npriority: high (priority 1, 2 callers, 16 tokens) under a low flood (priority 2, 32 callers)")
    s = Server(a.build, "priority", "--tenants", files[1], "--priority-levels", "2")
    high_alone = run(a.build, s, d, {"light": light + ["--priority", "1"]})
    r = run(a.build, s, d, {"heavy": heavy + ["--priority", "2"], "light": light + ["--priority", "1"]})
    s.stop()
    flood_largest = s.largest_compute_ms()
    print(f" one largest batch's compute under the flood: {flood_largest:.1f} ms")
    print(row("alone", high_alone["light"]))
    for n in ("heavy", "light"):
        print(row(n, r[n]))
    bound = high_alone["light"][0]["latency_ms"]["p99"] + flood_largest
    goals.append(("high p99 under the flood / (alone p99 + one largest batch)",
                  r["light"][0]["latency_ms"]["p99"] / bound, None, 1.0))

    throughput(a, goals, files[1])
    return report_goals(goals, report)


def throughput(a, goals, tenants_file=None):
    """W1 and W2 split over two tenants, FCFS and fair alternating a.rounds times: medians."""
    if tenants_file is None:
        tenants_file = os.path.join(tempfile.mkdtemp(prefix="attnserve-fairness-"), "tenants.json")
        with open(tenants_file, "w") as f:
            json.dump({"tenants": {"a": {}, "b": {}}}, f)
    print(f"\nthroughput, two tenants of 16 callers each: fair / FCFS ({a.rounds} alternating rounds, medians)")
    w = {"W1": ["--callers", "16", "--lengths", "uniform:8:64"],
         "W2": ["--callers", "16", "--lengths", "uniform:16:512", "--cross", "0.5"]}
    for name, args in w.items():
        tput = {"fcfs": [], "fair": []}
        for _ in range(a.rounds):
            for mode in ("fcfs", "fair"):
                s = Server(a.build, f"{name}-{mode}", "--tenants", tenants_file, "--scheduling", mode)
                r = run(a.build, s, a.duration, {"a": args, "b": args + ["--seed", "2"]})
                s.stop()
                tput[mode].append(sum(x[0]["tokens_per_s"] for x in r.values()))
        fcfs, fair = statistics.median(tput["fcfs"]), statistics.median(tput["fair"])
        print(f" {name}: FCFS {fcfs:9.0f} tok/s, fair {fair:9.0f} tok/s, ratio {fair / fcfs:.3f} "
              f"(rounds: {', '.join(f'{b / c:.3f}' for c, b in zip(tput['fcfs'], tput['fair']))})")
        goals.append((f"{name} throughput fair / FCFS", fair / fcfs, 0.95, None))


def report_goals(goals, report):
    print("\ngoals")
    missed = 0
    for name, value, lo, hi in goals:
        ok = (lo is None or value >= lo) and (hi is None or value <= hi)
        missed += not ok
        rng = f">= {lo}" if hi is None else f"<= {hi}" if lo is None else f"{lo} to {hi}"
        print(f"  {'ok  ' if ok else 'MISS'} {name}: {value:.3f} (goal {rng})")
    report["goals"] = [{"name": n, "value": v} for n, v, _, _ in goals]
    with open(os.path.join(OUT, "report.json"), "w") as f:
        json.dump(report, f, indent=1)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
