"""Scoring jobs measured side by side in one run: score() now and before, against perf_analyzer; memory; shm.

    python bench/score.py                 # the full run (~15 min on 2 cores)
    python bench/score.py --quick         # a smoke run of every section (tests use it; no "before" unless asked)
    python bench/score.py --before REF    # "before" is the package at git REF (default: the last commit before
                                          # the columnar path); --before none leaves it out

Sections (each prints a table):

1. **Throughput.** The same model, batch shape and concurrency driven by:
   - ``score()`` now: the whole job, from a file (text lines for minilm, a float32 ``.npy`` for scale_fp32) to an
     ``.npy`` output file, at the concurrency where perf_analyzer did best, in a fresh process;
   - ``score()`` before: the same job with the package as it was at ``--before`` (extracted with ``git archive``
     into a temporary folder and put first on the child's ``PYTHONPATH``);
   - ``score_rows()``: the same rows already in memory, results dropped (the per-row interface, no file I/O);
   - NVIDIA's C++ ``perf_analyzer`` at each ``--concurrency`` (its best is the yardstick; goals: score() >= 0.9x on
     scale_fp32, >= 0.95x on minilm);
   - the floor of any Python client: ``tritonclient.grpc.aio`` sending one prebuilt request over and over at the
     same batch and concurrency (nothing read, checked or written);
   - a naive sequential ``tritonclient.grpc`` loop, one row per request;
   - score() and the raw loop each at its own best concurrency of the same ``--concurrency`` sweep (score() holds
     each request a little longer than perf_analyzer does, reading, checking and writing rows around it, so the
     load it puts on the server peaks at another concurrency): shown beside the figures at perf_analyzer's best.
   Two models: ``minilm`` (the real encoder ensemble; every row the same sentence, so every batch has the same
   shape), and ``scale_fp32`` (16 floats a row, almost no compute: the client's own cost shows).
   Rounds rotate who goes first; the figures are medians of ``--rounds``.
2. **Memory.** score() now and before, each in a fresh process over 1,000 and 100,000 rows of ``scale_fp32``
   (``.npy`` in, ``.npy`` out, and JSONL in, JSONL out): the peak RSS (VmHWM) of each (goal: 100k <= 1.2x 1k).
3. **Shared memory.** ``score_rows`` over rows of ~1 MB (262,144 floats) of ``scale_fp32``, through system shared
   memory and through the plain gRPC path, alternating rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.perf_analyzer import PerfAnalyzer, ensure_perf_analyzer, run_perf_analyzer
from triton_npu_client import Client, LocalTriton, score_rows

SENTENCE = "The morning was fine, and the whole party walked down to the sea to watch the ships come in."
SHM_FLOATS = 262_144  # 1 MiB of FP32 per row
# The last commit before the columnar path (issue 16): what "before" means unless --before says otherwise.
BEFORE = "ca7f844"


# -- 1. throughput ------------------------------------------------------------------------------------------------


def write_rows(path: Path, model: str, n: int) -> None:
    if path.suffix == ".npy":
        np.save(path, np.tile(np.arange(16, dtype=np.float32), (n, 1)))
        return
    with path.open("w") as f:
        if model == "minilm":
            for _ in range(n):
                f.write(SENTENCE + "\n")
        else:
            row = json.dumps({"INPUT0": [float(i) for i in range(16)]})
            for _ in range(n):
                f.write(row + "\n")


def source_name(model: str) -> str:
    # Each in its natural file format: text lines for the encoder, a float32 array for the numeric model.
    return "rows.txt" if model == "minilm" else "rows.npy"


def perf_args(model: str, url: str, batch: int, concurrency: int, data: Path | None, interval_ms: int) -> list[str]:
    args = [
        "-m", model, "-u", url, "-i", "grpc", "-b", str(batch), "--concurrency-range", str(concurrency),
        "--measurement-interval", str(interval_ms), "--stability-percentage", "1000",
    ]  # fmt: skip
    if model == "minilm":
        assert data is not None
        args += ["--input-data", str(data)]
    else:
        args += ["--shape", "INPUT0:16"]
    return args


def memory_rows(model: str, n: int) -> list[Any]:
    if model == "minilm":
        return [SENTENCE] * n
    return list(np.tile(np.arange(16, dtype=np.float32), (n, 1)))


async def time_score_rows(url: str, model: str, rows: list[Any], *, batch: int, concurrency: int) -> float:
    """The engine alone: rows already in memory, results counted and dropped (no file read or written)."""
    async with Client(f"grpc://{url}", timeout_s=120) as client:
        handle = await client.model(model)
        started = time.perf_counter()
        ok = 0
        async for scored in score_rows(handle, rows, batch_size=batch, concurrency=concurrency):
            ok += scored.ok
        elapsed = time.perf_counter() - started
    if ok != len(rows):
        raise SystemExit(f"score_rows failed {len(rows) - ok} rows")
    return ok / elapsed


SCORE_CHILD = """
import asyncio, json, sys, time
from pathlib import Path
import triton_npu_client
from triton_npu_client import Client, score
url, model, source, out, batch, concurrency = sys.argv[1:5] + [int(v) for v in sys.argv[5:7]]
for leftover in Path(out).parent.glob(Path(out).name + "*"):
    leftover.unlink()
