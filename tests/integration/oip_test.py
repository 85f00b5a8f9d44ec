"""The Open Inference Protocol with the client people already have: unmodified tritonclient[grpc]
2.73 from PyPI (tools/oip-env.sh) against a real attnserve.

Checks: live/ready (server, model, an absent model), server and model metadata, infer() across a
matrix (FP32, FP16, BF16 through ml_dtypes; BOOL and float masks; weights averaged and per head;
both layouts; cross-attention with kdim/vdim; is_causal) against torch.nn.MultiheadAttention (fixed
seeds; max|out-ref|/max|ref| <= 1e-5 in FP32, 2e-3 in FP16, 2e-2 in BF16 against a float64
reference), every answer byte for byte equal to the native attnserve.v1 Attend answer for the same
request, refusals with the same code and message as the native API, a decoding session stepped
through parameters["session"] and a Triton sequence (sequence_id/start/end) as a session, and the
calls counted in /metrics under method="ModelInfer"; ModelStreamInfer through tritonclient's
streaming API (stream_checks).

usage: python3 -m pytest oip_test.py --attnserve PATH/TO/attnserve       (run with tools/oip-env.sh's python)
"""
import os
import sys

import grpc
import ml_dtypes
import numpy as np
import torch
import tritonclient.grpc as tc
from tritonclient.utils import InferenceServerException

HERE = os.path.dirname(os.path.abspath(__file__))
import pytest  # noqa: E402

sys.path.insert(0, os.path.join(HERE, "..", "lib"))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tools"))
import attnserve_py as lib  # noqa: E402
import export_model  # noqa: E402

E, H = 64, 4
MODELS = {
    "mha": dict(E=E, H=H),
    "xattn": dict(E=E, H=H, kdim=32, vdim=48),
}


def build(name, seed):
    c = MODELS[name]
    torch.manual_seed(seed)
    m = torch.nn.MultiheadAttention(c["E"], c["H"], kdim=c.get("kdim"), vdim=c.get("vdim"), batch_first=True)
    with torch.no_grad():
        for pname, p in m.named_parameters():
            if "bias" in pname:
                p.uniform_(-0.5, 0.5)
    return m.train()  # dropout 0: the same as eval(), off 1.13's fast path


# name, model, batch, Lq, Lk (None: self), dtype, layout, weights, kpm, mask, causal
CASES = [
    ("fp32 self", "mha", 2, 7, None, "FP32", "batch_first", "none", False, None, False),
    ("fp32 kpm + bool mask, averaged", "mha", 2, 5, None, "FP32", "batch_first", "averaged", True, "bool", False),
    ("fp32 float mask, per head, sequence-first", "mha", 3, 4, None, "FP32", "sequence_first", "per_head", False,
     "float", False),
    ("fp32 causal", "mha", 1, 9, None, "FP32", "batch_first", "none", False, None, True),
    ("fp16 self", "mha", 2, 6, None, "FP16", "batch_first", "none", False, None, False),
    ("bf16 self", "mha", 1, 6, None, "BF16", "batch_first", "none", False, None, False),
    ("fp32 cross kdim/vdim, kpm, averaged", "xattn", 2, 3, 8, "FP32", "batch_first", "averaged", True, None, False),
    ("fp32 cross, sequence-first", "xattn", 2, 5, 6, "FP32", "sequence_first", "none", False, None, False),
]
NP = {"FP32": np.float32, "FP16": np.float16, "BF16": ml_dtypes.bfloat16}
TOL = {"FP32": 1e-5, "FP16": 2e-3, "BF16": 2e-2}


