"""The attnserve Python package (client/python) against a real server, run in each of its environments
(tools/python-env.sh: Debian's grpcio 1.51 with torch; the newest grpcio and protobuf without torch).

Checks, with references from python_package_fixtures.py (float64 nn.MultiheadAttention on the values
sent; max|out-ref|/max|ref| <= 1e-5 in float32, 2e-3 float16, 2e-2 bfloat16): attend() with numpy arrays
across self-attention with bool masks and averaged weights, sequence-first with a float mask and
per-head weights, causal, float16, bfloat16 (ml_dtypes where installed, torch where installed),
cross-attention; torch tensors in, torch tensors out (where torch is installed); a session as a context
manager (three steps equal causal attention over the whole sequence; truncate() then the same tokens
again answer the same; a stale step is ABORTED; closed on exit), step_many (two sessions' steps in
each call equal causal attention over each one's tokens; a stale entry fails alone), a memory likewise; errors as AttnserveError with the gRPC code and the server's message; a
deadline; list_models/get_model; a decoder layer's positions (query_position, positions, in calls and
session steps); the asyncio twin; the service configs (a two-address target is
balanced, a config that is not JSON refused); TLS with a CA and server name made here.

usage: python3 -m pytest python_package_test.py --attnserve PATH/TO/attnserve --package-fixtures FIXTURES_DIR
"""
import asyncio
import importlib.util
import os
import shutil
import subprocess
import sys

import grpc
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
import pytest  # noqa: E402

sys.path.insert(0, os.path.join(HERE, "..", "lib"))
import attnserve_py as lib  # noqa: E402  (the server process and checks only: no stubs)

import attnserve  # noqa: E402
import attnserve.aio  # noqa: E402

HAS_TORCH = importlib.util.find_spec("torch") is not None
HAS_ML_DTYPES = importlib.util.find_spec("ml_dtypes") is not None


def err(got, ref):
    got = np.asarray(got, dtype=np.float64)
    return float(np.abs(got - ref).max() / np.abs(ref).max())


