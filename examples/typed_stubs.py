"""Typed stubs: call ``scale_fp32`` through classes generated from its ``config.pbtxt``.

``examples/scale_models.py`` was generated with::

    .venv/bin/triton-npu stubs server_models --model scale_fp32 -o examples/scale_models.py

so mypy rejects ``ScaleFp32Inputs(INPUT1=...)`` (no such input), and a float64 array for the FP32 input only when
the array is typed as one (``npt.NDArray[np.float64]``); an array built inline is ``NDArray[Any]`` to mypy, and
the SDK refuses it at run time (``InputDtypeError``) before anything is sent.
Run it with ``python examples/typed_stubs.py`` (starts a local server) or ``--url HOST:PORT`` (gRPC).
"""

from __future__ import annotations

import argparse
import asyncio

import numpy as np

# The generated module sits beside this script, so it imports as a top-level module.
from scale_models import ScaleFp32Inputs, ScaleFp32Outputs

from triton_npu_client import Client, LocalTriton


async def call(url: str) -> ScaleFp32Outputs:
    """One typed request: generated inputs in, the SDK validates and sends them, generated outputs out."""
    inputs = ScaleFp32Inputs(INPUT0=np.arange(8, dtype=np.float32).reshape(2, 4))
    async with Client(f"grpc://{url}") as client:
        model = await client.model(ScaleFp32Inputs.MODEL_NAME)
        result = await model.infer_batch(inputs.as_dict())
    outputs = ScaleFp32Outputs.from_result(result)
    if not np.array_equal(outputs.OUTPUT0, inputs.INPUT0 * 2):
        raise SystemExit(f"unexpected answer: {outputs.OUTPUT0!r}")
    return outputs


async def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--url", default=None, help="gRPC host:port of a running server (default: start one)")
    ns = parser.parse_args(argv)
    if ns.url is not None:
        outputs = await call(ns.url)
    else:
        async with LocalTriton() as server:
            outputs = await call(f"{server.host}:{server.grpc_port}")
    print(f"{ScaleFp32Outputs.MODEL_NAME}: OUTPUT0 = {outputs.OUTPUT0.tolist()}")


if __name__ == "__main__":
    asyncio.run(main())
