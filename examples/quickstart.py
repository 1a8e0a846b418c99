"""The main job for now: start the embedded Triton on server_models/ and make one request.

Run it with ``python examples/quickstart.py``. It starts a real tritonserver on free loopback ports,
sends one batch to the stateless ``scale_fp32`` model over gRPC, checks the answer, and stops the server.
"""

from __future__ import annotations

import asyncio

import numpy as np
import tritonclient.grpc.aio as grpcclient

from triton_npu_client import LocalTriton


async def main() -> None:
    async with LocalTriton() as server:
        print(f"tritonserver ready at {server.grpc_url} and {server.http_url}")
        x = np.arange(8, dtype=np.float32).reshape(2, 4)
        client = grpcclient.InferenceServerClient(f"{server.host}:{server.grpc_port}")
        try:
            inp = grpcclient.InferInput("INPUT0", list(x.shape), "FP32")
            inp.set_data_from_numpy(x)
            result = await client.infer("scale_fp32", [inp])
        finally:
            await client.close()
        y = result.as_numpy("OUTPUT0")
        if y is None or not np.array_equal(y, x * 2):
            raise SystemExit(f"unexpected answer: {y!r}")
        print(f"scale_fp32({x.tolist()}) = {y.tolist()}")
    print("server stopped")


if __name__ == "__main__":
    asyncio.run(main())