def test_the_attnserve_package_against_nn_multiheadattention(request, checks):
    # The binary by its option: the name `attnserve` is the package under test here.
    binary, fixtures = request.config.getoption("--attnserve"), request.config.getoption("--package-fixtures")
    c = dict(np.load(os.path.join(fixtures, "cases.npz")))
    server = lib.Server(binary, "--models", os.path.join(fixtures, "models"))
    env = f"grpcio {grpc.__version__}, torch {'yes' if HAS_TORCH else 'no'}"
    client = attnserve.Client(server.target)

    r = client.attend(c["self_q"], model="mha", key_padding_mask=c["self_kpm"], attn_mask=c["self_mask"],
                      attn_weights="averaged")
    checks(f"[{env}] self-attention, bool masks, averaged weights",
           err(r.output, c["self_out"]) <= 1e-5 and err(r.attn_weights, c["self_w"]) <= 1e-5 and
           isinstance(r.output, np.ndarray) and r.output.dtype == np.float32 and r.model == "mha" and
           r.model_version == 1, f"{err(r.output, c['self_out']):.2e}")
    r = client.attend(c["sf_q"], model="mha", attn_mask=c["sf_mask"], attn_weights="per_head",
                      layout="sequence_first")
    checks(f"[{env}] sequence-first, float mask, per-head weights",
           err(r.output, c["sf_out"]) <= 1e-5 and err(r.attn_weights, c["sf_w"]) <= 1e-5 and
           r.attn_weights.shape == (3, 4, 5, 5), f"{err(r.output, c['sf_out']):.2e}")
    r = client.attend(c["causal_q"], model="mha", is_causal=True)
    checks(f"[{env}] causal", err(r.output, c["causal_out"]) <= 1e-5)
    r = client.attend(c["fp16_q"], model="mha")
    checks(f"[{env}] float16 in, float16 out", r.output.dtype == np.float16 and err(r.output, c["fp16_out"]) <= 2e-3,
           f"{r.output.dtype} {err(r.output, c['fp16_out']):.2e}")
    if HAS_ML_DTYPES:
        import ml_dtypes
        r = client.attend(c["bf16_q"].astype(ml_dtypes.bfloat16), model="mha")
        checks(f"[{env}] bfloat16 (ml_dtypes) in and out",
               r.output.dtype == ml_dtypes.bfloat16 and err(r.output, c["bf16_out"]) <= 2e-2)
    r = client.attend(c["cross_q"], c["cross_k"], c["cross_v"], model="xattn")
    checks(f"[{env}] cross-attention (kdim 16, vdim 24)", err(r.output, c["cross_out"]) <= 1e-5)

    if HAS_TORCH:
        import torch
        r = client.attend(torch.from_numpy(c["self_q"]), model="mha",
                          key_padding_mask=torch.from_numpy(c["self_kpm"]), attn_mask=torch.from_numpy(c["self_mask"]))
        checks(f"[{env}] torch tensors in, a torch tensor out",
               isinstance(r.output, torch.Tensor) and r.output.dtype == torch.float32 and
               err(r.output.numpy(), c["self_out"]) <= 1e-5)
        r = client.attend(torch.from_numpy(c["bf16_q"]).bfloat16(), model="mha")
        checks(f"[{env}] bfloat16 (torch) in and out",
               r.output.dtype == torch.bfloat16 and err(r.output.float().numpy(), c["bf16_out"]) <= 2e-2)

    # A session: steps of 2, 3 and 1 tokens equal causal attention over the six.
    x = c["session_x"]
    with client.session("mha", batch=2) as s:
        outs = [s.step(x[:, a:b]).output for a, b in ((0, 2), (2, 5), (5, 6))]
        length = s.length
        with s.fork() as f:  # A copy of the 6 tokens: its step = the 7th row of a longer sequence.
            forked = (f.length, f.step(x[:, 5:6]).session_length)
        kept = s.truncate(2)  # Take back the last 4 tokens, then send them again.
        again = s.step(x[:, 2:6]).output
        retruncated = s.length
        try:
            client.attend(x[:, :1], session=s.handle, session_length=2)  # A stale step: it holds 6.
            replay = None
        except attnserve.AttnserveError as e:
            replay = e
        handle = s.handle
    checks(f"[{env}] a session's steps equal causal attention over the whole sequence",
           err(np.concatenate(outs, axis=1), c["session_out"]) <= 1e-5 and length == 6)
    checks(f"[{env}] fork(): a session holding the 6 tokens, stepping on its own", forked == (6, 7), str(forked))
    checks(f"[{env}] truncate(2) then the same 4 tokens again: the same answers, 6 tokens held",
           kept == 2 and retruncated == 6 and err(again, c["session_out"][:, 2:]) <= 1e-5)
    checks(f"[{env}] a replayed step (stale session_length) is ABORTED, not applied",
           replay is not None and replay.code == grpc.StatusCode.ABORTED, str(replay))

    # Batched steps: two sessions stepped together in each call (2, 3 and 1 tokens one, 1 at a time the
    # other) equal causal attention over the six; a stale entry fails alone and changes nothing.
    with client.session("mha", batch=2) as s, client.session("mha", batch=2) as t:
        cuts = ((0, 2), (2, 5), (5, 6))
        souts, touts = [], []
        for i, (a, b) in enumerate(cuts):
            steps = [attnserve.Step(s, x[:, a:b]), attnserve.Step(t, x[:, i:i + 1])]
            if i == 1:
                steps.append(attnserve.Step(s.handle, x[:, :1], session_length=0))  # s holds 2: stale
            res = client.step_many(steps)
            souts.append(res[0].output)
            touts.append(res[1].output)
            if i == 1:
                stale = res[2].error
        lengths = (s.length, t.length)
    checks(f"[{env}] step_many: each session's entries equal causal attention over its own tokens",
           err(np.concatenate(souts, axis=1), c["session_out"]) <= 1e-5 and
           err(np.concatenate(touts, axis=1), c["session_out"][:, :3]) <= 1e-5 and lengths == (6, 3), str(lengths))
    checks(f"[{env}] step_many: a stale entry answers its own ABORTED",
           stale is not None and stale.code == grpc.StatusCode.ABORTED and "steps[2]" in stale.message, str(stale))

    # A decoder layer's positions through the package (decoder_conformance checks the numbers against
    # transformers): six tokens from position 3 in one causal call equal a session's steps told the
    # same positions, by query_position and by positions; positions spaced otherwise move the answer
    # (RoPE sees distances: the same spacing from another start answers the same); the MHA model
    # refuses positions naming them.
    xd = c["dec_x"]
    whole = client.attend(xd, model="dec", is_causal=True, query_position=3).output
    with client.session("dec", batch=2) as s:
        first = s.step(xd[:, :2], query_position=3).output
        rest = s.step(xd[:, 2:], positions=np.tile(np.arange(5, 9), (2, 1))).output
    checks(f"[{env}] decoder: steps at positions 3.. equal one causal call from query_position 3",
           err(np.concatenate([first, rest], axis=1), np.asarray(whole, dtype=np.float64)) <= 1e-5)
    spaced = client.attend(xd, model="dec", is_causal=True, positions=np.tile(np.arange(3, 15, 2), (2, 1))).output
    checks(f"[{env}] decoder: positions two apart answer otherwise",
           err(spaced, np.asarray(whole, np.float64)) > 1e-3)
    try:
        client.attend(xd, model="mha", query_position=3)
        refused = None
    except attnserve.AttnserveError as e:
        refused = e
    checks(f"[{env}] positions on nn.MultiheadAttention: INVALID_ARGUMENT naming them",
           refused is not None and refused.code == grpc.StatusCode.INVALID_ARGUMENT and
           "no rotary positions" in refused.message, str(refused))
    try:
        client.attend(x[:, :1], session=handle)
        gone = None
    except attnserve.AttnserveError as e:
        gone = e
    checks(f"[{env}] the session is closed on leaving `with`", gone is not None and gone.code == grpc.StatusCode.NOT_FOUND,
           str(gone))
    with client.memory(c["cross_k"], c["cross_v"], model="xattn") as m:
        r = m.attend(c["cross_q"])
        mh = m.handle
    try:
        client.attend(c["cross_q"], memory=mh)
        gone = None
    except attnserve.AttnserveError as e:
        gone = e
    checks(f"[{env}] a memory answers as cross-attention and is deleted on leaving `with`",
           err(r.output, c["cross_out"]) <= 1e-5 and gone is not None and gone.code == grpc.StatusCode.NOT_FOUND)

    # Errors: the gRPC code and the server's own message.
    try:
        client.attend(c["self_q"], model="nope")
        e = None
    except attnserve.AttnserveError as ex:
        e = ex
    checks(f"[{env}] an absent model: AttnserveError NOT_FOUND naming it",
           e is not None and e.code == grpc.StatusCode.NOT_FOUND and "nope" in e.message and
           str(e).startswith("NOT_FOUND: "), str(e))
    try:
        client.attend(c["self_q"][:, :, :5], model="mha")
        e = None
    except attnserve.AttnserveError as ex:
        e = ex
    checks(f"[{env}] a bad shape: INVALID_ARGUMENT naming the query",
           e is not None and e.code == grpc.StatusCode.INVALID_ARGUMENT and "query" in e.message, str(e))
    try:
        client.attend(c["self_q"].astype(np.int32), model="mha")
        e = None
    except TypeError as ex:
        e = ex
    checks(f"[{env}] an int32 array: TypeError naming the field and the allowed dtypes",
           e is not None and "query" in str(e) and "float32" in str(e), str(e))
    big = np.zeros((64, 1024, 32), np.float32)
    try:
        client.attend(big, model="mha", deadline=1e-4)
        e = None
    except attnserve.AttnserveError as ex:
        e = ex
    checks(f"[{env}] a deadline too short: DEADLINE_EXCEEDED", e is not None and e.code == grpc.StatusCode.DEADLINE_EXCEEDED,
           str(e))
    names = sorted((m.name, m.version) for m in client.list_models())
    info = client.get_model("xattn")
    checks(f"[{env}] list_models and get_model", names == [("dec", 1), ("mha", 1), ("xattn", 1)] and info.kdim == 16 and
           info.vdim == 24, f"{names} {info}")

    # The asyncio twin.
    async def run_aio():
        async with attnserve.aio.Client(server.target) as ac:
            results = await asyncio.gather(*[ac.attend(c["causal_q"], model="mha", is_causal=True) for _ in range(8)])
            async with await ac.session("mha", batch=2) as s:
                outs = [(await s.step(x[:, a:b])).output for a, b in ((0, 2), (2, 5), (5, 6))]
                await s.truncate(5)
                outs[-1] = (await s.step(x[:, 5:6])).output
            async with await ac.session("mha", batch=2) as s, await ac.session("mha", batch=2) as t:
                both = [await ac.step_many([attnserve.Step(s, x[:, a:b]), attnserve.Step(t, x[:, a:b])])
                        for a, b in ((0, 2), (2, 5), (5, 6))]
            try:
                await ac.attend(c["self_q"], model="nope")
                e = None
            except attnserve.AttnserveError as ex:
                e = ex
            return results, outs, e, both
    results, outs, e, both = asyncio.run(run_aio())
    checks(f"[{env}] aio: step_many of two sessions equals causal attention for each",
           all(err(np.concatenate([r[k].output for r in both], axis=1), c["session_out"]) <= 1e-5 for k in (0, 1)))
    checks(f"[{env}] aio: eight concurrent calls, a session (with a truncation), an error",
           all(err(r.output, c["causal_out"]) <= 1e-5 for r in results) and
           err(np.concatenate(outs, axis=1), c["session_out"]) <= 1e-5 and e is not None and
           e.code == grpc.StatusCode.NOT_FOUND)

    # The C++ client's service configs: a target of two addresses is balanced over (both are this
    # server); a config that is not JSON is refused before gRPC sees it.
    two = attnserve.Client(f"ipv4:127.0.0.1:{server.port},127.0.0.1:{server.port}")
    ok = err(two.attend(c["causal_q"], model="mha", is_causal=True).output, c["causal_out"]) <= 1e-5
    two.close()
    plain = attnserve.Client(server.target, service_config=None)
    ok = ok and err(plain.attend(c["causal_q"], model="mha", is_causal=True).output, c["causal_out"]) <= 1e-5
    plain.close()
    try:
        attnserve.Client(server.target, service_config="{round_robin")
        bad = None
    except ValueError as ex:
        bad = ex
    checks(f"[{env}] service configs: default over two addresses, none, a bad one refused", ok and bad is not None)

    client.close()
    server.stop()

    # TLS: a server with a certificate from a CA made here (openssl, as tls_test.py does).
    d = lib.temp_dir("attnserve-pkg-tls-")
    ssl = lambda *a: subprocess.run(["openssl", *a], check=True, capture_output=True)
    ssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=attnserve test ca",
        "-keyout", f"{d}/ca.key", "-out", f"{d}/ca.pem")
    with open(f"{d}/ext", "w") as f:
        f.write("subjectAltName=DNS:attnserve.test\n")
    ssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=server", "-keyout", f"{d}/server.key",
        "-out", f"{d}/server.csr")
    ssl("x509", "-req", "-in", f"{d}/server.csr", "-CA", f"{d}/ca.pem", "-CAkey", f"{d}/ca.key",
        "-CAcreateserial", "-days", "2", "-out", f"{d}/server.pem", "-extfile", f"{d}/ext")
    server = lib.Server(binary, "--models", os.path.join(fixtures, "models"), "--tls-cert", f"{d}/server.pem",
                        "--tls-key", f"{d}/server.key")
    try:
        with attnserve.Client(server.target, tls=True, root_certs=f"{d}/ca.pem",
                              server_name="attnserve.test") as tls:
            ok = err(tls.attend(c["causal_q"], model="mha", is_causal=True).output, c["causal_out"]) <= 1e-5
        try:
            with attnserve.Client(server.target, deadline=5) as plain:
                plain.attend(c["causal_q"], model="mha")
            refused = None
        except attnserve.AttnserveError as e:
            refused = e
        try:
            attnserve.Client(server.target, tls=True, root_certs=f"{d}/missing.pem")
            unreadable = None
        except ValueError as e:
            unreadable = e
        checks(f"[{env}] TLS: served with the CA and server_name; plaintext refused; an unreadable file named",
               ok and refused is not None and refused.code == grpc.StatusCode.UNAVAILABLE and
               unreadable is not None and "missing.pem" in str(unreadable), f"{refused} / {unreadable}")
    finally:
        server.stop()
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))


