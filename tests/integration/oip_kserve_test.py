"""The Open Inference Protocol through KServe's Python SDK (kserve 0.21, InferenceGRPCClient and, over
--http-address, InferenceRESTClient; from PyPI unmodified; tools/oip-env.sh kserve): live/ready, and infer() answers byte for byte equal to the
native attnserve.v1 Attend for the same request (the demo model; FP32 query, a BOOL key padding mask,
is_causal), and an absent model's NOT_FOUND. No torch here (the SDK needs numpy 2): numbers are
checked against nn.MultiheadAttention by oip_test.py; this checks the SDK's path reaches the same
computation.

usage: python3 -m pytest oip_kserve_test.py --attnserve PATH/TO/attnserve
"""
import asyncio
import os
import sys
import warnings

import grpc
import numpy as np

warnings.filterwarnings("ignore")
from kserve import InferenceGRPCClient, InferInput, InferRequest  # noqa: E402

import pytest  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
import attnserve_py as lib  # noqa: E402


async def run(server, checks, pb, rpc):
    client = InferenceGRPCClient(server.target, retries=0)
    checks("live and ready", await client.is_server_live() and await client.is_server_ready())
    checks("model ready", await client.is_model_ready("demo"))
    native = rpc.AttentionServiceStub(grpc.insecure_channel(server.target))
    rng = np.random.default_rng(20261124)
    for b, length in ((1, 5), (3, 8)):
        q = rng.standard_normal((b, length, 512)).astype(np.float32)
        kpm = np.arange(length)[None, :] >= rng.integers(1, length + 1, size=b)[:, None]
        qi = InferInput("query", list(q.shape), "FP32")
        qi.set_data_from_numpy(q, binary_data=True)
        mi = InferInput("key_padding_mask", list(kpm.shape), "BOOL")
        mi.set_data_from_numpy(kpm, binary_data=True)
        resp = await client.infer(InferRequest("demo", [qi, mi], parameters={"is_causal": True}))
        out = resp.outputs[0]
        want = native.Attend(pb.AttendRequest(
            model="demo", is_causal=True, query=pb.Tensor(dtype=1, shape=q.shape, data=q.tobytes()),
            key_padding_mask=pb.Tensor(dtype=4, shape=kpm.shape, data=kpm.astype(np.uint8).tobytes())))
        got = np.asarray(out.as_numpy(), dtype=np.float32)
        same, detail = lib.same_answer(got.tobytes(), want.output.data)
        checks(f"B={b} L={length}: {out.name} {out.datatype} {list(out.shape)}, Attend's answer",
               out.name == "attn_output" and list(out.shape) == [b, length, 512] and same, detail)
    try:
        await client.infer(InferRequest("nope", [qi]))
        checks("an absent model: NOT_FOUND", False, "no error")
    except grpc.aio.AioRpcError as e:
        checks("an absent model: NOT_FOUND", e.code() == grpc.StatusCode.NOT_FOUND and "nope" in e.details(),
               str(e))
    await client.close()


def test_kserve_sdk_over_the_open_inference_protocol(attnserve, checks):
    pb, rpc = lib.load_stubs()
    server = lib.Server(attnserve)
    try:
        asyncio.run(run(server, checks, pb, rpc))
    finally:
        server.stop()



async def run_rest(server, checks, pb, rpc):
    from kserve import InferenceRESTClient, RESTConfig
    import httpx

    client = InferenceRESTClient(RESTConfig(protocol="v2", retries=0))
    base = f"http://127.0.0.1:{server.http_port}"
    checks("REST: live and ready", await client.is_server_live(base) and await client.is_server_ready(base))
    checks("REST: model ready", await client.is_model_ready(base, "demo"))
    native = rpc.AttentionServiceStub(grpc.insecure_channel(server.target))
    rng = np.random.default_rng(20261205)
    for b, length, binary in ((1, 5, True), (2, 6, False)):
        q = rng.standard_normal((b, length, 512)).astype(np.float32)
        kpm = np.arange(length)[None, :] >= rng.integers(1, length + 1, size=b)[:, None]
        qi = InferInput("query", list(q.shape), "FP32")
        qi.set_data_from_numpy(q, binary_data=binary)
        mi = InferInput("key_padding_mask", list(kpm.shape), "BOOL")
        mi.set_data_from_numpy(kpm, binary_data=binary)
        resp = await client.infer(base, InferRequest("demo", [qi, mi], parameters={"is_causal": True}),
                                  model_name="demo")
        out = resp.outputs[0]
        want = native.Attend(pb.AttendRequest(
            model="demo", is_causal=True, query=pb.Tensor(dtype=1, shape=q.shape, data=q.tobytes()),
            key_padding_mask=pb.Tensor(dtype=4, shape=kpm.shape, data=kpm.astype(np.uint8).tobytes())))
        got = np.asarray(out.as_numpy(), dtype=np.float32).reshape(b, length, 512)
        checks(f"REST B={b} L={length} ({'binary' if binary else 'JSON'}): Attend's answer, exactly",
               out.name == "attn_output" and got.tobytes() == want.output.data, str(list(out.shape)))
    try:
        await client.infer(base, InferRequest("nope", [qi]), model_name="nope")
        checks("REST: an absent model: 404", False, "no error")
    except httpx.HTTPStatusError as e:
        checks("REST: an absent model: 404 naming it", e.response.status_code == 404 and "nope" in e.response.text,
               str(e))
    await client.close()


def test_kserve_rest_client_over_http(attnserve, checks):
    """KServe's InferenceRESTClient (v2) against --http-address: live/ready, infer with binary and
    with JSON tensors answering exactly the native Attend's bytes, an absent model's 404."""
    pb, rpc = lib.load_stubs()
    server = lib.Server(attnserve)
    try:
        asyncio.run(run_rest(server, checks, pb, rpc))
    finally:
        server.stop()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