def stream_checks(checks, server, client, native, pb, m64, rng):
    """ModelStreamInfer through tritonclient's streaming API: plain requests, a refused one in the
    middle (the stream goes on), and a sequence's steps sent back to back without waiting (run in
    order, each the same bytes as a native twin session's step); then the error answer's fields
    through the raw stub, and the calls counted under method="ModelStreamInfer"."""
    import queue
    import tritonclient.grpc.service_pb2 as spb
    import tritonclient.grpc.service_pb2_grpc as sgrpc

    answers = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    plain = {}
    for i in range(6):
        x = rng.standard_normal((1 + i % 2, 3 + 5 * i, E)).astype(np.float32)
        t = tc.InferInput("query", list(x.shape), "FP32")
        t.set_data_from_numpy(x)
        plain[f"p{i}"] = x
        client.async_stream_infer("mha", [t], request_id=f"p{i}")
        if i == 2:  # A refused request in the middle.
            t = tc.InferInput("queries", list(x.shape), "FP32")
            t.set_data_from_numpy(x)
            client.async_stream_infer("mha", [t], request_id="bad")
    twin = native.OpenSession(pb.OpenSessionRequest(model="mha", batch=1))
    steps = [rng.standard_normal((1, 1 + s, E)).astype(np.float32) for s in range(5)]
    for s, x in enumerate(steps):
        t = tc.InferInput("query", list(x.shape), "FP32")
        t.set_data_from_numpy(x)
        client.async_stream_infer("mha", [t], request_id=f"s{s}", sequence_id="stream-seq", sequence_start=s == 0,
                                  sequence_end=s == len(steps) - 1)
    got, errors = {}, []
    for _ in range(len(plain) + 1 + len(steps)):
        result, error = answers.get(timeout=60)
        if error is not None:
            errors.append(str(error))
        else:
            got[result.get_response().id] = result
    client.stop_stream()
    checks("stream: every request answered, the refused one as an error naming the input",
           len(got) == len(plain) + len(steps) and len(errors) == 1 and "'queries'" in errors[0],
           f"{sorted(got)} {errors}")
    worst = 0.0
    for rid, x in plain.items():
        if rid in got:
            with torch.no_grad():
                xx = torch.from_numpy(x.astype(np.float64))
                ref = m64(xx, xx, xx, need_weights=False)[0].numpy()
            worst = max(worst, np.abs(got[rid].as_numpy("attn_output") - ref).max() / np.abs(ref).max())
    checks("stream: plain answers match nn.MultiheadAttention (1e-5)", worst <= 1e-5, f"error {worst:.2e}")
    same, details = True, []
    for s, x in enumerate(steps):
        n = native.Attend(pb.AttendRequest(session=twin.handle, query=pb.Tensor(dtype=1, shape=x.shape,
                                                                                 data=x.tobytes())))
        r = got.get(f"s{s}")
        ok, detail = lib.same_answer(r.get_response().raw_output_contents[0], n.output.data) if r else (False, "none")
        same, details = same and ok, details + [f"step {s}: {detail}"]
    # Out of order, a step would attend over other keys: far beyond float32 rounding.
    checks("stream: a sequence's steps sent back to back run in order (a native session's answers)",
           same, "; ".join(details))

    # The raw stub: an error answer names its request and carries the code.
    channel = grpc.insecure_channel(server.target)
    stub = sgrpc.GRPCInferenceServiceStub(channel)
    x = rng.standard_normal((1, 2, E)).astype(np.float32)
    good = spb.ModelInferRequest(model_name="mha", id="ok", inputs=[spb.ModelInferRequest.InferInputTensor(
        name="query", datatype="FP32", shape=[1, 2, E])], raw_input_contents=[x.tobytes()])
    bad = spb.ModelInferRequest(model_name="nope", id="missing", inputs=[spb.ModelInferRequest.InferInputTensor(
        name="query", datatype="FP32", shape=[1, 2, E])], raw_input_contents=[x.tobytes()])
    out = list(stub.ModelStreamInfer(iter([bad, good]), timeout=30))
    by_id = {r.infer_response.id: r for r in out}
    e = by_id.get("missing")
    checks("stream (raw): a NOT_FOUND answer names its id and carries error_code",
           len(out) == 2 and e is not None and "nope" in e.error_message and
           e.infer_response.parameters["error_code"].string_param == "NOT_FOUND" and
           by_id.get("ok") is not None and by_id["ok"].error_message == "", str(out)[:300])
    raw_stream = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer",
                                       request_serializer=lambda b: b,
                                       response_deserializer=spb.ModelStreamInferResponse.FromString)
    before, code, detail = [], None, ""
    try:
        for r in raw_stream(iter([good.SerializeToString(), b"\xff\xff\xff"]), timeout=30):
            before.append(r)
    except grpc.RpcError as r:
        code, detail = r.code(), r.details()
    channel.close()
    checks("stream (raw): an undecodable message ends the stream with INVALID_ARGUMENT, after the answer before it",
           code == grpc.StatusCode.INVALID_ARGUMENT and "message 2" in detail and len(before) == 1 and
           before[0].infer_response.id == "ok", f"{code} {detail} {len(before)}")
    lines = lib.metrics_lines(server, "attnserve_request_duration_seconds_count")
    counted = sum(float(l.split()[-1]) for l in lines if 'method="ModelStreamInfer"' in l)
    checks("/metrics counts ModelStreamInfer", counted >= len(plain) + len(steps) + 3, str(counted))