def test_the_package_through_shared_memory(request, checks):
    """Arrays of a SharedMemoryRegion (Client.shared_memory) travel as references: self- and cross-attention,
    a memory and the asyncio twin answer byte for byte as the in-message path; `out=` receives the output in
    the region; status lists the region, close() unregisters and unlinks it; an `out=` outside any region is
    refused before anything is sent."""
    binary, fixtures = request.config.getoption("--attnserve"), request.config.getoption("--package-fixtures")
    c = dict(np.load(os.path.join(fixtures, "cases.npz")))
    server = lib.Server(binary, "--models", os.path.join(fixtures, "models"), "--allow-shared-memory")
    env = f"grpcio {grpc.__version__}"
    client = attnserve.Client(server.target)
    q, k, v = c["cross_q"], c["cross_k"], c["cross_v"]
    plain_self = client.attend(c["causal_q"], model="mha", is_causal=True).output
    plain_cross = client.attend(q, k, v, model="xattn").output
    with client.shared_memory("io", 1 << 20) as region:
        names = [r.name for r in client.shared_memory_status()]
        checks(f"[{env}] the region is registered under its name", names == ["io"], str(names))
        sq = region.array(c["causal_q"].shape, np.float32, 0)
        sq[...] = c["causal_q"]
        out = region.array(plain_self.shape, np.float32, 1 << 19)
        r = client.attend(sq, model="mha", is_causal=True, out=out)
        checks(f"[{env}] query in the region, output into it: the in-message bytes",
               r.output is out and out.tobytes() == plain_self.tobytes())
        at = 4096
        views = []
        for a in (q, k, v):
            view = region.array(a.shape, np.float32, at)
            view[...] = a
            views.append(view)
            at += a.nbytes + 64
        r = client.attend(*views, model="xattn")
        checks(f"[{env}] cross-attention from the region, output in the message",
               r.output.tobytes() == plain_cross.tobytes())
        with client.memory(views[1], views[2], model="xattn") as m_shared, client.memory(k, v, model="xattn") as m:
            checks(f"[{env}] a memory made from the region answers as one made from the message",
                   m_shared.attend(q).output.tobytes() == m.attend(q).output.tobytes())

        async def aio():
            async with attnserve.aio.Client(server.target) as ac:
                return (await ac.attend(*views, model="xattn")).output
        checks(f"[{env}] the asyncio client sends region arrays as references",
               asyncio.run(aio()).tobytes() == plain_cross.tobytes())
        try:
            client.attend(sq, model="mha", out=np.empty_like(plain_self))
            refused = None
        except ValueError as e:
            refused = e
        checks(f"[{env}] out= outside any region is refused", refused is not None and "out:" in str(refused))
        key = region.key
    checks(f"[{env}] close() unregisters the region and unlinks its object",
           client.shared_memory_status() == [] and not os.path.exists("/dev/shm" + key))
    client.close()
    server.stop()


