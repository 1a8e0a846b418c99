"""The scoring job's files alone, no server: readers row by row against ``chunks()``, writers ``write()`` row by row
against ``write_rows()``, side by side in one run.

    python bench/formats.py               # 200,000 rows, medians of 3 (~1-2 min on 2 cores)
    python bench/formats.py --rows 20000 --rounds 1

Readers: ``.npy`` / JSONL / Parquet of 16 float32 a row, ``.txt`` of a sentence a row; "rows" iterates the reader and
touches every row, "chunks" takes ``chunks(--chunk)`` and touches every column (the work a scoring job does before
its checks). Writers: one output of 16 float32 a row, to ``.npy`` / JSONL / Parquet, committed every ``--chunk``
rows; "write" puts one row at a time, "write_rows" a chunk at a time. Ratio: rows/s of the chunked path over the
row path.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from triton_npu_client._jobs.formats import open_writer, read_rows

WIDTH = 16
SENTENCE = "The quick brown fox jumps over the lazy dog near the riverbank at dawn"


def make_inputs(folder: Path, rows: int) -> dict[str, Path]:
    data = np.random.default_rng(0).random((rows, WIDTH), dtype=np.float32)
    paths = {fmt: folder / f"in.{fmt}" for fmt in ("npy", "jsonl", "parquet", "txt")}
    np.save(paths["npy"], data)
    with open(paths["jsonl"], "w") as f:
        for start in range(0, rows, 10000):
            f.writelines(json.dumps({"X": row}) + "\n" for row in data[start : start + 10000].tolist())
    pq.write_table(pa.table({"X": pa.FixedSizeListArray.from_arrays(pa.array(data.reshape(-1)), WIDTH)}),
                   paths["parquet"])
    paths["txt"].write_text("".join(f"{SENTENCE} {i}\n" for i in range(rows)))
    return paths


def read_by_rows(path: Path, chunk: int) -> int:
    n = 0
    for row in read_rows(path, input_names=["X"]):
        row["X"]
        n += 1
    return n


def read_by_chunks(path: Path, chunk: int) -> int:
    n = 0
    for part in read_rows(path, input_names=["X"]).chunks(chunk):
        if part.columns is not None:
            part.columns["X"]
        n += part.length
    return n


def write_by_rows(path: Path, data: np.ndarray, chunk: int) -> int:  # type: ignore[type-arg]
    writer = open_writer(path, fingerprint="bench")
    writer.open()
    for i in range(len(data)):
        writer.write(i, {"Y": data[i]})
        if (i + 1) % chunk == 0:
            writer.commit(i + 1)
    writer.commit(len(data))
    writer.close()
    return len(data)


def write_by_runs(path: Path, data: np.ndarray, chunk: int) -> int:  # type: ignore[type-arg]
    writer = open_writer(path, fingerprint="bench")
    writer.open()
    for start in range(0, len(data), chunk):
        writer.write_rows(start, {"Y": data[start : start + chunk]})
        writer.commit(min(start + chunk, len(data)))
    writer.close()
    return len(data)


def timed(fn: Callable[[], int], rounds: int, before: Callable[[], None] = lambda: None) -> float:
    """Median rows/s of ``fn`` over ``rounds`` runs."""
    rates = []
    for _ in range(rounds):
        before()
        t0 = time.perf_counter()
        n = fn()
        rates.append(n / (time.perf_counter() - t0))
    return statistics.median(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--chunk", type=int, default=4096, help="rows a chunk (and a write_rows run, a commit)")
    ns = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        inputs = make_inputs(folder, ns.rows)
        print(f"{ns.rows:,} rows, chunks of {ns.chunk:,}, medians of {ns.rounds}; rows/s")
        print(f"{'reader':<10}{'rows':>14}{'chunks':>14}{'ratio':>8}")
        for fmt, path in inputs.items():
            by_rows = timed(lambda p=path: read_by_rows(p, ns.chunk), ns.rounds)
            by_chunks = timed(lambda p=path: read_by_chunks(p, ns.chunk), ns.rounds)
            print(f"{fmt:<10}{by_rows:>14,.0f}{by_chunks:>14,.0f}{by_chunks / by_rows:>7.1f}x")
        data = np.random.default_rng(1).random((ns.rows, WIDTH), dtype=np.float32)
        print(f"{'writer':<10}{'write':>14}{'write_rows':>14}{'ratio':>8}")
        for fmt in ("npy", "jsonl", "parquet"):
            out = folder / f"out.{fmt}"

            def clean(out: Path = out) -> None:
                for leftover in folder.glob(out.name + "*"):
                    leftover.unlink()

            by_rows = timed(lambda o=out: write_by_rows(o, data, ns.chunk), ns.rounds, clean)
            by_runs = timed(lambda o=out: write_by_runs(o, data, ns.chunk), ns.rounds, clean)
            print(f"{fmt:<10}{by_rows:>14,.0f}{by_runs:>14,.0f}{by_runs / by_rows:>7.1f}x")


if __name__ == "__main__":
    main()
