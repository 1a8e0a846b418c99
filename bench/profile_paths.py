"""Where the client's time goes, per request: a cProfile of each path, grouped by the code it was spent in.

    python bench/profile_paths.py [--requests 4000] [--in-flight 16]

One server (started here), one path at a time: the plain ``tritonclient.grpc.aio`` loop, ``model.infer_batch``
with coalescing off (one gRPC call per request), unary session steps and streamed session steps. For each, the
profiler's own time (tottime) is summed by where the function lives (grpc's Python layer and its Cython core,
asyncio, tritonclient, this SDK, numpy/protobuf/other) and shown in microseconds per request. cProfile inflates
every Python function call, so the absolute figures are higher than without it; the split is what it shows.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import sys
from collections import defaultdict
from collections.abc import Awaitable, Callable

import numpy as np
import tritonclient.grpc.aio as grpcclient

from triton_npu_client import Client, LocalTriton

X = np.arange(4, dtype=np.float32).reshape(1, 4)
GROUPS = ("grpc", "asyncio", "tritonclient", "triton_npu_client", "other")


def _group(filename: str) -> str:
    if "triton_npu_client" in filename:
        return "triton_npu_client"
    if "tritonclient" in filename:
        return "tritonclient"
    if "/grpc/" in filename or "cygrpc" in filename or "grpc._cython" in filename:
        return "grpc"
    if "asyncio" in filename or "selectors" in filename:
        return "asyncio"
    return "other"


async def _profile(
    make: Callable[[], Callable[[], Awaitable[None]]], requests: int, in_flight: int
) -> dict[str, float]:
    one = make()
    per_worker = requests // in_flight

    async def worker(n: int) -> None:
        for _ in range(n):
            await one()

    await asyncio.gather(*(worker(20) for _ in range(in_flight)))  # warm up: plans, streams, connections
    profile = cProfile.Profile()
    profile.enable()
    await asyncio.gather(*(worker(per_worker) for _ in range(in_flight)))
    profile.disable()
    totals: dict[str, float] = defaultdict(float)
    stats = pstats.Stats(profile)
    for (filename, _, name), (_, _, tottime, _, _) in stats.stats.items():  # type: ignore[attr-defined]
        where = _group(filename if filename != "~" else name)
        totals[where] += tottime
    done = per_worker * in_flight
    return {g: totals[g] / done * 1e6 for g in GROUPS}


async def main(ns: argparse.Namespace) -> None:
    async with LocalTriton() as server:
        url = server.grpc_url
        plain = grpcclient.InferenceServerClient(url.removeprefix("grpc://"))
        client = Client(url, coalescing=None)
        scale = await client.model("scale_fp32")
        stats = await client.model("seq_stats_oldest")
        twin = await client.model("seq_stats_stream")

        def plain_loop() -> Callable[[], Awaitable[None]]:
            async def one() -> None:
                tensor = grpcclient.InferInput("INPUT0", [1, 4], "FP32")
                tensor.set_data_from_numpy(X)
                (await plain.infer("scale_fp32", [tensor])).as_numpy("OUTPUT0")

            return one

        def model_infer() -> Callable[[], Awaitable[None]]:
            async def one() -> None:
                (await scale.infer_batch(INPUT0=X))["OUTPUT0"]

            return one

        def sessions(model: object) -> Callable[[], Callable[[], Awaitable[None]]]:
            def make() -> Callable[[], Awaitable[None]]:
                # Each worker's calls are steps of long sequences (restarted every 20 steps, as the benchmark).
                state: dict[int, object] = {}

                async def one() -> None:
                    key = id(asyncio.current_task())
                    entry = state.get(key)
                    if entry is None or entry[1] >= 20:  # type: ignore[index]
                        if entry is not None:
                            await entry[0].aclose()  # type: ignore[index]
                        entry = state[key] = [model.sequence(), 0]  # type: ignore[attr-defined]
                    seq = entry[0]  # type: ignore[index]
                    (await seq.infer(X=X[0]))["MEAN"]
                    entry[1] += 1  # type: ignore[index]

                return one

            return make

        paths = {
            "tritonclient.grpc.aio loop": plain_loop,
            "model.infer_batch (no coalescing)": model_infer,
            "unary sessions (seq_stats_oldest)": sessions(stats),
            "streamed sessions (seq_stats_stream)": sessions(twin),
        }
        rows = {name: await _profile(make, ns.requests, ns.in_flight) for name, make in paths.items()}
        await plain.close()
        await client.aclose()
    print(f"python bench/profile_paths.py --requests {ns.requests} --in-flight {ns.in_flight}")
    print("client time per request under cProfile (us), by where it was spent\n")
    print("| path | " + " | ".join(GROUPS) + " | total |")
    print("|---|" + "---|" * (len(GROUPS) + 1))
    for name, row in rows.items():
        cells = " | ".join(f"{row[g]:.0f}" for g in GROUPS)
        print(f"| {name} | {cells} | {sum(row.values()):.0f} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--in-flight", type=int, default=16)
    asyncio.run(main(parser.parse_args()))
    sys.exit(0)
