"""Issue 3's benchmark: this client vs a plain ``tritonclient.grpc.aio`` loop vs ``perf_analyzer``.

Same server, same model (``scale_fp32``), same input (FP32 [1, 4]) in one run, at concurrency 1, 4, 16, 64, 256,
in alternating rounds (each contender once per round; the median round is shown).
Prints throughput, p50/p99 latency, the server's average executed batch size, and the ratios.

    python bench/client_vs_tritonclient.py            # starts its own server on server_models/
    python bench/client_vs_tritonclient.py --quick    # smoke run: seconds, not minutes
    python bench/client_vs_tritonclient.py --url 127.0.0.1:8001 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np

# bench/ is a folder of scripts, not a package: make its common.py importable when run from anywhere.
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    Contender,
    PlainTritonclient,
    Run,
    how_it_was_run,
    median_run,
    perf_analyzer_or_none,
    run_contender,
    run_perf_analyzer_at,
    table,
    write_json,
)

from triton_npu_client import Client, Coalescing, InferRequest, LocalTriton, Model
from triton_npu_client._client._client import DEFAULT_COALESCING

MODEL = "scale_fp32"
INPUT = np.arange(4, dtype=np.float32).reshape(1, 4)


class ThisClient:
    """This SDK: ``await model.infer_batch(INPUT0=x)`` per request, validation and encoding included."""

    def __init__(self, *, prebuilt: bool, coalescing: Coalescing | None = DEFAULT_COALESCING) -> None:
        # prebuilt: one validated InferRequest reused for every call (the "request template" path);
        # otherwise each call validates and encodes its inputs, as user code that builds inputs per call does.
        # coalescing: the client's default merges concurrent callers for dynamic_batching models (scale_fp32 is
        # one); None turns it off, which shows the cost of one call per request against the plain loop.
        self.prebuilt = prebuilt
        self.coalescing = coalescing
        what = "prebuilt request" if prebuilt else "model.infer"
        how = "default" if coalescing is not None else "no coalescing"
        self.name = f"this client ({what}, {how})"
        self._client: Client | None = None
        self._model: Model | None = None
        self._request: InferRequest | None = None

    async def setup(self, url: str) -> None:
        self._client = Client(f"grpc://{url}", coalescing=self.coalescing)
        self._model = await self._client.model(MODEL)
        self._request = self._model.batch_request(INPUT0=INPUT)

    async def one_request(self) -> None:
        assert self._model is not None
        if self.prebuilt:
            assert self._request is not None
            await self._model.infer_request(self._request)
        else:
            await self._model.infer_batch(INPUT0=INPUT)

    async def teardown(self) -> None:
        if self._client is not None:
            await self._client.aclose()


def this_client_contenders() -> list[Contender]:
    """This SDK's client: its default (coalescing for dynamic_batching models), and one call per request."""
    return [
        ThisClient(prebuilt=False),
        ThisClient(prebuilt=False, coalescing=None),
        ThisClient(prebuilt=True, coalescing=None),
    ]


@contextlib.asynccontextmanager
async def server_url(url: str | None) -> AsyncIterator[str]:
    if url is not None:
        yield url
        return
    # Only the model measured: loading the whole repository (chat, MiniLM, ...) costs its start seconds.
    async with LocalTriton(model_control_mode="explicit", load_models=[MODEL]) as server:
        yield f"{server.host}:{server.grpc_port}"


async def bench(ns: argparse.Namespace) -> list[Run]:
    rows: list[Run] = []
    pa = perf_analyzer_or_none()
    async with server_url(ns.url) as url:
        contenders: list[Contender] = [
            PlainTritonclient(MODEL, {"INPUT0": INPUT}, {"INPUT0": "FP32"}),
            *this_client_contenders(),
        ]
        for concurrency in ns.concurrency:
            # Alternating rounds (every contender once per round): drift on a shared machine hits all alike.
            runs: dict[str, list[Run]] = {c.name: [] for c in contenders}
            for _ in range(ns.repeats):
                for contender in contenders:
                    runs[contender.name].append(
                        await run_contender(contender, url, MODEL, concurrency=concurrency, duration_s=ns.seconds)
                    )
            rows.extend(median_run(r) for r in runs.values())
            if pa is not None:
                pa_runs = [
                    await run_perf_analyzer_at(
                        pa,
                        url,
                        MODEL,
                        concurrency=concurrency,
                        window_ms=int(ns.seconds * 1000),
                        extra=["--shape", "INPUT0:4"],
                    )
                    for _ in range(ns.repeats)
                ]
                rows.append(median_run(pa_runs))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--url", default=None, help="gRPC host:port of a running server (default: start one)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=None, help="(default 1 4 16 64 256)")
    parser.add_argument("--seconds", type=float, default=None, help="length of one run (default 3; --quick 1.0)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per cell; the median is shown (default 3)")
    parser.add_argument("--quick", action="store_true", help="smoke run: concurrency 1 and 4, short runs, 1 repeat")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here")
    ns = parser.parse_args(argv)
    if ns.quick:
        ns.repeats = 1
    if ns.seconds is None:
        ns.seconds = 1.0 if ns.quick else 3.0
    if ns.concurrency is None:
        ns.concurrency = [1, 4] if ns.quick else [1, 4, 16, 64, 256]
    rows = asyncio.run(bench(ns))
    how = how_it_was_run()
    print(f"{how}\nmodel {MODEL}, input FP32 {list(INPUT.shape)}, gRPC, {ns.seconds:g} s per run, "
          f"median of {ns.repeats}\n")  # fmt: skip
    print(table(rows))
    if ns.json is not None:
        write_json(ns.json, rows, how)
    return 0


if __name__ == "__main__":
    sys.exit(main())