def connections_to(port):
    """Established TCP connections to `port` on this host (IPv4 and v4-mapped IPv6 sockets)."""
    n = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            next(f)
            for line in f:
                fields = line.split()
                if int(fields[2].split(":")[1], 16) == port and fields[3] == "01":
                    n += 1
    return n


def test_the_models_wire_and_the_connection_pool(request, checks):
    """A bfloat16 model: float32 arrays travel in bfloat16 by default and the answer comes back as float32,
    the same values as sending bfloat16 by hand; wire_dtype="as_given" sends float32. Concurrent calls of one
    client spread over its connections (4 by default)."""
    binary, fixtures = request.config.getoption("--attnserve"), request.config.getoption("--package-fixtures")
    c = dict(np.load(os.path.join(fixtures, "cases.npz")))
    server = lib.Server(binary, "--models", os.path.join(fixtures, "models"), "--dtype", "bfloat16")
    env = f"grpcio {grpc.__version__}"
    client = attnserve.Client(server.target)
    q = c["cross_q"]
    r = client.attend(q, c["cross_k"], c["cross_v"], model="xattn")
    checks(f"[{env}] bfloat16 model, float32 in: float32 out", r.output.dtype == np.float32, str(r.output.dtype))
    checks(f"[{env}] within bfloat16's rounding of the reference", err(r.output, c["cross_out"]) <= 3e-2,
           f"{err(r.output, c['cross_out']):.2e}")
    if HAS_ML_DTYPES:
        import ml_dtypes
        raw = attnserve.Client(server.target, wire_dtype="as_given")
        by_hand = raw.attend(q.astype(ml_dtypes.bfloat16), c["cross_k"].astype(ml_dtypes.bfloat16),
                             c["cross_v"].astype(ml_dtypes.bfloat16), model="xattn")
        checks(f"[{env}] the same values as bfloat16 sent by hand",
               np.array_equal(by_hand.output.astype(np.float32), r.output))
        f32 = raw.attend(q, c["cross_k"], c["cross_v"], model="xattn")
        checks(f"[{env}] wire_dtype='as_given' keeps float32 each way", f32.output.dtype == np.float32)
        raw.close()
    with client.memory(c["cross_k"], c["cross_v"], model="xattn") as m:
        checks(f"[{env}] a memory of a bfloat16 model, float32 in and out",
               m.attend(q).output.dtype == np.float32)
    client.close()

    import concurrent.futures
    pooled = attnserve.Client(server.target, connections=4)
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        outs = list(pool.map(lambda _: pooled.attend(c["causal_q"], model="mha").output, range(32)))
    checks(f"[{env}] 32 concurrent calls answered", len(outs) == 32)
    # The pool's connections are counted once the count settles (a connection may still be closing
    # or opening when the last answer arrives).
    settled = lib.wait_until(lambda: connections_to(server.port) == 4, timeout=10)
    checks(f"[{env}] spread over the client's 4 connections", settled, str(connections_to(server.port)))
    pooled.close()
    server.stop()


