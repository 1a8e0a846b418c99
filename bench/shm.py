"""Issue 9's shared-memory benchmark: ``SharedMemoryPool.infer_batch`` vs ``model.infer_batch`` for large tensors.

Same server, same model (``scale_fp32``: OUTPUT0 = 2 * INPUT0), same inputs: rows of 262,144 FP32 values (1 MiB in,
1 MiB out), at a few batch sizes, with ``--concurrency`` requests in flight (the pool gets as many slots). Each run
lasts ``--seconds``; the two paths alternate within a round (the first one alternates too) and each cell is the
median of ``--rounds`` runs. Coalescing is off on both (it would merge the plain path's requests, not the pool's).
Before measuring, each path's answer is checked against 2 * input, and the pool has learned its output sizes (the
first request of a shape gets its outputs in the response).

    python bench/shm.py                      # starts its own server (explicit model control, scale_fp32 only)
    python bench/shm.py --quick              # smoke run: seconds, not minutes
    python bench/shm.py --url 127.0.0.1:8001 --batch-sizes 1 8 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np

# bench/ is a folder of scripts, not a package: make its common.py importable when run from anywhere.
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import how_it_was_run

from triton_npu_client import Client, InferResult, LocalTriton, Model, SharedMemoryPool

MODEL = "scale_fp32"
PLAIN = "plain (model.infer_batch)"
SHM = "shared memory (SharedMemoryPool)"


@contextlib.asynccontextmanager
async def server_url(url: str | None) -> AsyncIterator[str]:
    """``url``, or a fresh local server (explicit model control) that loads only the benchmarked model."""
    if url is not None:
        yield url
        return
    async with LocalTriton(model_control_mode="explicit", load_models=[MODEL]) as server:
        yield f"{server.host}:{server.grpc_port}"


Send = Callable[[], Awaitable[InferResult]]


async def closed_loop(send: Send, *, concurrency: int, seconds: float) -> tuple[int, float]:
    """``concurrency`` workers sending back to back for ``seconds``: (requests answered, wall seconds)."""
    done = 0
    start = time.perf_counter()
    stop = start + seconds

    async def worker() -> None:
        nonlocal done
        while time.perf_counter() < stop:
            await send()
            done += 1

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done, time.perf_counter() - start


async def measure(model: Model, pool: SharedMemoryPool, batch: int, ns: argparse.Namespace) -> dict[str, Any]:
    """One batch size: both paths checked, then ``ns.rounds`` alternating rounds; the median rows/s of each."""
    x = np.random.default_rng(batch).standard_normal((batch, ns.floats)).astype(np.float32)
    paths: dict[str, Send] = {
        PLAIN: lambda: model.infer_batch(INPUT0=x),
        SHM: lambda: pool.infer_batch({"INPUT0": x}),
    }
    for name, send in paths.items():
        for _ in range(2):  # the pool: learn the output size, then grow the output region
            got = await send()
            if not np.array_equal(got["OUTPUT0"], 2 * x):
                raise SystemExit(f"{name}: wrong answer at batch {batch}")
    # Every slot's regions grown to this size before measuring.
    await closed_loop(paths[SHM], concurrency=ns.concurrency, seconds=min(ns.seconds, 1.0))
    in_shm_before = pool.stats().outputs_in_shm
    rates: dict[str, list[float]] = {PLAIN: [], SHM: []}
    requests = 0
    for round_ in range(ns.rounds):
        for name in [PLAIN, SHM] if round_ % 2 == 0 else [SHM, PLAIN]:
            n, wall = await closed_loop(paths[name], concurrency=ns.concurrency, seconds=ns.seconds)
            rates[name].append(n * batch / wall)
            requests += n if name == SHM else 0
    if pool.stats().outputs_in_shm - in_shm_before != requests:
        raise SystemExit("some shared-memory requests got their outputs in the response")
    mb_per_row = ns.floats * 4 / 1e6
    plain, shm = statistics.median(rates[PLAIN]), statistics.median(rates[SHM])
    return {
        "batch": batch, "mb_per_request": batch * mb_per_row,
        "plain_rows_s": plain, "plain_mb_s": plain * mb_per_row,
        "shm_rows_s": shm, "shm_mb_s": shm * mb_per_row,
        "ratio": shm / plain if plain > 0 else 0.0,
        "plain_runs": rates[PLAIN], "shm_runs": rates[SHM],
    }  # fmt: skip


async def bench(ns: argparse.Namespace) -> list[dict[str, Any]]:
    async with server_url(ns.url) as url, Client(f"grpc://{url}", coalescing=None, timeout_s=120.0) as client:
        model = await client.model(MODEL)
        async with await SharedMemoryPool.open(model, slots=ns.concurrency) as pool:
            return [await measure(model, pool, batch, ns) for batch in ns.batch_sizes]


def table(rows: list[dict[str, Any]]) -> str:
    header = ["rows/request", "MB in/request", "plain rows/s", "plain MB/s", "shm rows/s", "shm MB/s", "shm / plain"]
    lines = [header]
    for r in rows:
        lines.append([
            str(r["batch"]), f"{r['mb_per_request']:.1f}", f"{r['plain_rows_s']:,.1f}", f"{r['plain_mb_s']:,.0f}",
            f"{r['shm_rows_s']:,.1f}", f"{r['shm_mb_s']:,.0f}", f"{r['ratio']:.2f}x",
        ])  # fmt: skip
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    out = ["| " + " | ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)) + " |" for line in lines]
    out.insert(1, "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--url", default=None, help="gRPC host:port of a server on this host (default: start one)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=None, help="rows per request (default 1 4 16)")
    parser.add_argument("--floats", type=int, default=262_144, help="FP32 values per row (default 262144: 1 MiB)")
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight, = pool slots (default 4)")
    parser.add_argument("--seconds", type=float, default=3.0, help="length of one run (default 3)")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds; the median is shown (default 5)")
    parser.add_argument("--quick", action="store_true", help="smoke run: batch sizes 1 and 4, short runs, 1 round")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here")
    ns = parser.parse_args(argv)
    if ns.quick:
        ns.seconds, ns.rounds = 0.5, 1
    if ns.batch_sizes is None:
        ns.batch_sizes = [1, 4] if ns.quick else [1, 4, 16]
    rows = asyncio.run(bench(ns))
    how = how_it_was_run()
    print(f"{how}\nmodel {MODEL}, rows of {ns.floats:,} FP32 ({ns.floats * 4 / 1e6:.2f} MB in, as much out), gRPC, "
          f"{ns.concurrency} in flight ({ns.concurrency} slots), {ns.seconds:g} s per run, median of {ns.rounds} "
          "alternating rounds; MB/s counts input bytes\n")  # fmt: skip
    print(table(rows))
    if ns.json is not None:
        ns.json.write_text(json.dumps({"command": how, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