def test_tritonclient_over_the_open_inference_protocol(attnserve, checks):
    binary = attnserve
    pb, rpc = lib.load_stubs()
    tmp = lib.temp_dir("attnserve-oip-")
    modules = {name: build(name, 2000 + i) for i, name in enumerate(MODELS)}
    for name, m in modules.items():
        export_model.export(m, os.path.join(tmp, name))
    server = lib.Server(binary, "--models", tmp)
    client = tc.InferenceServerClient(server.target)
    channel = grpc.insecure_channel(server.target)
    native = rpc.AttentionServiceStub(channel)
    rng = np.random.default_rng(20261124)

    checks("server live", client.is_server_live())
    checks("server ready", client.is_server_ready())
    checks("model ready", client.is_model_ready("mha") and client.is_model_ready("xattn", "1"))
    checks("an absent model is not ready", not client.is_model_ready("nope"))
    meta = client.get_server_metadata()
    checks("server metadata names attnserve", meta.name == "attnserve" and meta.version != "", str(meta))
    mm = client.get_model_metadata("xattn")
    inputs = {t.name: (t.datatype, list(t.shape)) for t in mm.inputs}
    outputs = {t.name: (t.datatype, list(t.shape)) for t in mm.outputs}
    checks("model metadata: inputs with shapes",
           inputs.get("query") == ("FP32", [-1, -1, E]) and inputs.get("key") == ("FP32", [-1, -1, 32]) and
           inputs.get("value") == ("FP32", [-1, -1, 48]) and inputs.get("key_padding_mask", ("",))[0] == "BOOL",
           str(inputs))
    checks("model metadata: outputs", set(outputs) == {"attn_output", "attn_weights"} and mm.versions == ["1"],
           str(outputs))

    for (name, model, b, lq, lk, dtype, layout, weights, kpm, mask, causal) in CASES:
        c = MODELS[model]
        sf = layout == "sequence_first"
        shape = lambda length, dim: (length, b, dim) if sf else (b, length, dim)
        q = rng.standard_normal(shape(lq, E)).astype(NP[dtype])
        cross = lk is not None
        lk = lk or lq
        k = rng.standard_normal(shape(lk, c.get("kdim", E))).astype(NP[dtype]) if cross else None
        v = rng.standard_normal(shape(lk, c.get("vdim", E))).astype(NP[dtype]) if cross else None
        kpm_a = (np.arange(lk)[None, :] >= rng.integers(1, lk + 1, size=b)[:, None]) if kpm else None
        mask_a = None
        if mask == "bool":
            mask_a = rng.random((lq, lk)) < 0.4
            mask_a[:, 0] = False
        elif mask == "float":
            mask_a = rng.standard_normal((b * H, lq, lk)).astype(np.float32)

        tensors = [("query", q), ("key", k), ("value", v), ("key_padding_mask", kpm_a), ("attn_mask", mask_a)]
        infer_inputs = []
        for tname, a in tensors:
            if a is None:
                continue
            dt = "BOOL" if a.dtype == np.bool_ else ("FP32" if tname == "attn_mask" else dtype)
            t = tc.InferInput(tname, list(a.shape), dt)
            t.set_data_from_numpy(a)
            infer_inputs.append(t)
        params = {"layout": layout, "attn_weights": weights, "is_causal": causal}
        requested = [tc.InferRequestedOutput("attn_output")]
        if weights != "none":
            requested.append(tc.InferRequestedOutput("attn_weights"))
        try:
            result = client.infer(model, infer_inputs, outputs=requested, parameters=params, request_id=name)
        except InferenceServerException as e:
            checks(f"infer {name}", False, str(e))
            continue
        out = result.as_numpy("attn_output")
        checks(f"infer {name}: id, model, output datatype",
               result.get_response().id == name and result.get_response().model_name == model and
               result.get_output("attn_output").datatype == dtype, str(result.get_response().outputs))

        # The reference: the module on float64 copies of exactly the values sent.
        m = modules[model].double()
        f64 = lambda a: None if a is None else torch.from_numpy(np.asarray(a, dtype=np.float64))
        bf = lambda a: None if a is None else (a.transpose(1, 0, 2) if sf else a)
        am = None
        if mask_a is not None:
            am = torch.from_numpy(mask_a) if mask_a.dtype == np.bool_ else f64(mask_a)
        if causal:
            cm = torch.ones(lq, lk, dtype=torch.bool).triu(1)
            am = cm if am is None else am | cm
        qq = f64(bf(q))
        with torch.no_grad():
            ref, ref_w = m(qq, f64(bf(k)) if cross else qq, f64(bf(v)) if cross else qq,
                           key_padding_mask=None if kpm_a is None else torch.from_numpy(kpm_a), attn_mask=am,
                           need_weights=weights != "none", average_attn_weights=weights == "averaged")
        ref = ref.numpy()
        if sf:
            ref = ref.transpose(1, 0, 2)
        got = np.asarray(out, dtype=np.float64)
        err = np.abs(got - ref).max() / np.abs(ref).max()
        checks(f"infer {name}: matches nn.MultiheadAttention", err <= TOL[dtype], f"error {err:.2e}")
        if weights != "none":
            werr = np.abs(np.asarray(result.as_numpy("attn_weights"), dtype=np.float64) - ref_w.numpy()).max()
            checks(f"infer {name}: weights match", werr <= 10 * TOL[dtype], f"error {werr:.2e}")

        # The same request through attnserve.v1: the same bytes.
        wire = {"FP32": pb.DATA_TYPE_FLOAT32, "FP16": pb.DATA_TYPE_FLOAT16, "BF16": pb.DATA_TYPE_BFLOAT16}
        def tensor(a, dt):
            if a.dtype == np.bool_:
                return pb.Tensor(dtype=pb.DATA_TYPE_BOOL, shape=a.shape, data=a.astype(np.uint8).tobytes())
            return pb.Tensor(dtype=wire[dt], shape=a.shape, data=np.ascontiguousarray(a).tobytes())
        req = pb.AttendRequest(model=model, query=tensor(q, dtype), is_causal=causal,
                               layout=pb.LAYOUT_SEQUENCE_FIRST if sf else pb.LAYOUT_BATCH_FIRST,
                               attn_weights={"none": 0, "averaged": 1, "per_head": 2}[weights])
        if cross:
            req.key.CopyFrom(tensor(k, dtype))
            req.value.CopyFrom(tensor(v, dtype))
        if kpm_a is not None:
            req.key_padding_mask.CopyFrom(tensor(kpm_a, dtype))
        if mask_a is not None:
            req.attn_mask.CopyFrom(tensor(mask_a, "FP32"))
        answer = native.Attend(req)
        wire_dtype = {"FP32": "float32", "FP16": "float16", "BF16": "bfloat16"}[dtype]
        raw = result.get_response().raw_output_contents
        same, detail = lib.same_answer(raw[0], answer.output.data, wire_dtype)
        if weights != "none":
            same_w, detail_w = lib.same_answer(raw[1], answer.attn_weights.data, wire_dtype)
            same, detail = same and same_w, f"output: {detail}; weights: {detail_w}"
        checks(f"infer {name}: attnserve.v1 Attend's answer", same, detail)

    # Refusals: the native API's code and message.
    q = rng.standard_normal((1, 3, E)).astype(np.float32)
    def infer_error(model, tensors, params=None):
        ins = []
        for tname, a in tensors:
            t = tc.InferInput(tname, list(a.shape), "FP32")
            t.set_data_from_numpy(a)
            ins.append(t)
        try:
            client.infer(model, ins, parameters=params)
            return None
        except InferenceServerException as e:
            return e
    e = infer_error("nope", [("query", q)])
    try:
        native.Attend(pb.AttendRequest(model="nope", query=pb.Tensor(dtype=1, shape=q.shape, data=q.tobytes())))
        native_error = None
    except grpc.RpcError as r:
        native_error = r
    checks("an absent model: NOT_FOUND with the native message",
           e is not None and native_error is not None and e.status() == "StatusCode.NOT_FOUND" and
           native_error.details() in e.message(), f"{e} / {native_error}")
    e = infer_error("mha", [("queries", q)])
    checks("an unknown input: INVALID_ARGUMENT naming it and the allowed ones",
           e is not None and e.status() == "StatusCode.INVALID_ARGUMENT" and "'queries'" in e.message() and
           "allowed: query, key" in e.message(), str(e))
    e = infer_error("mha", [("query", q[:, :, :10])])
    checks("a bad shape: INVALID_ARGUMENT from the validator",
           e is not None and e.status() == "StatusCode.INVALID_ARGUMENT" and "query" in e.message(), str(e))
    e = infer_error("mha", [("query", q)], {"dropout": 0.1})
    checks("an unknown parameter: INVALID_ARGUMENT naming it",
           e is not None and e.status() == "StatusCode.INVALID_ARGUMENT" and "dropout" in e.message(), str(e))
    # A Triton sequence (sequence_id, start, end) is a session: three steps, each against a twin
    # session stepped natively; after the end the id is unknown.
    twin = native.OpenSession(pb.OpenSessionRequest(model="mha", batch=2))
    same = True
    for step in range(3):
        x = rng.standard_normal((2, 3, E)).astype(np.float32)
        t = tc.InferInput("query", [2, 3, E], "FP32")
        t.set_data_from_numpy(x)
        r = client.infer("mha", [t], sequence_id=42, sequence_start=step == 0, sequence_end=step == 2)
        n = native.Attend(pb.AttendRequest(session=twin.handle, query=pb.Tensor(dtype=1, shape=x.shape,
                                                                                 data=x.tobytes())))
        same = same and lib.same_answer(r.get_response().raw_output_contents[0], n.output.data)[0]
    checks("a Triton sequence steps a session: a native session's answers (float32 rounding), step by step",
           same)
    t = tc.InferInput("query", [2, 3, E], "FP32")
    t.set_data_from_numpy(x)
    try:
        client.infer("mha", [t], sequence_id=42)
        e = None
    except InferenceServerException as ex:
        e = ex
    checks("after sequence_end the id is not in progress: NOT_FOUND naming it",
           e is not None and e.status() == "StatusCode.NOT_FOUND" and "42" in e.message(), str(e))
    sessions = lib.metrics_lines(server, "attnserve_kv_entries")
    checks("the ended sequence's session is closed (only the native twin is left)",
           any('kind="session"' in l and float(l.split()[-1]) == 1 for l in sessions), str(sessions))

    # Under load: four OIP clients and two native ones at once, 12 requests each of random lengths
    # (batched together by the server); every OIP answer against its own reference.
    import threading
    m64 = modules["mha"].double()
    errors = []

    def oip_worker(seed):
        r = np.random.default_rng(seed)
        own = tc.InferenceServerClient(server.target)
        for _ in range(12):
            b, length = int(r.integers(1, 4)), int(r.integers(2, 40))
            x = r.standard_normal((b, length, E)).astype(np.float32)
            t = tc.InferInput("query", [b, length, E], "FP32")
            t.set_data_from_numpy(x)
            got = own.infer("mha", [t]).as_numpy("attn_output").astype(np.float64)
            with torch.no_grad():
                xx = torch.from_numpy(x.astype(np.float64))
                ref = m64(xx, xx, xx, need_weights=False)[0].numpy()
            err = np.abs(got - ref).max() / np.abs(ref).max()
            if not err <= 1e-5:
                errors.append(f"seed {seed}: B={b} L={length} error {err:.2e}")
        own.close()

    def native_worker(seed):
        r = np.random.default_rng(seed)
        for _ in range(12):
            x = r.standard_normal((2, int(r.integers(2, 60)), E)).astype(np.float32)
            native.Attend(pb.AttendRequest(model="mha", query=pb.Tensor(dtype=1, shape=x.shape, data=x.tobytes())))

    threads = [threading.Thread(target=oip_worker, args=(100 + i,)) for i in range(4)]
    threads += [threading.Thread(target=native_worker, args=(200 + i,)) for i in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    checks("under concurrent load every OIP answer matches its own reference (48 answers, 1e-5)", not errors,
           "; ".join(errors[:3]))

    # A decoding session opened natively and stepped through OIP, against a twin stepped natively.
    a = native.OpenSession(pb.OpenSessionRequest(model="mha", batch=1))
    b2 = native.OpenSession(pb.OpenSessionRequest(model="mha", batch=1))
    same = True
    for step in range(3):
        x = rng.standard_normal((1, 2, E)).astype(np.float32)
        t = tc.InferInput("query", [1, 2, E], "FP32")
        t.set_data_from_numpy(x)
        r = client.infer("", [t], parameters={"session": a.handle})
        n = native.Attend(pb.AttendRequest(session=b2.handle, query=pb.Tensor(dtype=1, shape=x.shape, data=x.tobytes())))
        same = (same and lib.same_answer(r.get_response().raw_output_contents[0], n.output.data)[0] and
                n.session_length == 2 * step + 2)
    checks("a session stepped through parameters['session'] answers as the native one", same)

    stream_checks(checks, server, client, native, pb, modules["mha"].double(), rng)

    lines = lib.metrics_lines(server, "attnserve_request_duration_seconds_count")
    counted = [l for l in lines if 'method="ModelInfer"' in l and 'code="OK"' in l]
    checks("/metrics counts ModelInfer under the same family",
           sum(float(l.split()[-1]) for l in counted) >= len(CASES) + 3, str(lines))
    client.close()
    channel.close()
    server.stop()


def test_tritonclient_priority_timeout_and_tenant_header(attnserve, checks):
    """tritonclient's priority= and timeout= arguments unmodified (docs/tenants.md): with 2 levels,
    priorities 0 to 2 answer exactly as priority 0 does and 3 is INVALID_ARGUMENT naming it; a
    timeout answers; with --tenant-header, tritonclient's headers= name the tenant in the metrics."""
    tmp = lib.temp_dir("attnserve-oip-priority-")
    export_model.export(build("mha", 9), os.path.join(tmp, "mha"))
    server = lib.Server(attnserve, "--models", tmp, "--priority-levels", "2", "--queue-policy",
                        "default:allow_timeout_override=true", "--tenant-header", "attnserve-tenant")
    client = tc.InferenceServerClient(server.target)
    q = np.random.default_rng(9).standard_normal((1, 5, MODELS["mha"]["E"])).astype(np.float32)
    t = tc.InferInput("query", list(q.shape), "FP32")
    t.set_data_from_numpy(q)
    first = client.infer("mha", [t]).as_numpy("output")
    for p in (1, 2):
        got = client.infer("mha", [t], priority=p, timeout=10_000_000,
                           headers={"attnserve-tenant": "team-a"}).as_numpy("output")
        checks(f"tritonclient priority={p} answers as priority 0 does", np.array_equal(got, first))
    try:
        client.infer("mha", [t], priority=3)
        outcome = "OK"
    except InferenceServerException as e:
        outcome = f"{e.status()} {e.message()}"
    checks("tritonclient priority=3 past 2 levels is INVALID_ARGUMENT naming it",
           "INVALID_ARGUMENT" in outcome and "priority: 3" in outcome, outcome)
    requests = [l for l in lib.metrics_lines(server, "attnserve_tenant_requests_total") if 'tenant="other"' in l]
    checks("headers= named the tenant (unnamed in a tenants file: counted as other)",
           any(l.endswith(" 2") for l in requests), str(requests))
    server.stop()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))


