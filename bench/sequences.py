"""Issue 4's benchmark: stateful sequences, N in flight, 20 steps each, on a sequence-batched model.

Contenders (same server, same model, one run): a plain ``tritonclient.grpc.aio`` unary loop that sets
sequence_id / sequence_start / sequence_end by hand, ``perf_analyzer`` in sequence mode, and the slots
for this SDK's streaming and unary sessions. Throughput counts steps (one step = one inference); the
"avg batch" column is the server's average executed batch size over the run.

    python bench/sequences.py                              # seq_stats_oldest, 16 and 256 in flight
    python bench/sequences.py --model seq_stats_direct --in-flight 64
    python bench/sequences.py --quick                      # smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import numpy as np
import tritonclient.grpc.aio as grpcclient

# bench/ is a folder of scripts, not a package: make its common.py importable when run from anywhere.
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    PLAIN,
    Run,
    SequenceContender,
    how_it_was_run,
    median_run,
    perf_analyzer_or_none,
    run_perf_analyzer_at,
    run_sequences,
    table,
    write_json,
)

from triton_npu_client import LocalTriton, PerfAnalyzerError

STEP = np.arange(4, dtype=np.float32).reshape(1, 4)


def this_client_sequence_contenders() -> list[SequenceContender]:
    """Slots for this SDK: "streaming sessions" and "unary sessions" (the lead fills them).

    Each needs ``name``, ``async setup(url)``, ``async run_sequence(steps, record)`` (open a session,
    send ``steps`` steps of ``STEP`` in order, call ``record(latency_s)`` after each, close it) and
    ``async teardown()``.
    """
    return []


class PlainSequenceLoop:
    """A typical user's unary loop: a random id, START on the first step, END on the last, by hand."""

    name = PLAIN

    def __init__(self, model: str, *, string_ids: bool) -> None:
        self._model = model
        self._string_ids = string_ids
        self._client: grpcclient.InferenceServerClient | None = None

    async def setup(self, url: str) -> None:
        self._client = grpcclient.InferenceServerClient(url)

    def _new_id(self) -> int | str:
        # Never 0 / "": that silently turns sequencing off.
        return f"seq-{random.getrandbits(64):016x}" if self._string_ids else random.randrange(1, 2**63)

    async def run_sequence(self, steps: int, record: Callable[[float], None]) -> None:
        assert self._client is not None
        sequence_id = self._new_id()
        for step in range(steps):
            t = time.perf_counter()
            x = grpcclient.InferInput("X", list(STEP.shape), "FP32")
            x.set_data_from_numpy(STEP)
            result = await self._client.infer(
                self._model,
                [x],
                sequence_id=sequence_id,
                sequence_start=step == 0,
                sequence_end=step == steps - 1,
            )
            result.get_response()
            record(time.perf_counter() - t)

    async def teardown(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None


async def string_ids(url: str, model: str) -> bool:
    """Whether the model's CORRID control input is TYPE_STRING (read from the server's config)."""
    client = grpcclient.InferenceServerClient(url)
    try:
        config = (await client.get_model_config(model, as_json=True))["config"]
    finally:
        await client.close()
    controls = config.get("sequence_batching", {}).get("control_input", [])
    return any(c.get("data_type") == "TYPE_STRING" for ci in controls for c in ci.get("control", []))


@contextlib.asynccontextmanager
async def server_url(url: str | None) -> AsyncIterator[str]:
    if url is not None:
        yield url
        return
    async with LocalTriton() as server:
        yield f"{server.host}:{server.grpc_port}"


async def bench(ns: argparse.Namespace) -> list[Run]:
    rows: list[Run] = []
    pa = perf_analyzer_or_none()
    async with server_url(ns.url) as url:
        for model in ns.model:
            contenders: list[SequenceContender] = [
                PlainSequenceLoop(model, string_ids=await string_ids(url, model)),
                *this_client_sequence_contenders(),
            ]
            for in_flight in ns.in_flight:
                for contender in contenders:
                    runs = [
                        await run_sequences(
                            contender, url, model, in_flight=in_flight, steps=ns.steps, duration_s=ns.seconds
                        )
                        for _ in range(ns.repeats)
                    ]
                    rows.append(median_run(runs))
                if pa is None:
                    continue
                extra = [
                    "--sequence-length", str(ns.steps), "--sequence-length-variation", "0",
                    "--sequence-id-range", f"1:{max(1_000_000, in_flight * 10)}",
                ]  # fmt: skip
                try:
                    pa_runs = [
                        await run_perf_analyzer_at(
                            pa, url, model, concurrency=in_flight, window_ms=int(ns.seconds * 1000), extra=extra
                        )
                        for _ in range(ns.repeats)
                    ]
                except PerfAnalyzerError as err:
                    print(f"perf_analyzer failed on {model} at {in_flight}: {err}", file=sys.stderr)
                    continue
                rows.append(median_run(pa_runs))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--url", default=None, help="gRPC host:port of a running server (default: start one)")
    parser.add_argument("--model", nargs="+", default=["seq_stats_oldest"], help="sequence-batched model(s)")
    parser.add_argument("--in-flight", type=int, nargs="+", default=None, help="sequences open at once (16 256)")
    parser.add_argument("--steps", type=int, default=20, help="steps per sequence (default 20)")
    parser.add_argument("--seconds", type=float, default=4.0, help="length of one run (default 4)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per cell; the median is shown (default 3)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 16 in flight, short runs, 1 repeat")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here")
    ns = parser.parse_args(argv)
    if ns.quick:
        ns.seconds, ns.repeats = 1.5, 1
    if ns.in_flight is None:
        ns.in_flight = [16] if ns.quick else [16, 256]
    rows = asyncio.run(bench(ns))
    how = how_it_was_run()
    print(f"{how}\nmodels {', '.join(ns.model)}, {ns.steps} steps per sequence, X FP32 {list(STEP.shape)}, gRPC, "
          f"{ns.seconds:g} s per run, median of {ns.repeats}; throughput in steps/s\n")  # fmt: skip
    print(table(rows, unit="steps/s"))
    if ns.json is not None:
        write_json(ns.json, rows, how)
    return 0


if __name__ == "__main__":
    sys.exit(main())