def test_the_package_over_a_unix_socket(request, checks):
    """A server listening on a Unix domain socket beside TCP (--address unix:PATH): the sync client,
    its connection pool and the asyncio client reach it by `unix:PATH`, and answer what they answer
    over TCP, to the bit."""
    binary, fixtures = request.config.getoption("--attnserve"), request.config.getoption("--package-fixtures")
    c = dict(np.load(os.path.join(fixtures, "cases.npz")))
    path = os.path.join(lib.temp_dir("attnserve-unix-"), "attnserve.sock")
    server = lib.Server(binary, "--models", os.path.join(fixtures, "models"), "--address", f"unix:{path}")
    env = f"grpcio {grpc.__version__}"
    over_tcp = attnserve.Client(server.target).attend(c["causal_q"], model="mha", is_causal=True).output
    for connections in (1, 4):
        client = attnserve.Client(f"unix:{path}", connections=connections)
        got = client.attend(c["causal_q"], model="mha", is_causal=True).output
        checks(f"[{env}] over the socket ({connections} connections): the bytes TCP answers",
               np.array_equal(got, over_tcp))
        client.close()

    async def run():
        async with attnserve.aio.Client(f"unix:{path}") as client:
            return (await client.attend(c["causal_q"], model="mha", is_causal=True)).output
    checks(f"[{env}] asyncio over the socket: the bytes TCP answers", np.array_equal(asyncio.run(run()), over_tcp))
    server.stop()