def test_tritonclient_system_shared_memory(attnserve, checks):
    """Triton's system shared-memory extension through unmodified tritonclient: regions made with
    tritonclient.utils.shared_memory and registered; inputs and outputs in regions give answers byte
    for byte equal to the in-message path (FP32 and BF16; query in a region with key and value in
    the message; the output in a region or in the message); status, unregister (one, then all);
    the refusals (a region not registered, an output region too small, a name twice, a region cut
    short underneath: an error and the server goes on), and a server without
    --allow-shared-memory refusing registration and not listing the extension."""
    import tritonclient.utils.shared_memory as shm

    tmp = lib.temp_dir("attnserve-oip-shm-")
    export_model.export(build("mha", 7), os.path.join(tmp, "mha"))
    server = lib.Server(attnserve, "--models", tmp, "--allow-shared-memory")
    client = tc.InferenceServerClient(server.target)
    rng = np.random.default_rng(11)
    tag = f"{os.getpid()}"
    handles = []

    def region(name, nbytes):
        h = shm.create_shared_memory_region(name, f"/attnserve-test-{tag}-{name}", nbytes)
        handles.append(h)
        return h

    checks("server metadata lists system_shared_memory",
           "system_shared_memory" in client.get_server_metadata().extensions)
    for dtype in ["FP32", "BF16"]:
        np_dt = NP[dtype]
        q = rng.standard_normal((2, 5, E)).astype(np_dt)
        k = rng.standard_normal((2, 7, E)).astype(np_dt)
        v = rng.standard_normal((2, 7, E)).astype(np_dt)
        # The in-message answer.
        ins = []
        for tname, a in [("query", q), ("key", k), ("value", v)]:
            t = tc.InferInput(tname, list(a.shape), dtype)
            t.set_data_from_numpy(a)
            ins.append(t)
        plain = client.infer("mha", ins).get_response().raw_output_contents[0]
        # Every input in one region (at offsets), the output in another.
        h_in = region(f"in-{dtype}", q.nbytes + k.nbytes + v.nbytes)
        shm.set_shared_memory_region(h_in, [q, k, v])
        out_bytes = q.nbytes
        h_out = region(f"out-{dtype}", out_bytes)
        client.register_system_shared_memory(f"in-{dtype}", f"/attnserve-test-{tag}-in-{dtype}",
                                             q.nbytes + k.nbytes + v.nbytes)
        client.register_system_shared_memory(f"out-{dtype}", f"/attnserve-test-{tag}-out-{dtype}", out_bytes)
        ins = []
        offset = 0
        for tname, a in [("query", q), ("key", k), ("value", v)]:
            t = tc.InferInput(tname, list(a.shape), dtype)
            t.set_shared_memory(f"in-{dtype}", a.nbytes, offset)
            offset += a.nbytes
            ins.append(t)
        out = tc.InferRequestedOutput("attn_output")
        out.set_shared_memory(f"out-{dtype}", out_bytes)
        result = client.infer("mha", ins, outputs=[out])
        got = shm.get_contents_as_numpy(h_out, np_dt, [2, 5, E]).tobytes()
        checks(f"{dtype}: inputs and output in regions answer the in-message bytes", got == plain,
               f"{len(got)} vs {len(plain)} bytes")
        checks(f"{dtype}: the output in a region has no bytes in the message",
               all(len(r) == 0 for r in result.get_response().raw_output_contents))
        # Query in a region, key and value in the message, the output in the message.
        t_q = tc.InferInput("query", list(q.shape), dtype)
        t_q.set_shared_memory(f"in-{dtype}", q.nbytes, 0)
        mixed = [t_q]
        for tname, a in [("key", k), ("value", v)]:
            t = tc.InferInput(tname, list(a.shape), dtype)
            t.set_data_from_numpy(a)
            mixed.append(t)
        r = client.infer("mha", mixed)
        checks(f"{dtype}: a query in a region beside key and value in the message",
               r.get_response().raw_output_contents[0] == plain)

    status = client.get_system_shared_memory_status()
    names = sorted(status.regions.keys())
    checks("status lists every region with its key and size",
           names == ["in-BF16", "in-FP32", "out-BF16", "out-FP32"] and
           status.regions["out-FP32"].key == f"/attnserve-test-{tag}-out-FP32" and
           status.regions["out-FP32"].byte_size == 2 * 5 * E * 4, str(status))

    def error(fn):
        try:
            fn()
            return None
        except InferenceServerException as e:
            return e

    q = rng.standard_normal((2, 5, E)).astype(np.float32)
    t_q = tc.InferInput("query", list(q.shape), "FP32")
    t_q.set_shared_memory("in-FP32", q.nbytes, 0)
    small = tc.InferRequestedOutput("attn_output")
    small.set_shared_memory("out-FP32", 100)
    e = error(lambda: client.infer("mha", [t_q], outputs=[small]))
    checks("an output region too small: INVALID_ARGUMENT naming the output",
           e is not None and e.status() == "StatusCode.INVALID_ARGUMENT" and "outputs[0]" in e.message() and
           "100 bytes" in e.message(), str(e))
    e = error(lambda: client.register_system_shared_memory("in-FP32", f"/attnserve-test-{tag}-out-FP32", 8))
    checks("a name registered twice: ALREADY_EXISTS, without the other key",
           e is not None and e.status() == "StatusCode.ALREADY_EXISTS" and "in-FP32" in e.message() and
           f"-in-FP32" not in e.message().replace("'in-FP32'", ""), str(e))
    e = error(lambda: client.register_system_shared_memory("etc", "/../../etc/passwd", 8))
    checks("a key that is a path: INVALID_ARGUMENT", e is not None and e.status() == "StatusCode.INVALID_ARGUMENT",
           str(e))
    # Cut short underneath: an error, and the server goes on.
    with open(f"/dev/shm/attnserve-test-{tag}-in-FP32", "r+b") as f:
        f.truncate(100)
    e = error(lambda: client.infer("mha", [t_q]))
    checks("a region cut short underneath: FAILED_PRECONDITION, never a crash",
           e is not None and e.status() == "StatusCode.FAILED_PRECONDITION" and "cut short" in e.message(), str(e))
    checks("the server serves on after it", client.is_server_live())

    client.unregister_system_shared_memory("out-FP32")
    t_plain = tc.InferInput("query", list(q.shape), "FP32")
    t_plain.set_data_from_numpy(q)
    e = error(lambda: client.infer("mha", [t_plain], outputs=[small]))
    checks("an unregistered region: NOT_FOUND naming it",
           e is not None and e.status() == "StatusCode.NOT_FOUND" and "out-FP32" in e.message(), str(e))
    client.unregister_system_shared_memory()
    checks("unregister with no name: every region gone",
           len(client.get_system_shared_memory_status().regions) == 0)
    for h in handles:
        shm.destroy_shared_memory_region(h)
    server.stop()

    plain = lib.Server(attnserve, "--models", tmp)
    c = tc.InferenceServerClient(plain.target)
    checks("without --allow-shared-memory the extension is not listed",
           "system_shared_memory" not in c.get_server_metadata().extensions)
    h = shm.create_shared_memory_region("off", f"/attnserve-test-{tag}-off", 64)
    e = error(lambda: c.register_system_shared_memory("off", f"/attnserve-test-{tag}-off", 64))
    checks("without --allow-shared-memory registration is refused naming the flag",
           e is not None and e.status() == "StatusCode.FAILED_PRECONDITION" and "--allow-shared-memory" in e.message(),
           str(e))
    shm.destroy_shared_memory_region(h)
    plain.stop()


