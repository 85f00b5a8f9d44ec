#!/usr/bin/env python3
"""The evidence a GPU run leaves (bench/gpu_quick.sh), each summarised in a line or a few:

  gpu_evidence.py dmon FILE LABEL            nvidia-smi dmon -s ut samples: SM and memory use, PCIe rx/tx
  gpu_evidence.py stages BEFORE AFTER LABEL  two /metrics scrapes around a load: the mean time of each
                                             stage (attnserve_stage_seconds), batches and their sizes
  gpu_evidence.py profile TRACE              a Kineto Chrome trace: device busy time by kind, the
                                             longest kernels
  gpu_evidence.py cpu BEFORE AFTER LABEL     two snapshots (cpu_snapshot below) around a load: the
                                             machine's busy cores and the server's busiest threads
  gpu_evidence.py rows JSONL LABEL...        fails unless every named row answered requests, no errors

Standard library only: it runs on the GPU machine's python3 and on the CPU rehearsal alike.
"""
import collections
import json
import os
import re
import sys


def dmon(path, label):
    header, rows = None, []
    for line in open(path, errors="replace"):
        if line.startswith("#"):
            if header is None:
                header = line[1:].split()
            continue
        cells = line.split()
        if header and len(cells) == len(header):
            rows.append(dict(zip(header, cells)))

    def mean(col):
        vals = [float(r[col]) for r in rows if col in r and re.fullmatch(r"[0-9.]+", r[col])]
        return (sum(vals) / len(vals), max(vals)) if vals else (float("nan"), float("nan"))

    sm, mem, rx, tx = mean("sm"), mean("mem"), mean("rxpci"), mean("txpci")
    print(f"dmon {label}: {len(rows)} samples; SM busy {sm[0]:.0f}% mean ({sm[1]:.0f}% max), "
          f"memory {mem[0]:.0f}%, PCIe rx {rx[0]:.0f} MB/s (max {rx[1]:.0f}), "
          f"tx {tx[0]:.0f} MB/s (max {tx[1]:.0f})")


SERIES = re.compile(r'^(\w+)(?:\{([^}]*)\})?\s+([-+0-9.eEinfNa]+)$')


def scrape(path):
    out = {}
    for line in open(path, errors="replace"):
        m = SERIES.match(line.strip())
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
            out[(m.group(1), tuple(sorted(labels.items())))] = float(m.group(3))
    return out


def stages(before_path, after_path, label):
    before, after = scrape(before_path), scrape(after_path)

    def delta(name, **labels):
        total = 0.0
        for (n, ls), v in after.items():
            d = dict(ls)
            if n == name and all(d.get(k) == w for k, w in labels.items()):
                total += v - before.get((n, ls), 0.0)
        return total

    parts = []
    for stage in ("decode", "gather", "copy_in", "compute", "copy_out", "encode"):
        n = delta("attnserve_stage_seconds_count", stage=stage)
        if n > 0:
            parts.append(f"{stage} {1e3 * delta('attnserve_stage_seconds_sum', stage=stage) / n:.3f} ms"
                         f" x{n:.0f}")
    batches = delta("attnserve_batch_size_requests_count")
    requests = delta("attnserve_batch_size_requests_sum")
    tokens = delta("attnserve_batch_size_tokens_sum")
    compute = delta("attnserve_compute_seconds_sum")
    print(f"stages {label}: " + (", ".join(parts) if parts else "none recorded"))
    if batches > 0:
        # The batch-size distribution from the cumulative buckets.
        buckets = []
        def bound(item):
            return float(dict(item[0][1]).get("le", "inf").replace("+Inf", "inf"))
        for (n, ls), v in sorted(after.items(), key=bound):
            if n == "attnserve_batch_size_requests_bucket":
                buckets.append((dict(ls)["le"], v - before.get((n, ls), 0.0)))
        dist, last = [], 0.0
        for le, cum in buckets:
            if cum - last > 0:
                dist.append(f"<={le}: {100 * (cum - last) / batches:.0f}%")
            last = cum
        print(f"batches {label}: {batches:.0f}, {requests / batches:.1f} requests and "
              f"{tokens / batches:.0f} tokens each, compute {1e3 * compute / batches:.2f} ms each; "
              f"sizes {', '.join(dist)}")