def test_the_package_names_its_tenant_and_priority(request, checks):
    """metadata= on the Client names the tenant behind a server that trusts the header (a session one
    tenant opens is NOT_FOUND for another, the same call through the maker answers), and attend's
    priority= reaches the server (past its levels: INVALID_ARGUMENT naming it)."""
    binary, fixtures = request.config.getoption("--attnserve"), request.config.getoption("--package-fixtures")
    server = lib.Server(binary, "--models", os.path.join(fixtures, "models"), "--tenant-header", "attnserve-tenant",
                        "--priority-levels", "2")
    env = f"grpcio {grpc.__version__}"
    a = attnserve.Client(server.target, metadata=(("attnserve-tenant", "a"),))
    b = attnserve.Client(server.target, metadata=(("attnserve-tenant", "b"),))
    x = np.random.default_rng(3).standard_normal((1, 2, 32)).astype(np.float32)
    s = a.session(model="mha", batch=1)
    try:
        b.attend(x, session=s.handle)
        outcome = "OK"
    except attnserve.AttnserveError as e:
        outcome = f"{e.code.name} {e}"
    checks(f"[{env}] tenant b cannot step tenant a's session", outcome.startswith("NOT_FOUND"), outcome)
    r = s.step(x)
    checks(f"[{env}] tenant a steps it", r.session_length == 2, str(r.session_length))
    checks(f"[{env}] priority=1 answers", a.attend(x, model="mha", priority=1).output.shape == (1, 2, 32))
    try:
        a.attend(x, model="mha", priority=3)
        outcome = "OK"
    except attnserve.AttnserveError as e:
        outcome = f"{e.code.name} {e}"
    checks(f"[{env}] priority=3 past 2 levels is INVALID_ARGUMENT naming it",
           outcome.startswith("INVALID_ARGUMENT") and "priority: 3" in outcome, outcome)
    a.close()
    b.close()
    server.stop()