def write_decoder(path, rng, hidden=32, heads=4, kv_heads=2, window=None):
    """A one-layer Llama-style checkpoint (random weights, no transformers) and an attnserve model
    directory serving its layer 0."""
    d = hidden // heads
    shapes = {"q_proj": (heads * d, hidden), "k_proj": (kv_heads * d, hidden), "v_proj": (kv_heads * d, hidden),
              "o_proj": (hidden, heads * d)}
    state = {f"{n}.weight": torch.from_numpy((rng.standard_normal(s) / np.sqrt(s[1])).astype(np.float32))
             for n, s in shapes.items()}
    config = {"model_type": "mistral" if window else "llama", "hidden_size": hidden, "num_attention_heads": heads,
              "num_key_value_heads": kv_heads, "num_hidden_layers": 1, "rope_theta": 10000.0}
    if window:
        config["sliding_window"] = window
    name = "dec_window" if window else "dec"
    export_model.export_decoder_weights(config, {0: state}, os.path.join(path, "checkpoints", name),
                                        {0: os.path.join(path, "models", name)})


def test_tritonclient_decoder_layer_positions(attnserve, checks):
    """A decoder layer (grouped heads, RoPE) over OIP: its metadata names the positions input;
    parameters query_position / key_position and the INT64 positions input (raw from tritonclient,
    typed int64_contents from the protocol's own stub) answer byte for byte what attnserve.v1 answers
    with the same fields; wrong kinds and shapes are refused naming the field."""
    from tritonclient.grpc import service_pb2, service_pb2_grpc
    pb, rpc = lib.load_stubs()
    rng = np.random.default_rng(49)
    tmp = lib.temp_dir("attnserve-oip-decoder-")
    write_decoder(tmp, rng)
    write_decoder(tmp, rng, window=4)
    server = lib.Server(attnserve, "--models", os.path.join(tmp, "models"))
    client = tc.InferenceServerClient(server.target)
    channel = grpc.insecure_channel(server.target)
    native = rpc.AttentionServiceStub(channel)
    oip = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    try:
        mm = client.get_model_metadata("dec")
        inputs = {t.name: (t.datatype, list(t.shape)) for t in mm.inputs}
        checks("metadata: a decoder's platform and its INT64 positions input",
               mm.platform == "attnserve_decoder_attention" and inputs.get("positions") == ("INT64", [-1, -1])
               and "key" in inputs, str(mm))
        mw = client.get_model_metadata("dec_window")
        names = {t.name for t in mw.inputs}
        checks("metadata: a windowed decoder takes no key or value", "key" not in names and "positions" in names,
               str(names))

        b, t, lk = 2, 5, 6
        q = rng.standard_normal((b, t, 32)).astype(np.float32)
        k = rng.standard_normal((b, lk, 32)).astype(np.float32)
        pos = rng.integers(0, 5000, size=(b, t)).astype(np.int64)

        def wire(a):
            return pb.Tensor(dtype=pb.DATA_TYPE_FLOAT32, shape=a.shape, data=a.tobytes())

        def infer(inputs, params):
            tin = []
            for name, a in inputs:
                x = tc.InferInput(name, list(a.shape), "INT64" if a.dtype == np.int64 else "FP32")
                x.set_data_from_numpy(a)
                tin.append(x)
            return client.infer("dec", tin, parameters=params).as_numpy("attn_output")

        cases = [
            ("query_position", [("query", q)], {"query_position": 1234, "is_causal": True},
             pb.AttendRequest(model="dec", query=wire(q), query_position=1234, is_causal=True)),
            ("positions input", [("query", q), ("positions", pos)], {},
             pb.AttendRequest(model="dec", query=wire(q), positions=pos.reshape(-1).tolist())),
            ("key_position", [("query", q), ("key", k), ("value", k)], {"query_position": 10, "key_position": 3},
             pb.AttendRequest(model="dec", query=wire(q), key=wire(k), value=wire(k), query_position=10,
                              key_position=3)),
        ]
        for name, tin, params, req in cases:
            got = infer(tin, params)
            want = native.Attend(req).output
            checks(f"{name}: the OIP answer is attnserve.v1's, byte for byte",
                   got.tobytes() == want.data and list(got.shape) == list(want.shape))
        # Positions matter (RoPE sees their distances): spaced two apart, another answer.
        spaced = infer([("query", q), ("positions", np.tile(np.arange(0, 2 * t, 2), (b, 1)))], {"is_causal": True})
        plain = infer([("query", q)], {"is_causal": True})
        moved = float(np.abs(spaced - plain).max() / np.abs(plain).max())
        checks(f"positions two apart answer otherwise ({moved:.2e} of the scale)", moved > 1e-3)

        # Typed contents: int64_contents for positions, fp32_contents for the query.
        req = service_pb2.ModelInferRequest(model_name="dec")
        tq = req.inputs.add(name="query", datatype="FP32", shape=[b, t, 32])
        tq.contents.fp32_contents.extend(q.reshape(-1).tolist())
        tp = req.inputs.add(name="positions", datatype="INT64", shape=[b, t])
        tp.contents.int64_contents.extend(pos.reshape(-1).tolist())
        r = oip.ModelInfer(req)
        checks("positions as int64_contents: the same answer",
               r.raw_output_contents[0] == native.Attend(cases[1][3]).output.data)

        def refused(build, want_code, *words):
            try:
                oip.ModelInfer(build())
                checks(f"refused: {words}", False, "answered")
            except grpc.RpcError as e:
                checks(f"refused {e.code().name}: {e.details()}",
                       e.code() == want_code and all(w in e.details() for w in words))

        def bad(dtype="INT64", shape=(b, t), values=None, model="dec", raw=None):
            def build():
                req = service_pb2.ModelInferRequest(model_name=model)
                tq = req.inputs.add(name="query", datatype="FP32", shape=[b, t, 32])
                tp = req.inputs.add(name="positions", datatype=dtype, shape=list(shape))
                if raw is not None:
                    req.raw_input_contents.extend([q.tobytes(), raw])
                else:
                    tq.contents.fp32_contents.extend(q.reshape(-1).tolist())
                    tp.contents.int64_contents.extend(values if values is not None else pos.reshape(-1).tolist())
                return req
            return build

        code = grpc.StatusCode.INVALID_ARGUMENT
        refused(bad(dtype="FP32"), code, "inputs[1].datatype", "'FP32'", "INT64")
        refused(bad(shape=(b, t, 1)), code, "inputs[1].shape", "3 dims")
        refused(bad(shape=(-1, -t)), code, "inputs[1].shape", "0 or more")
        refused(bad(shape=(1 << 40, 1 << 40)), code, "inputs[1].shape")
        refused(bad(values=[1, 2, 3]), code, "int64_contents", "3 values", "expected 10")
        refused(bad(raw=b"\x00" * 12), code, "inputs[1]", "12 bytes", "8 bytes each")
        refused(bad(shape=(t,), values=pos[0].tolist()), code, "inputs[1].shape: [5]", "batch 2 and 5 tokens")
        refused(bad(shape=(1, b * t)), code, "inputs[1].shape: [1, 10]", "[batch, query_len] = [2, 5]")
        refused(bad(shape=(0,), values=[]), code, "inputs[1].shape: [0]")
        refused(bad(values=[-1] * (b * t)), code, "positions", "-1", "0 to 2147483647")
        # Parameters of the wrong kind, and positions on a model without them (native's message).
        def with_params(params, model="dec"):
            def build():
                req = service_pb2.ModelInferRequest(model_name=model)
                tq = req.inputs.add(name="query", datatype="FP32", shape=[b, t, 32])
                tq.contents.fp32_contents.extend(q.reshape(-1).tolist())
                for key, v in params.items():
                    if isinstance(v, str):
                        req.parameters[key].string_param = v
                    else:
                        req.parameters[key].int64_param = v
                return req
            return build
        refused(with_params({"query_position": "7"}), code, "parameters['query_position']", "string", "int64")
        refused(with_params({"query_position": 1 << 40}), code, "query_position", "0 to 2147483647")
        refused(with_params({"key_position": 3}), code, "key_position", "only for cross-attention")
    finally:
        channel.close()
        server.stop()


