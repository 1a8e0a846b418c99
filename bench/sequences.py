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
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import tritonclient.grpc.aio as grpcclient

# bench/ is a folder of scripts, not a package: make its common.py importable when run from anywhere.
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    PERF_ANALYZER,
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

from tools.perf_analyzer import PerfAnalyzer, PerfAnalyzerError
from triton_npu_client import Client, LocalTriton, Model

STEP = np.arange(4, dtype=np.float32).reshape(1, 4)


# Streamed sessions go to a model's decoupled twin: Triton 2.51 crashes under streamed load when a
# non-decoupled Python model answers (bench/repro_stream_crash/); the twin runs the same computation.
STREAM_TWINS = {"seq_stats_oldest": "seq_stats_stream"}


class ThisClientSessions:
    """This SDK: ``async with model.sequence() as seq``, ``seq.infer`` per step, ``seq.end`` last.

    What a user writes: ids, START/END, per-sequence order and loss detection are the session's job.
    ``stream=True`` carries every step on the client's one long-lived gRPC stream (on the model's decoupled
    twin when it has one); ``False`` sends each step as one unary gRPC call.
    """

    def __init__(self, model: str, *, stream: bool) -> None:
        self.stats_model = STREAM_TWINS.get(model, model) if stream else model
        self._stream = stream
        twin = f", {self.stats_model}" if self.stats_model != model else ""
        self.name = f"this client (streaming sessions{twin})" if stream else "this client (unary sessions)"
        self._client: Client | None = None
        self._model: Model | None = None

    async def setup(self, url: str) -> None:
        self._client = Client(f"grpc://{url}")
        self._model = await self._client.model(self.stats_model)

    async def run_sequence(self, steps: int, record: Callable[[float], None]) -> None:
        assert self._model is not None
        x = STEP[0]  # sample form: the session adds the batch dim
        async with self._model.sequence(stream=self._stream) as seq:
            for step in range(steps):
                t = time.perf_counter()
                if step == steps - 1:
                    await seq.end(X=x)
                else:
                    await seq.infer(X=x)
                record(time.perf_counter() - t)

    async def teardown(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None


def this_client_sequence_contenders(model: str) -> list[SequenceContender]:
    """This SDK's streaming sessions (on the decoupled twin, if any) and unary sessions on ``model``."""
    return [ThisClientSessions(model, stream=True), ThisClientSessions(model, stream=False)]


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


class Server:
    """The server under the benchmark: a given URL, or one this script starts (and restarts after a crash)."""

    def __init__(self, url: str | None) -> None:
        self._given = url
        self._local: LocalTriton | None = None

    @property
    def url(self) -> str:
        if self._given is not None:
            return self._given
        assert self._local is not None
        return f"{self._local.host}:{self._local.grpc_port}"

    async def start(self) -> None:
        if self._given is None:
            self._local = LocalTriton()
            await self._local.__aenter__()

    async def revive(self) -> None:
        """After a failed run: restart our own server if it died (a given server is left as it is)."""
        if self._local is not None and not self._local.is_running:
            print("the server died; starting a fresh one", file=sys.stderr)
            await self._local.__aexit__(None, None, None)
            await self.start()

    async def stop(self) -> None:
        if self._local is not None:
            await self._local.__aexit__(None, None, None)
            self._local = None


async def _measure(
    contender: SequenceContender, server: Server, model: str, *, in_flight: int, steps: int, seconds: float
) -> Run:
    """One run; a contender whose run fails (the server crashed under it, say) gives a "crashed" row."""
    try:
        return await run_sequences(contender, server.url, model, in_flight=in_flight, steps=steps, duration_s=seconds)
    except Exception as err:  # any failure of one contender becomes its row; the bench goes on
        why = _summary(err)
        print(f"{contender.name} at {in_flight} in flight failed: {why}", file=sys.stderr)
        await server.revive()
        return Run.crashed(contender.name, in_flight, why)


def _summary(err: BaseException) -> str:
    """One line for a failure: a TaskGroup's hundreds of SequenceLost become a count and the first one."""
    if isinstance(err, BaseExceptionGroup):
        first = err.exceptions[0]
        while isinstance(first, BaseExceptionGroup):
            first = first.exceptions[0]
        return f"{len(err.exceptions)} sessions failed, first: {first!r}"
    return repr(err)


async def bench(ns: argparse.Namespace) -> list[Run]:
    rows: list[Run] = []
    pa = perf_analyzer_or_none()
    server = Server(ns.url)
    await server.start()
    try:
        await _bench(ns, server, pa, rows)
    finally:
        await server.stop()
    return rows


async def _bench(ns: argparse.Namespace, server: Server, pa: PerfAnalyzer | None, rows: list[Run]) -> None:
    for model in ns.model:
        contenders: list[SequenceContender] = [
            PlainSequenceLoop(model, string_ids=await string_ids(server.url, model)),
            *this_client_sequence_contenders(model),
        ]
        for in_flight in ns.in_flight:
            # Alternating rounds (every contender once per round): drift on a shared machine hits all alike.
            runs: dict[str, list[Run]] = {c.name: [] for c in contenders}
            for _ in range(ns.repeats):
                for contender in contenders:
                    done = runs[contender.name]
                    if done and done[-1].failure is not None:
                        continue
                    # The model whose statistics give the average batch: a contender may run on a twin.
                    stats_model = getattr(contender, "stats_model", model)
                    done.append(
                        await _measure(
                            contender, server, stats_model, in_flight=in_flight, steps=ns.steps, seconds=ns.seconds
                        )
                    )
            rows.extend(median_run(r) for r in runs.values())
            if pa is None:
                continue
            url = server.url
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
                await server.revive()
                rows.append(Run.crashed(PERF_ANALYZER, in_flight, str(err)))
                continue
            rows.append(median_run(pa_runs))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--url", default=None, help="gRPC host:port of a running server (default: start one)")
    parser.add_argument("--model", nargs="+", default=["seq_stats_oldest"], help="sequence-batched model(s)")
    parser.add_argument("--in-flight", type=int, nargs="+", default=None, help="sequences open at once (16 256)")
    parser.add_argument("--steps", type=int, default=20, help="steps per sequence (default 20)")
    parser.add_argument("--seconds", type=float, default=None, help="length of one run (default 4; --quick 1.5)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per cell; the median is shown (default 3)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 16 in flight, short runs, 1 repeat")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here")
    ns = parser.parse_args(argv)
    if ns.quick:
        ns.repeats = 1
    if ns.seconds is None:
        ns.seconds = 1.5 if ns.quick else 4.0
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
