"""What routing over a fleet costs per request: one server reached as one URL, and as fleets over it.

    python bench/fleet_overhead.py [--requests 2000] [--in-flight 64] [--repeats 3]

One real server (scale_fp32 and seq_stats_oldest), reached three ways: its URL (no fleet); a ``dns+`` name that
resolves to its one address (a fleet of one: the routing alone, over one connection); and its URL listed twice
(127.0.0.1 and localhost: a fleet of two replica keys, so two connections, to one server). Every contender loads
the same server the same way, so the differences are the client's. Coalescing is off: every call is one request.
Each cell is the median of ``--repeats`` runs, alternating the contenders. Besides wall-clock rates, the client's
own CPU time per request (``time.process_time``) is shown: on a shared, noisy machine it is the steadier figure.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable

import numpy as np

from triton_npu_client import Client, LocalTriton


async def _sequential(call: Callable[[], Awaitable[object]], n: int) -> float:
    """Median latency (ms) of ``n`` calls one after another."""
    times = []
    for _ in range(n):
        began = time.perf_counter()
        await call()
        times.append(time.perf_counter() - began)
    return statistics.median(times) * 1e3


async def _throughput(call: Callable[[], Awaitable[object]], n: int, in_flight: int) -> tuple[float, float]:
    """Requests per second with ``in_flight`` callers sharing ``n`` calls, and the client's CPU us per call."""
    left = n

    async def worker() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            await call()

    began, cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(*(worker() for _ in range(in_flight)))
    return n / (time.perf_counter() - began), (time.process_time() - cpu) / n * 1e6


async def _measure(client: Client, requests: int, in_flight: int) -> dict[str, float]:
    scale = await client.model("scale_fp32")
    stats = await client.model("seq_stats_oldest")
    x = np.arange(4, dtype=np.float32)

    async def unary() -> object:
        return await scale.infer(INPUT0=x)

    async def sequence() -> object:
        async with stats.sequence() as seq:
            for _ in range(4):
                await seq.infer(X=x)
            return await seq.end(X=x)

    await _sequential(unary, 50)  # warm up
    rate, cpu = await _throughput(unary, requests, in_flight)
    seq_rate, seq_cpu = await _throughput(sequence, requests // 5, in_flight)
    return {
        "unary p50 ms (1 in flight)": await _sequential(unary, requests // 4),
        f"unary req/s ({in_flight} in flight)": rate,
        "unary client CPU us/req": cpu,
        f"sequence steps/s ({in_flight} in flight)": 5 * seq_rate,
        "sequence client CPU us/step": seq_cpu / 5,
    }


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--in-flight", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    ns = parser.parse_args()
    async with LocalTriton(
        model_control_mode="explicit", load_models=["scale_fp32", "seq_stats_oldest"], stop_grace_s=0
    ) as server:
        async def resolve(host: str, port: int) -> list[str]:
            return ["127.0.0.1"]

        urls: dict[str, str | list[str]] = {
            "one URL": server.grpc_url,
            "fleet of one": f"dns+grpc://triton.bench:{server.grpc_port}",
            "fleet of two": [server.grpc_url, f"grpc://localhost:{server.grpc_port}"],
        }
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in urls}
        for _ in range(ns.repeats):
            for name, url in urls.items():
                async with Client(url, coalescing=None, resolver=resolve) as client:
                    runs[name].append(await _measure(client, ns.requests, ns.in_flight))
        metrics = list(runs["one URL"][0])
        medians = {name: {m: statistics.median(r[m] for r in rs) for m in metrics} for name, rs in runs.items()}
        print(f"{'metric':<36}" + "".join(f"{name:>14}" for name in urls) + f"{'1-fleet/one':>13}{'2-fleet/one':>13}")
        for m in metrics:
            one, f1, f2 = (medians[name][m] for name in urls)
            print(f"{m:<36}{one:>14.2f}{f1:>14.2f}{f2:>14.2f}{f1 / one:>13.3f}{f2 / one:>13.3f}")
        print(f"\n{ns.repeats} runs each, medians; {ns.requests} requests per run; coalescing off; one server.")
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
