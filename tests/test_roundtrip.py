"""Raw tritonclient grpc.aio and http.aio against the real server's stateless model."""

from __future__ import annotations

import numpy as np
import tritonclient.grpc.aio as grpcclient
import tritonclient.http.aio as httpclient

from triton_npu_client import LocalTriton


async def test_grpc_aio_roundtrip(triton_server: LocalTriton) -> None:
    """scale_fp32 doubles a batch over gRPC."""
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{triton_server.grpc_port}")
    try:
        inp = grpcclient.InferInput("INPUT0", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        result = await client.infer("scale_fp32", [inp])
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), x * 2)
    finally:
        await client.close()


async def test_http_aio_roundtrip(triton_server: LocalTriton) -> None:
    """scale_fp32 doubles a batch over HTTP with the binary tensor extension."""
    x = np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 4)
    client = httpclient.InferenceServerClient(f"127.0.0.1:{triton_server.http_port}")
    try:
        inp = httpclient.InferInput("INPUT0", list(x.shape), "FP32")
        inp.set_data_from_numpy(x, binary_data=True)
        result = await client.infer("scale_fp32", [inp])
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), x * 2)
    finally:
        await client.close()