def profile(path):
    events = json.load(open(path)).get("traceEvents", [])
    busy = collections.Counter()
    kernels = collections.Counter()
    count = collections.Counter()
    lo, hi = float("inf"), 0.0
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        cat = e.get("cat", "")
        if cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            name = e.get("name", "?")
            kind = cat
            if cat == "gpu_memcpy":
                kind = "memcpy " + ("HtoD" if "HtoD" in name else "DtoH" if "DtoH" in name else
                                    "DtoD" if "DtoD" in name else name)
            busy[kind] += e["dur"]
            if cat == "kernel":
                kernels[name[:90]] += e["dur"]
                count[name[:90]] += 1
            lo, hi = min(lo, e["ts"]), max(hi, e["ts"] + e["dur"])
    if not busy:
        print(f"profile {path}: no device activity recorded")
        return
    window = hi - lo
    shares = ", ".join(f"{k} {100 * v / window:.1f}%" for k, v in busy.most_common())
    print(f"profile: {window / 1e3:.1f} ms of device activity; busy by kind (of that window): {shares}")
    for name, t in kernels.most_common(6):
        print(f"  {t / 1e3:8.2f} ms {count[name]:6d}x  {name}")


def cpu_snapshot(pid, path):
    """The machine's /proc/stat cpu line and each of process `pid`'s threads' CPU ticks, as JSON."""
    snap = {"stat": open("/proc/stat").readline().split()[1:], "threads": {},
            "cores": os.cpu_count(), "hz": os.sysconf("SC_CLK_TCK")}
    task = f"/proc/{pid}/task"
    for tid in os.listdir(task) if os.path.isdir(task) else []:
        try:
            raw = open(f"{task}/{tid}/stat").read()
        except OSError:
            continue
        comm = raw[raw.index("(") + 1:raw.rindex(")")]
        fields = raw[raw.rindex(")") + 2:].split()
        snap["threads"][tid] = [comm, int(fields[11]) + int(fields[12])]  # utime + stime
    with open(path, "w") as f:
        json.dump(snap, f)


def cpu(before_path, after_path, label):
    a, b = json.load(open(before_path)), json.load(open(after_path))
    ticks = [int(y) - int(x) for x, y in zip(a["stat"], b["stat"])]
    total = sum(ticks[:8])
    idle = ticks[3] + ticks[4]
    hz, cores = b.get("hz", os.sysconf("SC_CLK_TCK")), b.get("cores", os.cpu_count())
    wall = total / hz / cores if total else 0.0
    by_name = collections.Counter()
    threads = collections.Counter()
    for tid, (comm, t) in b["threads"].items():
        used = t - a["threads"].get(tid, [comm, 0])[1]
        by_name[comm] += used
        threads[comm] += 1 if used > 0 else 0
    busy = (total - idle) / hz / wall if wall else 0.0
    server = sum(by_name.values()) / hz / wall if wall else 0.0
    top = ", ".join(f"{name} x{threads[name]} {t / hz / wall:.2f}" for name, t in by_name.most_common(6)
                    if wall)
    print(f"cpu {label}: machine {busy:.1f} of {cores} cores busy; server {server:.2f} cores; "
          f"its threads by name (cores): {top}")


def rows(path, labels):
    seen = {}
    for line in open(path):
        r = json.loads(line)
        seen[r.get("label")] = r
    bad = 0
    for label in labels:
        r = seen.get(label)
        if r is None:
            print(f"FAIL row {label}: no result")
            bad += 1
        elif r.get("ok", 0) <= 0 or r.get("errors"):
            print(f"FAIL row {label}: {r.get('ok', 0)} requests answered, errors {r.get('errors')}")
            bad += 1
        else:
            print(f"row {label}: {r['ok']} requests answered, {r['requests_per_s']:.1f} req/s")
    return 1 if bad else 0


def main(argv):
    if len(argv) >= 3 and argv[0] == "dmon":
        dmon(argv[1], argv[2])
    elif len(argv) >= 4 and argv[0] == "stages":
        stages(argv[1], argv[2], argv[3])
    elif len(argv) >= 2 and argv[0] == "profile":
        profile(argv[1])
    elif len(argv) >= 3 and argv[0] == "cpu_snapshot":
        cpu_snapshot(argv[1], argv[2])
    elif len(argv) >= 4 and argv[0] == "cpu":
        cpu(argv[1], argv[2], argv[3])
    elif len(argv) >= 3 and argv[0] == "rows":
        return rows(argv[1], argv[2:])
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
