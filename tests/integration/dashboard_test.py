#!/usr/bin/python3
"""deploy/grafana/attnserve-dashboard.json and deploy/prometheus/rules.yml against a real Prometheus
scraping a real attnserve under load: every panel's query (Grafana's $job and $__rate_interval
filled in as Grafana would) returns data, and Prometheus loads every rule group healthy. The server
traces every call to a collector that is down, so the spans panel shows drops.

The load (bounded: a fixed number of waves) makes every panel's series exist: good requests from
concurrent callers, a few bad ones (errors panel), more callers than a small queue holds
(rejections panel).

usage: python3 -m pytest dashboard_test.py --attnserve PATH/TO/attnserve
"""
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import grpc
import numpy as np

import pytest  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
import attnserve_py as lib  # noqa: E402

ROOT = lib.ROOT


def test_every_dashboard_panel_returns_data_from_a_real_prometheus(attnserve, checks):
    binary = attnserve
    pb, rpc = lib.load_stubs()
    dashboard = json.load(open(os.path.join(ROOT, "deploy", "grafana", "attnserve-dashboard.json")))
    tmp = lib.temp_dir("attnserve-dashboard-")
    # Tracing every call to a collector that is down (a port nobody listens on): the spans panel's
    # export_failed drops.
    dead_collector = lib.free_port()
    server = lib.Server(binary, "--workers", "1", "--max-queue-size", "4", "--metrics-address", "127.0.0.1:0",
                        "--trace-endpoint", f"127.0.0.1:{dead_collector}", "--trace-rate", "1")
    prom = None
    try:
        prom_port = lib.free_port()
        shutil.copy(os.path.join(ROOT, "deploy", "prometheus", "rules.yml"), tmp)
        config = open(os.path.join(ROOT, "deploy", "prometheus", "prometheus.yml")).read()
        config = config.replace("scrape_interval: 15s", "scrape_interval: 1s").replace(
            "evaluation_interval: 15s", "evaluation_interval: 1s")
        os.makedirs(os.path.join(tmp, "targets"))
        json.dump([{"targets": [f"127.0.0.1:{server.metrics_port}"]}], open(os.path.join(tmp, "targets", "a.json"), "w"))
        open(os.path.join(tmp, "prometheus.yml"), "w").write(config)
        prom = subprocess.Popen(["prometheus", f"--config.file={tmp}/prometheus.yml", f"--storage.tsdb.path={tmp}/data",
                                 f"--web.listen-address=127.0.0.1:{prom_port}"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        def api(path, **params):
            url = f"http://127.0.0.1:{prom_port}/api/v1/{path}" + ("?" + urllib.parse.urlencode(params) if params else "")
            return json.load(urllib.request.urlopen(url, timeout=5))["data"]

        def up():
            try:
                return any(t["health"] == "up" for t in api("targets")["activeTargets"])
            except OSError:
                return False

        checks("Prometheus scrapes attnserve through file-based targets", lib.wait_until(up, timeout=60, step=0.5))

        stub = rpc.AttentionServiceStub(grpc.insecure_channel(server.target))
        rng = np.random.default_rng(9)
        good = [pb.AttendRequest(model="demo", query=lib.to_wire(pb, rng.standard_normal((1, int(n), 512)).astype(np.float32)))
                for n in rng.integers(4, 64, 32)]
        bad = pb.AttendRequest(model="demo", query=lib.to_wire(pb, np.zeros((1, 4, 3), np.float32)))
        codes = {}
        for wave in range(40):  # ~8 s: several scrapes and rule evaluations under load
            futures = [stub.Attend.future(good[(wave + i) % len(good)], timeout=10) for i in range(12)]
            futures.append(stub.Attend.future(bad, timeout=10))
            for f in futures:
                try:
                    f.result()
                    codes["OK"] = codes.get("OK", 0) + 1
                except grpc.RpcError as e:
                    codes[e.code().name] = codes.get(e.code().name, 0) + 1
            time.sleep(0.2)
        print(f"load: {codes}")
        checks("the load had answers, bad requests and queue-full refusals",
               codes.get("OK", 0) > 0 and codes.get("INVALID_ARGUMENT", 0) > 0 and codes.get("RESOURCE_EXHAUSTED", 0) > 0,
               codes)
        # Kept keys and values (the kv panels): a session step, a memory query, a miss, then both freed.
        session = stub.OpenSession(pb.OpenSessionRequest(model="demo", batch=1), timeout=10)
        step = rng.standard_normal((1, 3, 512)).astype(np.float32)
        stub.Attend(pb.AttendRequest(session=session.handle, query=lib.to_wire(pb, step)), timeout=10)
        memory = stub.CreateMemory(pb.CreateMemoryRequest(model="demo", key=lib.to_wire(pb, step),
                                                          value=lib.to_wire(pb, step)), timeout=10)
        stub.Attend(pb.AttendRequest(memory=memory.handle, query=lib.to_wire(pb, step)), timeout=10)
        try:
            stub.Attend(pb.AttendRequest(memory="0" * 32, query=lib.to_wire(pb, step)), timeout=10)
        except grpc.RpcError as e:
            codes["kv " + e.code().name] = 1
        time.sleep(2)  # a scrape while both are held
        stub.CloseSession(pb.ReleaseRequest(handle=session.handle), timeout=10)
        stub.DeleteMemory(pb.ReleaseRequest(handle=memory.handle), timeout=10)
        checks("kv load: an unknown memory handle is NOT_FOUND", codes.get("kv NOT_FOUND") == 1, codes)
        time.sleep(3)  # a last scrape after the load

        for panel in dashboard["panels"]:
            for target in panel["targets"]:
                expr = target["expr"].replace("$__rate_interval", "1m").replace("$job", "attnserve")
                try:
                    result = api("query", query=expr)["result"]
                except OSError as e:
                    result = [f"error: {e}"]
                finite = [r for r in result if isinstance(r, dict) and np.isfinite(float(r["value"][1]))]
                checks(f"panel '{panel['title']}' has data", bool(finite), f"{expr} -> {result}")
        dropped = api("query", query='sum by (reason) (attnserve_trace_spans_dropped_total{job="attnserve"})')["result"]
        failed = {r["metric"].get("reason"): float(r["value"][1]) for r in dropped}
        checks("the spans panel's source counts the spans a down collector cost, as export_failed",
               failed.get("export_failed", 0) > 0 and failed.get("queue_full", -1) == 0, failed)
        groups = api("rules")["groups"]
        bad_rules = [r["name"] for g in groups for r in g["rules"] if r.get("health") != "ok"]
        checks("Prometheus loaded deploy/prometheus/rules.yml, every rule healthy",
               len(groups) == 3 and not bad_rules, bad_rules or [g["name"] for g in groups])
    finally:
        if prom:
            prom.terminate()
            prom.wait(timeout=30)
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
