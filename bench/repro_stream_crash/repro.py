"""Reproducer: Triton 2.51 SIGSEGV (TRITONBACKEND_RequestRelease) under streamed sequence steps.

N sequences x S steps, each sequence sent step after step (next step once the previous answer is in),
all multiplexed over ONE gRPC ``ModelStreamInfer`` stream built from raw ``service_pb2`` messages, to
a numpy-only Python-backend model with the ``oldest`` sequence strategy. A run fails when the stream
breaks (the server died); the server log path is printed. See README.md for the findings.

    .venv/bin/python bench/repro_stream_crash/repro.py --model np_seq --runs 10            # crashes
    .venv/bin/python bench/repro_stream_crash/repro.py --model np_seq_decoupled --runs 10  # survives
    .venv/bin/python bench/repro_stream_crash/repro.py --model np_seq --unary --runs 10    # survives
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from tritonclient.grpc import service_pb2, service_pb2_grpc

from triton_npu_client import LocalTriton

MODELS = Path(__file__).resolve().parent / "models"


def step_request(model: str, seq: int, step: int, steps: int) -> Any:
    request = service_pb2.ModelInferRequest(model_name=model)
    tensor = request.inputs.add()
    tensor.name, tensor.datatype = "X", "FP32"
    tensor.shape.extend([1, 4])
    request.raw_input_contents.append(np.ones((1, 4), np.float32).tobytes())
    request.parameters["sequence_id"].int64_param = seq
    request.parameters["sequence_start"].bool_param = step == 0
    request.parameters["sequence_end"].bool_param = step == steps - 1
    return request


async def one_run(url: str, model: str, n: int, steps: int, unary: bool) -> str:
    """Run the load once; return "OK <steps/s>" or "FAIL <why>"."""
    channel = grpc.aio.insecure_channel(url)
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    queue: asyncio.Queue[Any] = asyncio.Queue()
    pending: dict[str, asyncio.Future[Any]] = {}
    ids = itertools.count(1)

    async def requests() -> AsyncIterator[Any]:
        while (item := await queue.get()) is not None:
            yield item

    async def read(call: Any) -> None:
        try:
            async for message in call:
                future = pending.pop(message.infer_response.id)
                if message.error_message:
                    future.set_exception(RuntimeError(message.error_message))
                else:
                    future.set_result(message.infer_response)
        except grpc.aio.AioRpcError as err:
            for future in pending.values():
                future.set_exception(RuntimeError(f"stream broke: {err.code().name}"))

    reader = None
    if not unary:
        reader = asyncio.create_task(read(stub.ModelStreamInfer(requests())))

    async def send(request: Any) -> Any:
        if unary:
            return await stub.ModelInfer(request)
        request.id = str(next(ids))
        future = asyncio.get_running_loop().create_future()
        pending[request.id] = future
        queue.put_nowait(request)
        return await future

    async def sequence(seq: int) -> None:
        for step in range(steps):
            response = await send(step_request(model, seq, step, steps))
            got = np.frombuffer(response.raw_output_contents[0], np.float32)
            if got[0] != step + 1:  # the state really carried across steps
                raise RuntimeError(f"sequence {seq} step {step}: sum {got[0]}")

    start = time.perf_counter()
    try:
        async with asyncio.timeout(120):
            await asyncio.gather(*(sequence(seq) for seq in range(1, n + 1)))
        result = f"OK {n * steps / (time.perf_counter() - start):.0f} steps/s"
    except (RuntimeError, grpc.aio.AioRpcError, TimeoutError) as err:
        result = f"FAIL {type(err).__name__}: {str(err)[:120]}"
    queue.put_nowait(None)
    if reader is not None:
        reader.cancel()
    await channel.close(None)
    return result


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="np_seq", choices=["np_seq", "np_seq_decoupled"])
    parser.add_argument("--sequences", type=int, default=500)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--unary", action="store_true", help="unary ModelInfer instead of the stream")
    args = parser.parse_args()
    results: list[str] = []
    while len(results) < args.runs:
        # One server until it dies; a crashed one is replaced so that every run counts.
        async with LocalTriton(MODELS) as server:
            url = server.grpc_url.split("://")[-1]
            while len(results) < args.runs:
                results.append(await one_run(url, args.model, args.sequences, args.steps, args.unary))
                print(f"run {len(results)}: {results[-1]}", flush=True)
                if not results[-1].startswith("OK"):
                    print(f"  server alive: {server.is_running}; log: {server.log_path}", flush=True)
                    break
    ok = sum(r.startswith("OK") for r in results)
    path = "unary" if args.unary else "stream"
    print(f"{args.model} {path} {args.sequences}x{args.steps}: {ok}/{len(results)} runs ok")


if __name__ == "__main__":
    asyncio.run(main())
