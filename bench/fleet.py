"""Issue 15's load test: many sequence sessions over three Triton replicas, and the same load on one server.

Three real ``tritonserver`` processes listen on 127.0.0.1, 127.0.0.2 and 127.0.0.3 with the same ports, and the
fleet client finds them as the records of one DNS name (an injected resolver answering those three addresses:
what a Kubernetes headless Service answers). ``--sessions`` sequences are open at once, each running ``--steps``
unary steps on ``seq_stats_oldest`` (START on the first, END on the last). Every answer is checked exactly: COUNT
is the number of this sequence's steps so far and MEAN the mean of this sequence's own inputs (each session's
inputs differ from every other's by at least 1, so a step served from another sequence's state is a mix-up).
Then, in the same run, the same sessions x steps with the same total in flight go to ONE of those servers.

    python bench/fleet.py                               # 1,000 sessions x 50 steps (minutes on 2 cores)
    python bench/fleet.py --sessions 100 --steps 10     # smoke run
    python bench/fleet.py --idle-timeout-s 0            # the packaged config (3 s sequence idle timeout)

By default the servers run a copy of the model's config whose sequence idle timeout is 60 s instead of 3 s: on two
shared cores one server with 1,000 sequences in flight answers a step in up to ~3.3 s (p99), and Triton drops a
sequence idle for longer than its timeout (the next step then fails as SequenceLost), which would measure the
timeout rather than the routing. The output says which config ran.

Not a test: it prints a table and how it was made. Exit status 1 when any step failed or was mixed up.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

# bench/ is a folder of scripts, not a package: make its common.py importable when run from anywhere.
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import how_it_was_run

from triton_npu_client import Client, FleetOptions, LocalTriton, Model, TritonError
from triton_npu_client._local import default_model_repository

MODEL = "seq_stats_oldest"
HOSTS = ("127.0.0.1", "127.0.0.2", "127.0.0.3")
DNS_NAME = "triton-headless.bench.invalid"  # never resolved by the system: the injected resolver answers it


@attrs.frozen(kw_only=True)
class Result:
    """One run: ``sessions`` x ``steps`` against ``servers`` server(s)."""

    servers: int
    sessions: int
    steps: int
    seconds: float
    latencies_s: tuple[float, ...] = attrs.field(repr=False)
    errors: int  # sessions that ended with an error (each stops at its first)
    mixups: int  # answered steps whose COUNT or MEAN is not this sequence's own
    first_error: str | None
    per_replica: tuple[tuple[str, int], ...]  # (url, steps it served), from the client's own counts
    client_cpu_s: float  # this process's CPU time over the run (all threads, grpc's included)
    avg_batch: float  # the servers' executed batch size over the run (inferences / executions)

    @property
    def done(self) -> int:
        return len(self.latencies_s)

    @property
    def steps_s(self) -> float:
        return self.done / self.seconds if self.seconds > 0 else 0.0

    def pct_ms(self, q: float) -> float:
        return float(np.percentile(self.latencies_s, q) * 1e3) if self.latencies_s else 0.0


def inputs(session: int, steps: int) -> np.ndarray[Any, np.dtype[np.float32]]:
    """Session ``session``'s ``steps`` inputs, FP32 [steps, 4]: exact in FP32, at least 1 away from any other's."""
    base = np.array([session, session + 0.5, -session, 2.0 * session], dtype=np.float64)
    ramp = (np.arange(steps, dtype=np.float64) % 7)[:, None] * 0.25
    return (base[None, :] + ramp).astype(np.float32)


async def one_session(
    model: Model, session: int, steps: int, latencies: list[float], start: asyncio.Event
) -> tuple[int, str | None]:
    """Run one sequence; (mix-ups seen, the error that ended it or None)."""
    xs = inputs(session, steps)
    expected_mean = np.cumsum(xs.astype(np.float64), axis=0) / np.arange(1, steps + 1)[:, None]
    mixups = 0
    await start.wait()
    try:
        async with model.sequence() as seq:
            for step in range(steps):
                t = time.perf_counter()
                if step == steps - 1:
                    out = await seq.end(X=xs[step])
                else:
                    out = await seq.infer(X=xs[step])
                latencies.append(time.perf_counter() - t)
                count = int(np.asarray(out["COUNT"]).reshape(-1)[0])
                mean = np.asarray(out["MEAN"], dtype=np.float64).reshape(-1)
                # Welford in FP32 rounds a little; another session's mean is at least 0.5 away.
                if count != step + 1 or not np.allclose(mean, expected_mean[step], rtol=1e-5, atol=1e-2):
                    mixups += 1
    except (TritonError, OSError) as err:
        return mixups, f"{type(err).__name__}: {err}"
    return mixups, None


async def run(client: Client, servers: int, sessions: int, steps: int) -> Result:
    model = await client.model(MODEL)
    # Warm-up, not measured: connections open, each server's batcher and model have run.
    await asyncio.gather(*(one_session(model, s, 3, [], _started()) for s in range(min(sessions, 30))))
    before = {r.url: r.requests for r in await client.replicas()}
    counts_before = await batch_counts(client)
    latencies: list[float] = []
    start = asyncio.Event()
    tasks = [asyncio.create_task(one_session(model, s, steps, latencies, start)) for s in range(sessions)]
    await asyncio.sleep(0)  # every session is waiting on the start line
    t0, cpu0 = time.perf_counter(), time.process_time()
    start.set()
    outcomes = await asyncio.gather(*tasks)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    inferences, executions = (a - b for a, b in zip(await batch_counts(client), counts_before, strict=True))
    errors = [e for _, e in outcomes if e is not None]
    per_replica = tuple((r.url, r.requests - before.get(r.url, 0)) for r in await client.replicas())
    return Result(
        servers=servers, sessions=sessions, steps=steps, seconds=seconds, latencies_s=tuple(latencies),
        errors=len(errors), mixups=sum(m for m, _ in outcomes), first_error=errors[0] if errors else None,
        per_replica=per_replica, client_cpu_s=cpu, avg_batch=inferences / executions if executions else 0.0,
    )  # fmt: skip


async def batch_counts(client: Client) -> tuple[int, int]:
    """(inferences, executions) of the model, summed over the replicas (Triton's statistics; they trail the
    answers by a moment, which over tens of thousands of steps does not show)."""
    inferences = executions = 0
    for answer in (await client.replica_statistics(MODEL)).values():
        if isinstance(answer, TritonError):
            continue
        inferences += sum(s.inference_count for s in answer)
        executions += sum(s.execution_count for s in answer)
    return inferences, executions


def _started() -> asyncio.Event:
    event = asyncio.Event()
    event.set()
    return event


def free_port(hosts: Sequence[str], taken: set[int]) -> int:
    """A port free on every one of ``hosts`` (all replicas listen on the same ports, as pods do)."""
    while True:
        probe = socket.socket()
        probe.bind((hosts[0], 0))
        port = int(probe.getsockname()[1])
        probe.close()
        if port in taken:
            continue
        ok = True
        for host in hosts:
            s = socket.socket()
            try:
                s.bind((host, port))
            except OSError:
                ok = False
            finally:
                s.close()
        if ok:
            taken.add(port)
            return port


def repository(folder: Path, idle_timeout_s: float) -> tuple[Path, str]:
    """A repository holding only the model (a copy with a longer idle timeout when asked); and a note on it."""
    source = default_model_repository() / MODEL
    target = folder / MODEL
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
    config = (source / "config.pbtxt").read_text()
    if idle_timeout_s <= 0:
        idle = re.search(r"max_sequence_idle_microseconds:\s*(\d+)", config)
        return folder, f"the packaged config (sequence idle timeout {int(idle.group(1)) / 1e6:g} s)" if idle else ""
    us = int(idle_timeout_s * 1e6)
    text, n = re.subn(r"max_sequence_idle_microseconds:\s*\d+", f"max_sequence_idle_microseconds: {us}", config)
    if n != 1:
        raise SystemExit(f"{source / 'config.pbtxt'}: expected one max_sequence_idle_microseconds, found {n}")
    (target / "config.pbtxt").write_text(text)
    return folder, f"a copy of the config with the sequence idle timeout raised to {idle_timeout_s:g} s"


async def bench(ns: argparse.Namespace) -> tuple[list[Result], str]:
    with tempfile.TemporaryDirectory(prefix="triton-npu-bench-fleet-") as tmp:
        repo, note = repository(Path(tmp), ns.idle_timeout_s)
        taken: set[int] = set()
        http, grpc, metrics = (free_port(HOSTS, taken) for _ in range(3))
        servers = [
            LocalTriton(repo, host=h, http_port=http, grpc_port=grpc, metrics_port=metrics, stop_grace_s=2)
            for h in HOSTS
        ]
        t = time.perf_counter()
        try:
            await asyncio.gather(*(s.astart() for s in servers))
            print(f"3 servers ready in {time.perf_counter() - t:.1f} s (ports {grpc} gRPC)", file=sys.stderr)

            async def resolver(host: str, port: int) -> list[str]:
                return list(HOSTS)

            results: list[Result] = []
            fleet = Client(f"dns+grpc://{DNS_NAME}:{grpc}", resolver=resolver, timeout_s=ns.timeout_s,
                           fleet=FleetOptions(health_interval_s=2.0))  # fmt: skip
            async with fleet:
                results.append(await run(fleet, len(HOSTS), ns.sessions, ns.steps))
            print("fleet run done", file=sys.stderr)
            async with Client(f"grpc://{HOSTS[0]}:{grpc}", timeout_s=ns.timeout_s) as one:
                results.append(await run(one, 1, ns.sessions, ns.steps))
        finally:
            await asyncio.gather(*(s.astop() for s in servers), return_exceptions=True)
    return results, note


def table(results: Sequence[Result]) -> str:
    header = ["servers", "sessions", "steps", "wall s", "steps/s", "p50 ms", "p99 ms", "errors", "mix-ups",
              "vs one server", "avg batch", "client CPU s"]  # fmt: skip
    one = next((r for r in results if r.servers == 1), None)
    lines = [header]
    for r in results:
        ratio = f"{r.steps_s / one.steps_s:.2f}x" if one is not None and one.steps_s > 0 else "-"
        lines.append([
            str(r.servers), f"{r.sessions:,}", f"{r.done:,} of {r.sessions * r.steps:,}", f"{r.seconds:.1f}",
            f"{r.steps_s:,.0f}", f"{r.pct_ms(50):.1f}", f"{r.pct_ms(99):.1f}", str(r.errors), str(r.mixups), ratio,
            f"{r.avg_batch:.1f}", f"{r.client_cpu_s:.1f}",
        ])  # fmt: skip
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    out = ["| " + " | ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)) + " |" for line in lines]
    out.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--sessions", type=int, default=1000, help="sequences open at once (default 1000)")
    parser.add_argument("--steps", type=int, default=50, help="steps per sequence (default 50)")
    parser.add_argument(
        "--idle-timeout-s",
        type=float,
        default=60.0,
        help="run on a copy of the model whose sequence idle timeout is this (default 60; 0: as packaged, 3 s)",
    )
    parser.add_argument("--timeout-s", type=float, default=120.0, help="deadline of one step (default 120)")
    ns = parser.parse_args(argv)
    if ns.sessions < 1 or ns.steps < 1:
        parser.error("--sessions and --steps are whole numbers >= 1")
    results, note = asyncio.run(bench(ns))
    print(f"{how_it_was_run()}\n{MODEL} ({note}), X FP32 [4], unary gRPC steps, every answer checked; "
          f"3 servers = one client over {', '.join(HOSTS)} found through one DNS name (injected resolver), "
          f"1 server = one client to {HOSTS[0]}; the same sessions in flight in both\n")  # fmt: skip
    print(table(results))
    for r in results:
        if r.servers > 1:
            shares = ", ".join(f"{url} {n:,}" for url, n in r.per_replica)
            print(f"\nsteps per replica (3 servers): {shares}")
        if r.first_error is not None:
            print(f"first error ({r.servers} server(s)): {r.first_error}")
    return 0 if all(r.errors == 0 and r.mixups == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
