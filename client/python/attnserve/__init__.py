"""attnserve's Python client: multi-head attention on an attnserve server over gRPC.

    import attnserve, numpy as np
    client = attnserve.Client("127.0.0.1:50051")
    out = client.attend(np.random.randn(1, 7, 512).astype(np.float32), is_causal=True).output
    with client.session("demo") as s:
        step = s.step(np.random.randn(1, 1, 512).astype(np.float32)).output
    # Many sessions' steps in one call (a model runner's micro-batch):
    a, b = client.session("demo"), client.session("demo")
    outs = client.step_many([attnserve.Step(a, np.random.randn(1, 1, 512).astype(np.float32)),
                             attnserve.Step(b, np.random.randn(1, 3, 512).astype(np.float32))])

Tensors are numpy arrays (float32, float16, bool; bfloat16 through ml_dtypes) or torch tensors (float32,
float16, bfloat16, bool); answers come back as the query came. attnserve.aio.Client is the asyncio twin.
"""
from ._calls import Result, Step, StepResult
from ._client import Client, Memory, Session
from ._shm import SharedMemoryRegion
from .errors import AttnserveError

__all__ = ["Client", "Session", "Memory", "Result", "Step", "StepResult", "AttnserveError", "SharedMemoryRegion"]
__version__ = "0.1.0"