def test_tritonclient_over_a_unix_socket(attnserve, checks):
    """tritonclient.grpc, unmodified, reaches a server's Unix domain socket (--address unix:PATH)
    by the URL `unix:PATH`: health and metadata, and an inference answered with the bytes the same
    call over TCP gets."""
    tmp = lib.temp_dir("attnserve-oip-unix-")
    export_model.export(build("mha", 2100), os.path.join(tmp, "models", "mha"))
    path = os.path.join(tmp, "attnserve.sock")
    server = lib.Server(attnserve, "--models", os.path.join(tmp, "models"), "--address", f"unix:{path}")
    rng = np.random.default_rng(67)
    q = rng.standard_normal((2, 7, E)).astype(np.float32)

    def infer(url):
        client = tc.InferenceServerClient(url)
        x = tc.InferInput("query", list(q.shape), "FP32")
        x.set_data_from_numpy(q)
        out = client.infer("mha", [x]).as_numpy("attn_output")
        live = client.is_server_live() and client.is_model_ready("mha")
        client.close()
        return live, out

    live, over_unix = infer(f"unix:{path}")
    _, over_tcp = infer(server.target)
    checks("tritonclient over the socket: live and the model ready", live)
    checks("tritonclient over the socket: the bytes TCP answers",
           over_unix is not None and np.array_equal(over_unix, over_tcp), str(getattr(over_unix, "shape", None)))
    server.stop()