async def main():
    async with Client(url, timeout_s=120) as client:
        handle = await client.model(model)
        started, cpu = time.perf_counter(), time.process_time()
        summary = await score(handle, source, out, batch_size=batch, concurrency=concurrency, progress=False)
        elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
    assert summary.rows_failed == 0 and summary.rows_ok > 0, summary
    requests = -(-summary.rows_ok // batch)
    return {"rate": summary.rows_ok / elapsed, "cpu_us": cpu / requests * 1e6, "package": triton_npu_client.__file__}
print(json.dumps(asyncio.run(main())))
"""


def child_env(tree: Path | None) -> dict[str, str]:
    """The environment of a child that imports the package from ``tree`` (None: this checkout)."""
    env = dict(os.environ)
    root = tree if tree is not None else Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = os.pathsep.join([str(root), *filter(None, [env.get("PYTHONPATH")])])
    return env


def time_score(url: str, model: str, source: Path, out: Path, *, batch: int, concurrency: int,
               tree: Path | None = None) -> tuple[float, float]:
    """score() file to file in a fresh process, with the package from ``tree``: rows/s, and the client's CPU time
    (all its threads) per request in microseconds."""
    done = subprocess.run(
        [sys.executable, "-c", SCORE_CHILD, f"grpc://{url}", model, str(source), str(out), str(batch),
         str(concurrency)],
        capture_output=True, text=True, env=child_env(tree), cwd=out.parent, timeout=1200,
    )
    if done.returncode != 0:
        raise SystemExit(f"score() child failed:\n{done.stderr[-2000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    expected = (tree or Path(__file__).resolve().parents[1]).resolve()
    if not Path(result["package"]).resolve().is_relative_to(expected):
        raise SystemExit(f"the child imported {result['package']}, not the package under {expected}")
    return float(result["rate"]), float(result["cpu_us"])


def before_tree(ref: str, folder: Path) -> Path | None:
    """The package as it was at git ``ref``, extracted under ``folder``; None for ``none``."""
    if ref == "none":
        return None
    root = Path(__file__).resolve().parents[1]
    tree = folder / "before"
    tree.mkdir()
    archive = subprocess.run(["git", "-C", str(root), "archive", ref, "triton_npu_client"], capture_output=True,
                             check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return tree


def naive_loop(url: str, model: str, n: int) -> float:
    """One row per request, one request at a time: what a first script usually does."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url.removeprefix("grpc://"))
    try:
        if model == "minilm":
            inp = grpcclient.InferInput("TEXT", [1, 1], "BYTES")
            inp.set_data_from_numpy(np.array([[SENTENCE.encode()]], dtype=object))
        else:
            inp = grpcclient.InferInput("INPUT0", [1, 16], "FP32")
            inp.set_data_from_numpy(np.arange(16, dtype=np.float32)[None])
        started = time.perf_counter()
        for _ in range(n):
            client.infer(model, [inp])
        return n / (time.perf_counter() - started)
    finally:
        client.close()


RAW_CHILD = """
import asyncio, json, sys, time
import numpy as np
import tritonclient.grpc.aio as aio
url, model, rows, batch, concurrency = sys.argv[1], sys.argv[2], *[int(v) for v in sys.argv[3:6]]
SENTENCE = sys.argv[6]
async def main():
    client = aio.InferenceServerClient(url)
    if model == "minilm":
        inp = aio.InferInput("TEXT", [batch, 1], "BYTES")
        inp.set_data_from_numpy(np.array([[SENTENCE.encode()]] * batch, dtype=object))
    else:
        inp = aio.InferInput("INPUT0", [batch, 16], "FP32")
        inp.set_data_from_numpy(np.tile(np.arange(16, dtype=np.float32), (batch, 1)))
    left = rows // batch
    async def worker():
        nonlocal left
        while left > 0:
            left -= 1
            await client.infer(model, [inp])
    started, cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(*[worker() for _ in range(concurrency)])
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
    await client.close()
    return {"rate": rows // batch * batch / elapsed, "cpu_us": cpu / (rows // batch) * 1e6}
print(json.dumps(asyncio.run(main())))
"""


def raw_aio_loop(url: str, model: str, rows: int, *, batch: int, concurrency: int) -> tuple[float, float]:
    """The floor of a Python client: tritonclient's own aio client, one prebuilt request sent over and over at the
    same batch and concurrency, nothing read, checked or written (a fresh process)."""
    done = subprocess.run(
        [sys.executable, "-c", RAW_CHILD, url, model, str(rows), str(batch), str(concurrency), SENTENCE],
        capture_output=True, text=True, timeout=1200, check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"raw aio child failed:\n{done.stderr[-2000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return float(result["rate"]), float(result["cpu_us"])


def throughput(
    pa: PerfAnalyzer, url: str, folder: Path, ns: argparse.Namespace, model: str, batch: int, before: Path | None
) -> dict[str, Any]:
    data = folder / "perf_data.json"
    data.write_text(json.dumps({"data": [{"TEXT": {"content": [SENTENCE], "shape": [1]}}]}))
    rows = ns.rows_minilm if model == "minilm" else ns.rows_scale
    source = folder / f"{model}-{source_name(model)}"
    write_rows(source, model, rows)
    out = folder / f"{model}-out.npy"
    sweep = {}
    for c in ns.concurrency:
        result = run_perf_analyzer(pa, perf_args(model, url, batch, c, data, ns.interval_ms), timeout_s=600)
        sweep[c] = result.throughput_infer_s  # perf_analyzer counts inferences: rows, not requests
        print(f"  {model} b={batch}: perf_analyzer c={c}: {sweep[c]:,.0f} rows/s", flush=True)
    best = max(sweep, key=lambda c: sweep[c])
    # Each client at its own best concurrency too: score() holds a request a little longer than perf_analyzer (it
    # reads, checks and writes rows around it), so it may want more in flight for the same load on the server. The
    # same sweep for score() and the raw loop, one run each; the table shows both (at perf_analyzer's c, at its own).
    own: dict[str, dict[int, float]] = {"score": {}, "raw": {}}
    for c in ns.concurrency:
        own["score"][c] = time_score(url, model, source, out, batch=batch, concurrency=c)[0]
        own["raw"][c] = raw_aio_loop(url, model, rows, batch=batch, concurrency=c)[0]
        print(f"  {model} b={batch}: score() c={c}: {own['score'][c]:,.0f}, raw aio loop c={c}: {own['raw'][c]:,.0f} "
              "rows/s", flush=True)
    own_c = {k: max(v, key=lambda c: v[c]) for k, v in own.items()}
    own_runs: dict[str, list[float]] = {"score": [], "raw": []}
    pa_runs: list[float] = []
    score_runs: list[float] = []
    before_runs: list[float] = []
    engine_runs: list[float] = []
    raw_runs: list[float] = []
    cpu: dict[str, list[float]] = {"score": [], "before": [], "raw": []}  # client CPU per request, microseconds
    in_memory = memory_rows(model, rows)
    for r in range(ns.rounds):
        # Rotate who goes first: a machine whose load drifts favours no contender.
        order = ["pa", "score", "before", "engine", "raw"] if before is not None else ["pa", "score", "engine", "raw"]
        order += ["score_own", "raw_own"]
        order = order[r % len(order):] + order[:r % len(order)]
        for which in order:
            if which == "pa":
                result = run_perf_analyzer(pa, perf_args(model, url, batch, best, data, ns.interval_ms), timeout_s=600)
                pa_runs.append(result.throughput_infer_s)
            elif which == "score":
                rate, cpu_us = time_score(url, model, source, out, batch=batch, concurrency=best)
                score_runs.append(rate)
                cpu["score"].append(cpu_us)
            elif which == "before":
                rate, cpu_us = time_score(url, model, source, out, batch=batch, concurrency=best, tree=before)
                before_runs.append(rate)
                cpu["before"].append(cpu_us)
            elif which == "score_own":
                rate, _ = time_score(url, model, source, out, batch=batch, concurrency=own_c["score"])
                own_runs["score"].append(rate)
            elif which == "raw_own":
                own_runs["raw"].append(raw_aio_loop(url, model, rows, batch=batch, concurrency=own_c["raw"])[0])
            elif which == "raw":
                rate, cpu_us = raw_aio_loop(url, model, rows, batch=batch, concurrency=best)
                raw_runs.append(rate)
                cpu["raw"].append(cpu_us)
            else:
                engine_runs.append(asyncio.run(time_score_rows(url, model, in_memory, batch=batch, concurrency=best)))
        was = f", score() before {before_runs[-1]:,.0f}" if before_runs else ""
        print(f"  {model} b={batch} round {r + 1}: perf_analyzer {pa_runs[-1]:,.0f}, score() {score_runs[-1]:,.0f}"
              f"{was}, score_rows {engine_runs[-1]:,.0f}, raw aio loop {raw_runs[-1]:,.0f} rows/s", flush=True)
    naive = naive_loop(url, model, ns.naive_rows)
    return {
        "model": model, "batch": batch, "best_c": best, "sweep": sweep, "pa": statistics.median(pa_runs),
        "score": statistics.median(score_runs), "engine": statistics.median(engine_runs), "naive": naive,
        "before": statistics.median(before_runs) if before_runs else None, "rows": rows,
        "pa_runs": pa_runs, "score_runs": score_runs, "before_runs": before_runs,
        "raw": statistics.median(raw_runs), "raw_runs": raw_runs,
        "cpu": {k: statistics.median(v) for k, v in cpu.items() if v},
        "own_c": own_c, "own_sweep": own, "own": {k: statistics.median(v) for k, v in own_runs.items()},
        "own_runs": own_runs,
    }


# -- 2. memory ----------------------------------------------------------------------------------------------------


def peak_rss_child(url: str, rows: int, folder: Path, suffix: str, tree: Path | None) -> int:
    """VmHWM (KiB) of a fresh process that scores ``rows`` rows of scale_fp32 from ``suffix`` to ``suffix``."""
    source = folder / f"rss-{rows}{suffix}"
    if not source.exists():
        write_rows(source, "scale_fp32", rows)
    out = folder / f"rss-{rows}-out{suffix}"
    for leftover in folder.glob(out.name + "*"):
        leftover.unlink()
    code = (
        "import asyncio, sys\n"
        "from triton_npu_client import Client, score\n"
        "async def main():\n"
        f"    async with Client({url!r}, timeout_s=120) as c:\n"
        "        m = await c.model('scale_fp32')\n"
        f"        s = await score(m, {str(source)!r}, {str(out)!r}, concurrency=4, progress=False)\n"
        f"        assert s.rows_ok == {rows}, s\n"
        "asyncio.run(main())\n"
        "print([l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1])\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env=child_env(tree), cwd=folder)
    return int(done.stdout.strip().splitlines()[-1])


def memory_section(url: str, folder: Path, ns: argparse.Namespace, before: Path | None) -> list[dict[str, Any]]:
    table = []
    for suffix in ns.rss_formats:
        for label, tree in [("now", None), ("before", before)]:
            if label == "before" and tree is None:
                continue
            small, large = (peak_rss_child(url, n, folder, suffix, tree) for n in ns.rss_rows)
            table.append({"format": suffix, "code": label, "small": small, "large": large})
            print(f"  rss {suffix} {label}: {small / 1024:.1f} MiB, {large / 1024:.1f} MiB", flush=True)
    return table


# -- 3. shared memory ---------------------------------------------------------------------------------------------


def big_rows(n: int) -> Iterator[dict[str, np.ndarray]]:
    base = np.arange(SHM_FLOATS, dtype=np.float32)
    for i in range(n):
        yield {"INPUT0": base + i}


async def time_rows(url: str, n: int, *, shm: bool, batch: int, concurrency: int) -> float:
    async with Client(url, timeout_s=120) as client:
        model = await client.model("scale_fp32")
        started = time.perf_counter()
        count = 0
        async for scored in score_rows(model, big_rows(n), batch_size=batch, concurrency=concurrency,
                                       shared_memory=shm):
            if not scored.ok or scored.outputs is None:
                raise SystemExit(f"row {scored.index} failed: {scored.error}")
            if scored.index % 50 == 0 and scored.outputs["OUTPUT0"][1] != 2 * (1 + scored.index):
                raise SystemExit("wrong answer")
            count += 1
        return count / (time.perf_counter() - started)


def shm_section(url: str, ns: argparse.Namespace) -> list[dict[str, Any]]:
    table = []
    for batch in ns.shm_batches:
        plain, shm = [], []
        for r in range(ns.rounds):
            order = (False, True) if r % 2 == 0 else (True, False)
            for use in order:
                rate = asyncio.run(time_rows(url, ns.shm_rows, shm=use, batch=batch, concurrency=2))
                (shm if use else plain).append(rate)
        table.append({"batch": batch, "plain": statistics.median(plain), "shm": statistics.median(shm)})
        print(f"  shm batch {batch}: plain {table[-1]['plain']:,.1f}, shm {table[-1]['shm']:,.1f} rows/s", flush=True)
    return table


# -- main ---------------------------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description="score() vs perf_analyzer vs a naive loop; memory; shared memory")
    parser.add_argument("--quick", action="store_true", help="a smoke run: tiny sizes, one round")
    parser.add_argument("--url", help="a running server that has the models (default: start one)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, nargs="+", default=[64, 32],
                        help="rows per request (score()'s default is the model's max_batch_size: 64 for both)")
    parser.add_argument("--before", default=BEFORE,
                        help="git ref of the package to compare with ('none': leave it out)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--rows-minilm", type=int, default=4000)
    parser.add_argument("--rows-scale", type=int, default=200_000)
    parser.add_argument("--naive-rows", type=int, default=1000)
    parser.add_argument("--interval-ms", type=int, default=5000)
    parser.add_argument("--rss-rows", type=int, nargs=2, default=[1_000, 100_000])
    parser.add_argument("--shm-rows", type=int, default=240)
    parser.add_argument("--shm-batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--models", nargs="+", default=["minilm", "scale_fp32"])
    parser.add_argument("--rss-formats", nargs="+", default=[".npy", ".jsonl"])
    ns = parser.parse_args()
    if ns.quick:
        ns.rounds, ns.concurrency, ns.rows_minilm, ns.rows_scale, ns.naive_rows = 1, [2], 64, 2000, 20
        ns.batch = ns.batch[:1]
        if ns.before == BEFORE:
            ns.before = "none"  # a smoke run of the sections; the comparison is the full run's job
        ns.interval_ms, ns.rss_rows, ns.shm_rows, ns.shm_batches = 500, [100, 1000], 8, [4]
        ns.rss_formats = [".npy"]
    pa = ensure_perf_analyzer()
    load = sorted({*ns.models, "scale_fp32"})
    with contextlib.ExitStack() as stack:
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="triton-npu-bench-")))
        if ns.url is None:
            server = stack.enter_context(LocalTriton(model_control_mode="explicit", load_models=load))
            grpc_url = server.grpc_url
        else:
            grpc_url = ns.url if "://" in ns.url else f"grpc://{ns.url}"
        url = grpc_url.removeprefix("grpc://")
        print(f"server {grpc_url}; {os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.1f}", flush=True)
        before = before_tree(ns.before, folder)
        results = [throughput(pa, url, folder, ns, model, batch, before) for batch in ns.batch for model in ns.models]
        memory = memory_section(grpc_url, folder, ns, before)
        shm = shm_section(grpc_url, ns)
    print()
    print(f"## Throughput (medians of {ns.rounds} alternating rounds; before = the package at {ns.before})")
    print()
    print("| model | batch | rows | perf_analyzer best (c) | score() now | **now / perf_analyzer** | score() before | "
          "before / perf_analyzer | now / before | score_rows, in memory | raw aio loop | raw / perf_analyzer | "
          "naive loop | score() at its best c (c) | **its / perf_analyzer** | raw loop at its best c (c) | "
          "its / perf_analyzer |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        was = r["before"]
        before_cells = (f"{was:,.0f} | {was / r['pa']:.2f}x | {r['score'] / was:.2f}x" if was else "- | - | -")
        print(
            f"| {r['model']} | {r['batch']} | {r['rows']:,} | {r['pa']:,.0f} ({r['best_c']}) | {r['score']:,.0f} | "
            f"**{r['score'] / r['pa']:.2f}x** | {before_cells} | {r['engine']:,.0f} | {r['raw']:,.0f} | "
            f"{r['raw'] / r['pa']:.2f}x | {r['naive']:,.0f} | {r['own']['score']:,.0f} ({r['own_c']['score']}) | "
            f"**{r['own']['score'] / r['pa']:.2f}x** | {r['own']['raw']:,.0f} ({r['own_c']['raw']}) | "
            f"{r['own']['raw'] / r['pa']:.2f}x |"
        )
    print()
    for r in results:
        print(f"- {r['model']} b={r['batch']}: perf_analyzer sweep " +
              ", ".join(f"c={c} {v:,.0f}" for c, v in r["sweep"].items()) +
              "; per round: perf_analyzer " + ", ".join(f"{v:,.0f}" for v in r["pa_runs"]) +
              "; now " + ", ".join(f"{v:,.0f}" for v in r["score_runs"]) +
              ("; before " + ", ".join(f"{v:,.0f}" for v in r["before_runs"]) if r["before_runs"] else "") +
              "; raw aio loop " + ", ".join(f"{v:,.0f}" for v in r["raw_runs"]) +
              "; sweeps: " + "; ".join(f"{k} " + ", ".join(f"c={c} {v:,.0f}" for c, v in sw.items())
                                       for k, sw in r["own_sweep"].items()) +
              "; at their best c, per round: " + "; ".join(f"{k} " + ", ".join(f"{v:,.0f}" for v in runs)
                                                       for k, runs in r["own_runs"].items()) +
              "; client CPU per request (all threads, median): " +
              ", ".join(f"{k} {v:,.0f} us" for k, v in r["cpu"].items()))
    print()
    print("## Client peak RSS (VmHWM), score() of scale_fp32 rows, file to file, concurrency 4")
    print()
    print(f"| format | code | {ns.rss_rows[0]:,} rows | {ns.rss_rows[1]:,} rows | ratio |")
    print("|---|---|---:|---:|---:|")
    for m in memory:
        print(f"| {m['format']} | {m['code']} | {m['small'] / 1024:.1f} MiB | {m['large'] / 1024:.1f} MiB | "
              f"**{m['large'] / m['small']:.2f}x** |")
    print()
    print(f"## Shared memory vs plain gRPC, rows of {SHM_FLOATS * 4 / 2**20:.0f} MiB (scale_fp32, concurrency 2)")
    print()
    print("| rows/request | plain rows/s | shm rows/s | plain MB/s | shm MB/s | shm / plain |")
    print("|---:|---:|---:|---:|---:|---:|")
    mb = SHM_FLOATS * 4 * 2 / 1e6  # in and out
    for row in shm:
        print(
            f"| {row['batch']} | {row['plain']:,.1f} | {row['shm']:,.1f} | {row['plain'] * mb:,.0f} | "
            f"{row['shm'] * mb:,.0f} | **{row['shm'] / row['plain']:.2f}x** |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
