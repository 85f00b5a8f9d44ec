#!/usr/bin/python3
"""deploy/k8s: structure of every manifest, and the Deployment run for real with `podman kube play`.

Structural checks (no cluster runs here): probes on grpc.health.v1, non-root, read-only root
filesystem, requests/limits, a read-only models volume; the PodDisruptionBudget, the headless and the
ClusterIP Services select the Deployment's pods; the HPA scales it on the metric the
prometheus-adapter rule defines, from a series attnserve exports; the ServiceMonitor scrapes the
metrics port; the GPU patch asks for nvidia.com/gpu.

Run: the Deployment's pod, with the image built by docker/Dockerfile (tag from the first argument),
host networking on loopback ports and a model directory made here as the models volume; it must
become SERVING, answer an attend on that model (and an Open Inference Protocol ModelInfer), run as
uid 10001 and refuse writes to its root
filesystem.

usage: k8s_test.py IMAGE PATH/TO/attnserve-cli PATH/TO/attnserve (for its --help flag list)
"""
import copy
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

import torch
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests", "lib"))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import attnserve_py as lib  # noqa: E402
import export_model  # noqa: E402

K8S = os.path.join(ROOT, "deploy", "k8s")


def load(name):
    with open(os.path.join(K8S, name)) as f:
        return {d["kind"] + "/" + d["metadata"]["name"]: d for d in yaml.safe_load_all(f) if d}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def structure(checks, attnserve_help):
    dep = load("deployment.yaml")["Deployment/attnserve"]
    services = load("services.yaml")
    mon = load("monitoring.yaml")
    pod = dep["spec"]["template"]["spec"]
    c = pod["containers"][0]
    labels = dep["spec"]["template"]["metadata"]["labels"]
    checks("Deployment selector matches its pods", dep["spec"]["selector"]["matchLabels"].items() <= labels.items())
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        checks(f"{probe} is a gRPC health probe on the gRPC port", c.get(probe, {}).get("grpc", {}).get("port") == 50051)
    checks("readiness asks for the service's own status",
           c["readinessProbe"]["grpc"].get("service") == "attnserve.v1.AttentionService")
    sc, csc = pod["securityContext"], c["securityContext"]
    checks("non-root (uid 10001, runAsNonRoot)", sc.get("runAsNonRoot") is True and sc.get("runAsUser") == 10001)
    checks("read-only root filesystem, no privilege escalation, no capabilities",
           csc.get("readOnlyRootFilesystem") is True and csc.get("allowPrivilegeEscalation") is False
           and csc.get("capabilities", {}).get("drop") == ["ALL"])
    res = c["resources"]
    checks("cpu and memory requests and limits", all(k in res.get(t, {}) for t in ("requests", "limits")
                                                      for k in ("cpu", "memory")))
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    checks("models volume mounted read-only at /models, passed as --models",
           mounts.get("models", {}).get("readOnly") is True and mounts["models"]["mountPath"] == "/models"
           and "--models" in c["args"] and c["args"][c["args"].index("--models") + 1] == "/models")
    flags = set(re.findall(r"--[a-z][a-z-]+", attnserve_help))
    used = {a for a in c["args"] if a.startswith("--")}
    checks("every flag in the Deployment exists in attnserve --help", used <= flags, used - flags)
    env = {e["name"]: e for e in c.get("env", [])}
    checks("pods advertise their own IP (--advertise-address $(POD_IP):50051, POD_IP from status.podIP)",
           "--advertise-address" in c["args"]
           and c["args"][c["args"].index("--advertise-address") + 1] == "$(POD_IP):50051"
           and env.get("POD_IP", {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "status.podIP")
    grace = float(c["args"][c["args"].index("--shutdown-grace") + 1])
    checks("terminationGracePeriodSeconds covers --shutdown-grace", pod["terminationGracePeriodSeconds"] > grace)
    headless, cluster = services["Service/attnserve-headless"], services["Service/attnserve"]
    pdb = services["PodDisruptionBudget/attnserve"]
    checks("headless Service (clusterIP None) selects the pods",
           headless["spec"]["clusterIP"] == "None" and headless["spec"]["selector"].items() <= labels.items())
    checks("ClusterIP Service selects the pods and exposes grpc and metrics",
           cluster["spec"].get("type") == "ClusterIP" and cluster["spec"]["selector"].items() <= labels.items()
           and {p["name"] for p in cluster["spec"]["ports"]} == {"grpc", "metrics"})
    checks("PodDisruptionBudget keeps 2 of 3", pdb["spec"]["minAvailable"] == 2
           and pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
           and dep["spec"]["replicas"] > pdb["spec"]["minAvailable"])
    hpa = mon["HorizontalPodAutoscaler/attnserve"]
    rules = yaml.safe_load(mon["ConfigMap/attnserve-prometheus-adapter-rules"]["data"]["rules.yaml"])["rules"]
    metric = hpa["spec"]["metrics"][0]["pods"]["metric"]["name"]
    checks("HPA targets the Deployment", hpa["spec"]["scaleTargetRef"]["name"] == dep["metadata"]["name"])
    checks("HPA's metric is what the adapter rule names", any(r["name"]["as"] == metric for r in rules), metric)
    series = re.findall(r"attnserve_[a-z_]+", " ".join(r["seriesQuery"] + r["metricsQuery"] for r in rules))
    checks("the adapter rule reads queue-wait series", series and all(s.startswith("attnserve_queue_wait_seconds")
                                                                     for s in series), series)
    sm = mon["ServiceMonitor/attnserve"]
    checks("ServiceMonitor scrapes the metrics port of the Service's pods",
           sm["spec"]["endpoints"][0]["port"] == "metrics"
           and sm["spec"]["selector"]["matchLabels"].items() <= cluster["metadata"]["labels"].items())
    gpu = yaml.safe_load(open(os.path.join(K8S, "gpu-patch.yaml")))
    gc = gpu["spec"]["template"]["spec"]["containers"][0]
    checks("GPU patch: nvidia.com/gpu limit, --device cuda",
           gc["resources"]["limits"].get("nvidia.com/gpu") == 1 and "--device" in gc["args"]
           and gc["args"][gc["args"].index("--device") + 1] == "cuda")
    return dep


def run_pod(checks, dep, image, cli, engine):
    tmp = lib.temp_dir("attnserve-k8s-")
    os.chmod(tmp, 0o755)
    torch.manual_seed(11)
    export_model.export(torch.nn.MultiheadAttention(64, 4, batch_first=True), os.path.join(tmp, "models", "m64"))
    for dirpath, dirnames, filenames in os.walk(tmp):
        for n in dirnames + filenames:
            os.chmod(os.path.join(dirpath, n), 0o755 if n in dirnames else 0o644)
    port, metrics, http = free_port(), free_port(), free_port()
    d = copy.deepcopy(dep)
    d["spec"]["replicas"] = 1
    pod = d["spec"]["template"]["spec"]
    pod["hostNetwork"] = True  # This machine's podman has no port publishing; loopback addresses below.
    c = pod["containers"][0]
    c["image"] = image
    c.pop("ports")  # podman maps declared ports, which host networking cannot have.
    args = c["args"]
    args[args.index("--address") + 1] = f"127.0.0.1:{port}"
    args[args.index("--metrics-address") + 1] = f"127.0.0.1:{metrics}"
    args[args.index("--http-address") + 1] = f"127.0.0.1:{http}"
    # Host networking: the pod's IP is this machine's loopback (podman has no status.podIP to give).
    args[args.index("--advertise-address") + 1] = f"127.0.0.1:{port}"
    c["env"] = [e for e in c["env"] if e["name"] != "POD_IP"]
    for p in ("startupProbe", "readinessProbe", "livenessProbe"):
        c[p]["grpc"]["port"] = port
    pod["volumes"][0] = {"name": "models", "hostPath": {"path": os.path.join(tmp, "models"), "type": "Directory"}}
    manifest = os.path.join(tmp, "deployment.yaml")
    with open(manifest, "w") as f:
        yaml.safe_dump(d, f)
    play = subprocess.run([engine, "kube", "play", manifest], capture_output=True, text=True)
    checks("podman kube play starts the Deployment", play.returncode == 0, play.stderr[-800:])
    try:
        target = f"127.0.0.1:{port}"
        serving = lib.wait_until(lambda: subprocess.run([cli, "--target", target, "--deadline-ms", "1000", "health"],
                                                        capture_output=True, text=True).stdout.strip() == "SERVING",
                                 timeout=120, step=0.5)
        checks("the pod becomes SERVING", serving)
        out = subprocess.run([cli, "--target", target, "attend", "--model", "m64", "--batch", "2", "--query-len", "5"],
                             capture_output=True, text=True)
        checks("it answers an attend on the mounted model", "output [2, 5, 64]" in out.stdout, out.stdout + out.stderr)
        out = subprocess.run([cli, "--target", target, "decode", "--model", "m64", "--steps", "3"],
                             capture_output=True, text=True)
        checks("a session there names the address the pod advertises, and decodes",
               f"replica {target}" in out.stdout and out.stdout.count("step ") == 4, out.stdout + out.stderr)
        # The Open Inference Protocol on the same port, through the Deployment unchanged.
        import grpc
        import numpy as np
        opb, orpc = lib.load_stubs("inference/grpc_service.proto")
        q = np.ones((2, 5, 64), np.float32)
        req = opb.ModelInferRequest(model_name="m64", inputs=[opb.ModelInferRequest.InferInputTensor(
            name="query", datatype="FP32", shape=[2, 5, 64])], raw_input_contents=[q.tobytes()])
        with grpc.insecure_channel(target) as channel:
            try:
                resp = orpc.GRPCInferenceServiceStub(channel).ModelInfer(req, timeout=30)
                got = (list(resp.outputs[0].shape), len(resp.raw_output_contents[0]))
            except grpc.RpcError as e:
                got = str(e)
        checks("it answers an OIP ModelInfer on the mounted model", got == ([2, 5, 64], 2 * 5 * 64 * 4), got)
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=5).read().decode()
        except OSError as e:
            text = str(e)
        checks("it exports the series the autoscaling rule reads", "attnserve_queue_wait_seconds_sum{" in text,
               text[:300])
        ps = subprocess.run([engine, "ps", "--format", "{{.Names}}"], capture_output=True, text=True).stdout.split()
        name = next((n for n in ps if n.startswith("attnserve-") and n.endswith("-attnserve")), None)
        checks("its container is running", name is not None, ps)
        if name:
            uid = subprocess.run([engine, "exec", name, "id", "-u"], capture_output=True, text=True).stdout.strip()
            checks("runs as uid 10001", uid == "10001", uid)
            touch = subprocess.run([engine, "exec", name, "touch", "/written"], capture_output=True, text=True)
            checks("root filesystem is read-only", touch.returncode != 0 and "Read-only" in touch.stderr, touch.stderr)
            tmpw = subprocess.run([engine, "exec", name, "touch", "/tmp/ok"], capture_output=True, text=True)
            checks("/tmp is writable (emptyDir)", tmpw.returncode == 0, tmpw.stderr)
    finally:
        subprocess.run([engine, "kube", "down", manifest], capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)


def main():
    image, cli, binary = sys.argv[1], sys.argv[2], sys.argv[3]
    checks = lib.Checks()
    attnserve_help = subprocess.run([binary, "--help"], capture_output=True, text=True).stdout
    dep = structure(checks, attnserve_help)
    run_pod(checks, dep, image, cli, os.environ.get("ATTNSERVE_CONTAINER_ENGINE", "podman"))
    return checks.summary("k8s_test")


if __name__ == "__main__":
    sys.exit(main())
