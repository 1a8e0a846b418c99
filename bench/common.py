"""Shared pieces of the benchmark scripts: a server, contenders, closed-loop runners, the table.

Scripts, not tests: they print a table and how it was made. Every contender runs against the same
server, the same model and the same inputs in one process run; each cell is the median of ``repeats``
runs (by throughput), with that run's p50/p99. The server's inference statistics are read before and
after every run, so each row also shows the average batch size the server really executed.

A contender is anything with ``name``, ``async setup(url)``, ``async one_request()`` and
``async teardown()`` (:class:`Contender`); sequence contenders run one whole sequence per call
(:class:`SequenceContender`). The SDK's own client plugs in through these, without the harness
knowing it.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import attrs
import numpy as np
import tritonclient.grpc.aio as grpcclient

# The repository root, for tools/ (dev tooling that is not part of the installed package).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.perf_analyzer import (
    PerfAnalyzer,
    PerfAnalyzerError,
    arun_perf_analyzer,
    ensure_perf_analyzer,
)

PLAIN = "tritonclient.grpc.aio loop"
PERF_ANALYZER = "perf_analyzer (C++)"


class Contender(Protocol):
    """One way of sending stateless requests; ``one_request`` sends one and waits for its answer."""

    name: str

    async def setup(self, url: str) -> None: ...

    async def one_request(self) -> None: ...

    async def teardown(self) -> None: ...


class SequenceContender(Protocol):
    """One way of running sequences; ``run_sequence`` runs all steps of one new sequence in order."""

    name: str

    async def setup(self, url: str) -> None: ...

    async def run_sequence(self, steps: int, record: Callable[[float], None]) -> None:
        """Run ``steps`` steps (START on the first, END on the last); ``record(latency_s)`` after each."""
        ...

    async def teardown(self) -> None: ...


@attrs.frozen(kw_only=True)
class Run:
    """One measured run: requests (or sequence steps) done, wall seconds, per-request latencies."""

    contender: str
    concurrency: int
    requests: int
    seconds: float
    latencies_s: tuple[float, ...] = attrs.field(repr=False)
    avg_batch: float = 0.0
    errors: int = 0
    # perf_analyzer reports percentiles, not raw latencies.
    p50_ms_reported: float | None = None
    p99_ms_reported: float | None = None
    # Client process CPU (all threads, grpc's included) per request; None where not measured (perf_analyzer).
    client_cpu_us: float | None = None
    # Set when the contender (or the server under it) failed: the row prints this instead of numbers.
    failure: str | None = None

    @classmethod
    def crashed(cls, contender: str, concurrency: int, why: str) -> Run:
        """The row of a contender whose run failed (e.g. the server crashed under it)."""
        return cls(contender=contender, concurrency=concurrency, requests=0, seconds=0.0, latencies_s=(), failure=why)

    @property
    def infer_s(self) -> float:
        return self.requests / self.seconds if self.seconds > 0 else 0.0

    @property
    def p50_ms(self) -> float:
        if self.p50_ms_reported is not None:
            return self.p50_ms_reported
        return float(np.percentile(self.latencies_s, 50) * 1e3) if self.latencies_s else 0.0

    @property
    def p99_ms(self) -> float:
        if self.p99_ms_reported is not None:
            return self.p99_ms_reported
        return float(np.percentile(self.latencies_s, 99) * 1e3) if self.latencies_s else 0.0


def median_run(runs: Sequence[Run]) -> Run:
    """The run with the median throughput (the lower middle one for an even count); a failed run wins."""
    failed = [r for r in runs if r.failure is not None]
    if failed:
        return failed[0]
    ordered = sorted(runs, key=lambda r: r.infer_s)
    return ordered[(len(ordered) - 1) // 2]


# --- the server's own counts ----------------------------------------------------------


async def batch_counts(url: str, model: str) -> tuple[int, int]:
    """(inference_count, execution_count) of ``model`` since the server started."""
    client = grpcclient.InferenceServerClient(url)
    try:
        stats = await client.get_inference_statistics(model, as_json=True)
    finally:
        await client.close()
    entries = [s for s in stats.get("model_stats", []) if s.get("name") == model]
    inferences = sum(int(s.get("inference_count", 0)) for s in entries)
    executions = sum(int(s.get("execution_count", 0)) for s in entries)
    return inferences, executions


def _avg_batch(before: tuple[int, int], after: tuple[int, int]) -> float:
    executions = after[1] - before[1]
    return (after[0] - before[0]) / executions if executions > 0 else 0.0


# --- closed-loop runners --------------------------------------------------------------


async def _closed_loop(
    concurrency: int, requests: int | None, duration_s: float | None, one: Callable[[list[float]], Awaitable[int]]
) -> tuple[int, float, list[float]]:
    # ``concurrency`` workers each keep one unit in flight until the request budget or the deadline
    # is spent; ``one`` runs one unit, appends its latencies and returns how many requests it made.
    if (requests is None) == (duration_s is None):
        raise ValueError("give exactly one of requests and duration_s")
    latencies: list[float] = []
    done = 0
    started = 0
    deadline = time.perf_counter() + duration_s if duration_s is not None else None

    async def worker() -> None:
        nonlocal done, started
        while True:
            if requests is not None and started >= requests:
                return
            if deadline is not None and time.perf_counter() >= deadline:
                return
            started += 1
            # Await first, then add: ``done += await ...`` would read ``done`` before the await and
            # lose the increments other workers made meanwhile.
            n = await one(latencies)
            done += n

    t0 = time.perf_counter()
    async with asyncio.TaskGroup() as tg:
        for _ in range(concurrency):
            tg.create_task(worker())
    return done, time.perf_counter() - t0, latencies


async def run_contender(
    contender: Contender,
    url: str,
    model: str,
    *,
    concurrency: int,
    requests: int | None = None,
    duration_s: float | None = None,
) -> Run:
    """Measure a stateless contender at ``concurrency`` requests in flight."""

    async def one(latencies: list[float]) -> int:
        t = time.perf_counter()
        await contender.one_request()
        latencies.append(time.perf_counter() - t)
        return 1

    await contender.setup(url)
    try:
        await contender.one_request()  # warm the channel before the clock starts
        before = await batch_counts(url, model)
        cpu0 = time.process_time()
        done, seconds, latencies = await _closed_loop(concurrency, requests, duration_s, one)
        cpu = time.process_time() - cpu0
        after = await batch_counts(url, model)
    finally:
        await contender.teardown()
    return Run(
        contender=contender.name,
        concurrency=concurrency,
        requests=done,
        seconds=seconds,
        latencies_s=tuple(latencies),
        avg_batch=_avg_batch(before, after),
        client_cpu_us=cpu / done * 1e6 if done else None,
    )


async def run_sequences(
    contender: SequenceContender,
    url: str,
    model: str,
    *,
    in_flight: int,
    steps: int,
    sequences: int | None = None,
    duration_s: float | None = None,
) -> Run:
    """Measure a sequence contender with ``in_flight`` sequences open at once; counts steps."""

    async def one(latencies: list[float]) -> int:
        await contender.run_sequence(steps, latencies.append)
        return steps

    await contender.setup(url)
    try:
        before = await batch_counts(url, model)
        cpu0 = time.process_time()
        done, seconds, latencies = await _closed_loop(in_flight, sequences, duration_s, one)
        cpu = time.process_time() - cpu0
        after = await batch_counts(url, model)
    finally:
        await contender.teardown()
    return Run(
        contender=contender.name,
        concurrency=in_flight,
        requests=done,
        seconds=seconds,
        latencies_s=tuple(latencies),
        avg_batch=_avg_batch(before, after),
        client_cpu_us=cpu / done * 1e6 if done else None,
    )


async def run_perf_analyzer_at(
    pa: PerfAnalyzer, url: str, model: str, *, concurrency: int, window_ms: int, extra: Sequence[str] = ()
) -> Run:
    """perf_analyzer at one concurrency, time windows of ``window_ms``; avg batch from its server block."""
    args = [
        "-m", model, "-u", url, "-i", "grpc", "--async", "--concurrency-range", str(concurrency),
        "--measurement-mode", "time_windows", "-p", str(window_ms),
        # 2 shared cores never give three windows within perf_analyzer's default 10 %: take what comes.
        "--stability-percentage", "1000", "--max-trials", "3", *extra,
    ]  # fmt: skip
    before = await batch_counts(url, model)
    result = await arun_perf_analyzer(pa, args, timeout_s=max(120.0, window_ms / 1000 * 20))
    after = await batch_counts(url, model)
    # perf_analyzer's own server block covers the last window only; our delta covers its whole run.
    avg = result.avg_batch_size or _avg_batch(before, after)
    return Run(
        contender=PERF_ANALYZER,
        concurrency=concurrency,
        requests=int(result.throughput_infer_s * window_ms / 1000),
        seconds=window_ms / 1000,
        latencies_s=(),
        avg_batch=avg,
        errors=result.errors,
        p50_ms_reported=result.p50_latency_us / 1e3,
        p99_ms_reported=result.p99_latency_us / 1e3,
    )


def perf_analyzer_or_none() -> PerfAnalyzer | None:
    """The cached perf_analyzer, or None (with a note on stderr) where it cannot be provided."""
    try:
        return ensure_perf_analyzer()
    except PerfAnalyzerError as err:
        print(f"perf_analyzer unavailable, its rows are left out: {err}", file=sys.stderr)
        return None


# --- the stateless plain-tritonclient contender ---------------------------------------


class PlainTritonclient:
    """A typical user's loop: a new ``InferInput`` per call, ``client.infer``, read the output."""

    name = PLAIN

    def __init__(self, model: str, inputs: dict[str, np.ndarray[Any, Any]], datatypes: dict[str, str]) -> None:
        self._model = model
        self._inputs = inputs
        self._datatypes = datatypes
        self._client: grpcclient.InferenceServerClient | None = None

    async def setup(self, url: str) -> None:
        self._client = grpcclient.InferenceServerClient(url)

    async def one_request(self) -> None:
        assert self._client is not None
        tensors = []
        for name, value in self._inputs.items():
            tensor = grpcclient.InferInput(name, list(value.shape), self._datatypes[name])
            tensor.set_data_from_numpy(value)
            tensors.append(tensor)
        result = await self._client.infer(self._model, tensors)
        result.get_response()

    async def teardown(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None


# --- the table ------------------------------------------------------------------------


def _ratio(a: Run | None, b: Run | None) -> str:
    if a is None or b is None or b.infer_s <= 0 or a.failure is not None or b.failure is not None:
        return "-"
    return f"{a.infer_s / b.infer_s:.2f}x"


def table(rows: Sequence[Run], *, unit: str = "infer/s") -> str:
    """The result table: one row per contender and concurrency, ratios against the two baselines."""
    by_key = {(r.contender, r.concurrency): r for r in rows}
    header = [
        "contender", "concurrency", unit, "p50 ms", "p99 ms", "avg batch", "client CPU us/req",
        "vs plain loop", "vs perf_analyzer",
    ]  # fmt: skip
    lines = [header]
    for r in rows:
        if r.failure is not None:
            lines.append([r.contender, str(r.concurrency), "crashed", "-", "-", "-", "-", "-", "-"])
            continue
        lines.append(
            [
                r.contender,
                str(r.concurrency),
                f"{r.infer_s:,.0f}",
                f"{r.p50_ms:.2f}",
                f"{r.p99_ms:.2f}",
                f"{r.avg_batch:.2f}",
                f"{r.client_cpu_us:.0f}" if r.client_cpu_us is not None else "-",
                _ratio(r, by_key.get((PLAIN, r.concurrency))),
                _ratio(r, by_key.get((PERF_ANALYZER, r.concurrency))),
            ]
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    out = ["| " + " | ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)) + " |" for line in lines]
    out.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(out)


def write_json(path: Path, rows: Sequence[Run], how: str) -> None:
    """The rows as JSON (for tests and the README), with the command line that made them."""
    data = {
        "command": how,
        "rows": [
            {
                "contender": r.contender,
                "concurrency": r.concurrency,
                "infer_s": r.infer_s,
                "p50_ms": r.p50_ms,
                "p99_ms": r.p99_ms,
                "avg_batch": r.avg_batch,
                "errors": r.errors,
                "client_cpu_us": r.client_cpu_us,
                "failure": r.failure,
            }
            for r in rows
        ],
    }
    path.write_text(json.dumps(data, indent=2) + "\n")


def how_it_was_run() -> str:
    """The command line, for the table's caption."""
    return "python " + " ".join(sys.argv)


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else 0.0
