"""The scoring job's files: streaming readers (rows, BadRow in place, start, total) and resumable writers (a crash
at any point and a re-run leave every row in the output or the errors file exactly once). No server needed."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from triton_npu_client._jobs import CheckpointMismatch, formats
from triton_npu_client._jobs.formats import BadRow, OutputShapeError, _base, open_writer, read_rows

# --- readers --------------------------------------------------------------------------------------------------------


def test_jsonl_rows_bad_lines_start_and_total(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_bytes(
        b'\xef\xbb\xbf{"TEXT": "a", "id": 7}\n'  # a BOM, and a key that is no input (dropped)
        b"\n"  # blank lines are no rows
        b'"b"\n'  # a bare value: keyed by the only input
        b"{broken\n"
        b'{"text": "c"}\n'  # no key names an input
        b'{"TEXT": "\xff"}\n'  # not UTF-8
        b'{"TEXT": "d"}'  # no final newline
    )
    source = read_rows(path, input_names=["TEXT"])
    rows = list(source)
    assert rows[:2] == [{"TEXT": "a"}, {"TEXT": "b"}]
    assert rows[5:] == [{"TEXT": "d"}]
    assert isinstance(rows[2], BadRow)
    assert rows[2].reason.startswith("line 4: invalid JSON: Expecting property name")
    assert isinstance(rows[3], BadRow)
    assert rows[3].reason.startswith("line 5:")
    assert "TEXT" in rows[3].reason
    assert isinstance(rows[4], BadRow)
    assert rows[4].reason.startswith("line 6: invalid JSON")
    assert source.total == len(rows) == 6
    assert (source.format, source.fingerprint.split(":")[0]) == ("jsonl", "jsonl")
    assert list(read_rows(path, input_names=["TEXT"], start=4)) == rows[4:]
    assert list(read_rows(path, input_names=["TEXT"], start=6)) == []
    # Several inputs: a bare value cannot be keyed; an object keeps the inputs it names.
    two = list(read_rows(path, input_names=["TEXT", "OTHER"], format="ndjson"))
    assert isinstance(two[1], BadRow)
    assert "inputs TEXT, OTHER" in two[1].reason
    assert two[0] == {"TEXT": "a"}


def test_text_rows_keep_empty_lines_and_strip_newlines(tmp_path: Path) -> None:
    path = tmp_path / "in.txt"
    path.write_bytes(b"first\r\n\nthird \n\xff\xfe\nlast")
    source = read_rows(path, input_names=["TEXT"])
    rows = list(source)
    assert rows[:3] == [{"TEXT": "first"}, {"TEXT": ""}, {"TEXT": "third "}]
    assert isinstance(rows[3], BadRow)
    assert rows[3].reason.startswith("line 4: not UTF-8")
    assert rows[4] == {"TEXT": "last"}
    assert source.total == 5
    assert list(read_rows(path, input_names=["TEXT"], start=2)) == rows[2:]
    path.write_bytes(b"one\ntwo\n")
    assert read_rows(path, input_names=["TEXT"]).total == 2
    with pytest.raises(ValueError, match="inputs A, B"):
        read_rows(path, input_names=["A", "B"])


def test_csv_cells_are_parsed_string_inputs_stay_text_and_bad_records_are_bad_rows(tmp_path: Path) -> None:
    path = tmp_path / "in.csv"
    path.write_bytes(
        b"TEXT,VEC,N,id\n"
        b'007,"[1, 2.5]",3,x\n'
        b'"two\nlines","[[1], [2]]",-4.5e1,y\n'
        b'["a"],[],true,z\n'
        b"\n"  # blank: no row
        b"short,1\n"
        b"ok,[1,2,3\n"  # an unclosed list in a number column
        b"caf\xe9,[1],1,w\n"  # Latin-1, not UTF-8
        b"plain,[0],-inf,v"
    )
    source = read_rows(path, input_names=["TEXT", "VEC", "N"], string_inputs=["TEXT"])
    rows = list(source)
    assert rows[0] == {"TEXT": "007", "VEC": [1, 2.5], "N": 3}
    assert rows[1] == {"TEXT": "two\nlines", "VEC": [[1], [2]], "N": -45.0}
    assert rows[2] == {"TEXT": ["a"], "VEC": [], "N": True}  # a JSON list of strings is a list for a text input
    assert isinstance(rows[3], BadRow)
    assert rows[3].reason == "line 7: 2 cells, but the header has 4"
    assert isinstance(rows[4], BadRow)
    assert rows[4].reason.startswith("line 8: column 'VEC': invalid JSON list")
    assert isinstance(rows[5], BadRow)
    assert rows[5].reason == "line 9: column 'TEXT' is not UTF-8"
    assert rows[6] == {"TEXT": "plain", "VEC": [0], "N": float("-inf")}
    assert source.total == len(rows) == 7
    assert list(read_rows(path, input_names=["TEXT", "VEC", "N"], start=5, string_inputs=["TEXT"])) == rows[5:]
    # Without string_inputs, a number-looking text is a number (the caller's typing decides what that means).
    assert next(iter(read_rows(path, input_names=["TEXT"])))["TEXT"] == 7


def test_csv_header_must_name_an_input_unless_one_column_feeds_one_input(tmp_path: Path) -> None:
    path = tmp_path / "in.csv"
    path.write_text("sentence\nhello\nworld\n")
    assert list(read_rows(path, input_names=["TEXT"])) == [{"TEXT": "hello"}, {"TEXT": "world"}]
    path.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match=r"no header column \(a, b\) is an input of the model \(X\)"):
        read_rows(path, input_names=["X"])
    path.write_text("")
    with pytest.raises(ValueError, match="no header row"):
        read_rows(path, input_names=["X"])


def test_npy_rows_in_blocks_start_total_and_fortran_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = np.arange(7 * 2 * 3, dtype=np.float32).reshape(7, 2, 3)
    path = tmp_path / "in.npy"
    np.save(path, data)
    monkeypatch.setattr(_base, "BLOCK_BYTES", 2 * data[0].nbytes + 1)  # blocks of 2 rows: 4 reads
    source = read_rows(path, input_names=["X"])
    rows = list(source)
    assert source.total == 7
    assert len(rows) == 7
    for got, want in zip(rows, data, strict=True):
        np.testing.assert_array_equal(got["X"], want)
        assert got["X"].dtype == np.float32
    resumed = list(read_rows(path, input_names=["X"], start=3))
    np.testing.assert_array_equal(np.stack([r["X"] for r in resumed]), data[3:])
    np.save(path, np.asfortranarray(data))
    np.testing.assert_array_equal(np.stack([r["X"] for r in read_rows(path, input_names=["X"], start=5)]), data[5:])
    np.save(path, np.array(["a", 1], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError, match="without Python objects"):
        read_rows(path, input_names=["X"])
    np.save(path, np.float32(1))
    with pytest.raises(ValueError, match="leading row axis"):
        read_rows(path, input_names=["X"])
    np.save(path, data)
    with pytest.raises(ValueError, match="use JSONL, CSV or Parquet"):
        read_rows(path, input_names=["X", "Y"])


def test_readers_hold_a_bounded_part_of_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_base, "BLOCK_BYTES", 1 << 20)
    npy = tmp_path / "big.npy"
    np.save(npy, np.zeros((4096, 1024), dtype=np.float32))  # 16 MiB
    jsonl = tmp_path / "big.jsonl"
    jsonl.write_text("".join(f'{{"X": "{"x" * 1000}"}}\n' for _ in range(12000)))  # 12 MiB
    for path in (npy, jsonl):
        for chunked in (False, True):  # row by row, and a chunk of rows at a time (chunks() holds one chunk)
            tracemalloc.start()
            try:
                source = read_rows(path, input_names=["X"])
                count = sum(c.length for c in source.chunks(256)) if chunked else sum(1 for _ in source)
                _, peak = tracemalloc.get_traced_memory()
            finally:
                tracemalloc.stop()
            assert count in (4096, 12000)
            size_mib = path.stat().st_size >> 20
            assert peak < 4 << 20, f"{path.name}: peak {peak / 2**20:.1f} MiB while streaming a {size_mib} MiB file"


def test_parquet_rows_columns_nulls_and_start_across_row_groups(tmp_path: Path) -> None:
    path = tmp_path / "in.parquet"
    table = pa.table(
        {
            "TEXT": [f"t{i}" for i in range(10)],
            "VEC": [[float(i), float(i) + 0.5] for i in range(10)],
            "N": pa.array([i if i != 4 else None for i in range(10)], type=pa.int64()),
            "id": list(range(100, 110)),
        }
    )
    pq.write_table(table, path, row_group_size=3)  # groups of 3, 3, 3, 1
    source = read_rows(path, input_names=["TEXT", "VEC", "N"])
    rows = list(source)
    assert source.total == 10
    assert len(rows) == 10
    assert rows[0]["TEXT"] == "t0"
    assert set(rows[0]) == {"TEXT", "VEC", "N"}
    np.testing.assert_array_equal(rows[7]["VEC"], [7.0, 7.5])
    assert rows[5]["N"] == 5
    assert np.asarray(rows[5]["N"]).dtype == np.int64
    assert isinstance(rows[4], BadRow)
    assert rows[4].reason == "row 4: column 'N' is null"
    for start in (0, 2, 3, 7, 9, 10, 12):
        resumed = list(read_rows(path, input_names=["TEXT", "VEC", "N"], start=start))
        assert [r["TEXT"] if isinstance(r, dict) else r for r in resumed] == [
            r["TEXT"] if isinstance(r, dict) else r for r in rows[start:]
        ]
    single = tmp_path / "one.parquet"
    pq.write_table(pa.table({"sentence": ["a", "b"]}), single)
    assert list(read_rows(single, input_names=["TEXT"])) == [{"TEXT": "a"}, {"TEXT": "b"}]
    with pytest.raises(ValueError, match="no column"):
        read_rows(path, input_names=["OTHER"])


def test_without_pyarrow_parquet_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "in.parquet"
    pq.write_table(pa.table({"X": [1]}), path)
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # what an absent package looks like to `import`
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ImportError, match=r"pip install 'triton-npu-client\[parquet\]'"):
        read_rows(path, input_names=["X"])
    with pytest.raises(ImportError, match=r"triton-npu-client\[parquet\]"):
        open_writer(tmp_path / "out.parquet", fingerprint="f")


def test_formats_by_suffix_or_name_and_the_fingerprint_follows_the_file(tmp_path: Path) -> None:
    path = tmp_path / "rows.data"
    path.write_text("a\nb\n")
    with pytest.raises(ValueError, match="pass format= one of csv, jsonl, npy, parquet, txt"):
        read_rows(path, input_names=["X"])
    source = read_rows(path, input_names=["X"], format="txt")
    assert source.format == "txt"
    assert list(source) == [{"X": "a"}, {"X": "b"}]
    before = source.fingerprint
    assert str(path.resolve()) in before
    assert read_rows(path, input_names=["X"], format="txt").fingerprint == before
    path.write_text("a\nb\nc\n")
    assert read_rows(path, input_names=["X"], format="txt").fingerprint != before
    with pytest.raises(ValueError, match="unknown output format 'xml'"):
        open_writer(tmp_path / "out.jsonl", fingerprint="f", format="xml")


# --- writers --------------------------------------------------------------------------------------------------------

FORMATS = ["jsonl", "npy", "parquet"]


def outputs_of(i: int) -> dict[str, np.ndarray]:
    """Row i's outputs: a float vector, an int matrix and a text (BYTES) value."""
    return {
        "EMB": (np.arange(4, dtype=np.float32) + i) / 8,
        "IDS": np.full((2, 3), i, dtype=np.int64),
        "LABEL": np.array(f"label-{i}-é".encode(), dtype=object),
    }


def fails(i: int) -> bool:
    return i % 11 == 3


def writer_for(fmt: str, folder: Path, fingerprint: str = "job-1") -> formats.ResultWriter:
    return open_writer(
        folder / f"out.{fmt}",
        fingerprint=fingerprint,
        errors_path=folder / "errors.jsonl",
        output="EMB" if fmt == "npy" else None,
    )


def run_job(fmt: str, folder: Path, rows: int, *, stop_at: int | None = None, commit_every: int = 7) -> int:
    """Score rows 0..rows-1 into ``folder``; at ``stop_at`` give up without committing (as a crash would).

    Returns where the run started."""
    writer = writer_for(fmt, folder)
    start = writer.open()
    for i in range(start, rows):
        if i == stop_at:
            writer.abandon()
            return start
        if fails(i):
            writer.write_error(i, ValueError(f"row {i} is bad"), {"TEXT": f"input {i}"})
        else:
            writer.write(i, outputs_of(i))
        if (i + 1) % commit_every == 0:
            writer.commit(i + 1)
    writer.commit(rows)
    writer.close()
    return start


def read_output(fmt: str, folder: Path) -> Any:
    path = folder / f"out.{fmt}"
    if fmt == "jsonl":
        return [json.loads(line) for line in path.read_text().splitlines()]
    if fmt == "npy":
        return np.load(path)
    return pq.read_table(path)


def test_jsonl_writer_writes_rows_and_errors_and_a_finished_job_says_so(tmp_path: Path) -> None:
    rows = 30
    run_job("jsonl", tmp_path, rows)
    lines = read_output("jsonl", tmp_path)
    good = [i for i in range(rows) if not fails(i)]
    assert [line["row"] for line in lines] == good
    first = lines[0]
    assert first == {"row": 0, "EMB": [0.0, 0.125, 0.25, 0.375], "IDS": [[0, 0, 0], [0, 0, 0]], "LABEL": "label-0-é"}
    errors = [json.loads(line) for line in (tmp_path / "errors.jsonl").read_text().splitlines()]
    assert errors[0] == {"row": 3, "error": "ValueError", "message": "row 3 is bad", "input": {"TEXT": "input 3"}}
    assert [e["row"] for e in errors] == [i for i in range(rows) if fails(i)]
    again = writer_for("jsonl", tmp_path)
    assert (again.open(), again.complete) == (rows, True)
    assert (again.rows_written, again.errors_written) == (len(good), rows - len(good))
    with pytest.raises(RuntimeError, match="already complete"):
        again.write(rows, outputs_of(rows))
    again.commit(rows)  # what a caller with nothing left to do calls: harmless
    again.close()
    assert read_output("jsonl", tmp_path) == lines


def test_errors_keep_small_json_inputs_only(tmp_path: Path) -> None:
    writer = open_writer(tmp_path / "out.jsonl", fingerprint="f", errors_path=tmp_path / "errors.jsonl")
    writer.open()
    writer.write_error(0, "plain reason", {"X": np.arange(3), "T": b"\xffbytes"})
    writer.write_error(1, KeyError(), {"X": np.zeros(10_000)})  # too large to keep
    writer.write_error(2, RuntimeError("boom"), BadRow("line 3: invalid JSON"))
    writer.write_error(3, RuntimeError("boom"), object())  # not JSON-able
    writer.commit(4)
    writer.close()
    errors = [json.loads(line) for line in (tmp_path / "errors.jsonl").read_text().splitlines()]
    kept = {"X": [0, 1, 2], "T": "\ufffdbytes"}  # arrays as lists, bytes as text
    assert errors[0] == {"row": 0, "error": "Error", "message": "plain reason", "input": kept}
    assert errors[1] == {"row": 1, "error": "KeyError", "message": "KeyError"}
    assert [set(e) for e in errors[2:]] == [{"row", "error", "message"}] * 2


def test_npy_writer_fills_failed_rows_and_turns_a_misshapen_row_into_an_error(tmp_path: Path) -> None:
    path = tmp_path / "out.npy"
    writer = open_writer(path, fingerprint="f", errors_path=tmp_path / "errors.jsonl")
    assert writer.open() == 0
    writer.write_error(0, ValueError("before any good row"))  # its slot waits for the dtype
    writer.write(1, {"SCORE": np.array([1.5, 2.5], dtype=np.float32)})
    writer.write(2, {"SCORE": np.array([1.0, 2.0, 3.0], dtype=np.float32)})  # another shape
    writer.write(3, {"SCORE": np.array([7, 8], dtype=np.int8)})  # a safe cast
    writer.commit(4)
    # A partial file reads as the rows committed: the header's count follows each commit.
    assert np.load(path).shape == (4, 2)
    writer.write_error(4, "late")
    writer.commit(5)
    writer.close()
    got = np.load(path)
    assert got.dtype == np.float32
    assert got.shape == (5, 2)
    np.testing.assert_array_equal(got, [[np.nan] * 2, [1.5, 2.5], [np.nan] * 2, [7, 8], [np.nan] * 2])
    errors = [json.loads(line) for line in (tmp_path / "errors.jsonl").read_text().splitlines()]
    assert [(e["row"], e["error"]) for e in errors] == [
        (0, "ValueError"), (2, OutputShapeError.__name__), (4, "Error")
    ]
    assert "shape (3,)" in errors[1]["message"]
    assert "(2,)" in errors[1]["message"]
    assert (writer.rows_written, writer.errors_written) == (2, 3)


def test_npy_writer_ints_fill_with_zero_and_all_failed_rows_are_nan(tmp_path: Path) -> None:
    ints = tmp_path / "ints.npy"
    writer = open_writer(ints, fingerprint="f")
    writer.open()
    writer.write(0, {"IDS": np.array([[1, 2]], dtype=np.int32)})
    writer.write_error(1, "bad")
    writer.commit(2)
    writer.close()
    np.testing.assert_array_equal(np.load(ints), np.array([[[1, 2]], [[0, 0]]], dtype=np.int32))
    none = tmp_path / "none.npy"
    writer = open_writer(none, fingerprint="f")
    writer.open()
    for i in range(3):
        writer.write_error(i, "bad")
    writer.commit(3)
    writer.close()
    got = np.load(none)
    assert got.dtype == np.float64
    assert got.shape == (3,)
    assert np.isnan(got).all()


def test_npy_writer_refuses_what_it_cannot_hold(tmp_path: Path) -> None:
    writer = open_writer(tmp_path / "a.npy", fingerprint="f")
    writer.open()
    with pytest.raises(ValueError, match="choose one"):
        writer.write(0, {"A": np.zeros(2), "B": np.zeros(2)})
    writer.abandon()
    writer = open_writer(tmp_path / "b.npy", fingerprint="f")
    writer.open()
    with pytest.raises(TypeError, match="takes numbers"):
        writer.write(0, {"TEXT": np.array(b"x", dtype=object)})
    writer.abandon()
    writer = open_writer(tmp_path / "c.npy", fingerprint="f", output="B")
    writer.open()
    writer.write(0, {"A": np.zeros(2), "B": np.ones(3)})
    with pytest.raises(ValueError, match="row 2 came where row 1 was due"):
        writer.write(2, {"A": np.zeros(2), "B": np.ones(3)})
    writer.write(1, {"A": np.zeros(2), "B": np.ones(3)})
    with pytest.raises(ValueError, match="neither written nor failed"):
        writer.commit(3)
    writer.commit(2)
    writer.close()
    np.testing.assert_array_equal(np.load(tmp_path / "c.npy"), np.ones((2, 3)))


def test_parquet_writer_round_trip_types_and_no_parts_left(tmp_path: Path) -> None:
    rows = 40
    run_job("parquet", tmp_path, rows, commit_every=6)
    table = read_output("parquet", tmp_path)
    good = [i for i in range(rows) if not fails(i)]
    assert table.column_names == ["row", "EMB", "IDS", "LABEL"]
    assert table.schema.field("EMB").type == pa.list_(pa.float32())
    assert table.schema.field("IDS").type == pa.list_(pa.list_(pa.int64()))
    assert table.column("row").to_pylist() == good
    assert table.column("LABEL").to_pylist() == [f"label-{i}-é" for i in good]
    assert table.column("IDS").to_pylist()[1] == [[1, 1, 1], [1, 1, 1]]
    embeddings = np.stack(table.column("EMB").to_numpy())
    np.testing.assert_array_equal(embeddings, np.stack([outputs_of(i)["EMB"] for i in good]))
    assert not (tmp_path / "out.parquet.parts").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["errors.jsonl", "out.parquet", "out.parquet.checkpoint.json"]


def test_parquet_merge_keeps_row_groups_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_base, "BLOCK_BYTES", 4096)
    writer = open_writer(tmp_path / "out.parquet", fingerprint="f")
    writer.open()
    for i in range(600):
        writer.write(i, {"V": np.full(16, i, dtype=np.float32)})  # 64 bytes a row
        if (i + 1) % 50 == 0:
            writer.commit(i + 1)
    writer.close()
    meta = pq.ParquetFile(tmp_path / "out.parquet").metadata
    assert meta.num_rows == 600
    assert meta.num_row_groups > 1
    assert pq.read_table(tmp_path / "out.parquet").column("row").to_pylist() == list(range(600))


def test_parquet_writer_turns_a_row_of_other_dims_into_an_error(tmp_path: Path) -> None:
    writer = open_writer(tmp_path / "out.parquet", fingerprint="f", errors_path=tmp_path / "errors.jsonl")
    writer.open()
    writer.write(0, {"V": np.arange(3.0)})
    writer.write(1, {"V": np.arange(5.0)})  # another length: fine, the column is a list
    writer.write(2, {"V": np.zeros((1, 2))})
    writer.write(3, {"W": np.arange(3.0)})
    writer.commit(4)
    writer.close()
    assert pq.read_table(tmp_path / "out.parquet").to_pydict() == {"row": [0, 1], "V": [[0, 1, 2], [0, 1, 2, 3, 4]]}
    errors = [json.loads(line) for line in (tmp_path / "errors.jsonl").read_text().splitlines()]
    assert [(e["row"], e["error"]) for e in errors] == [(2, "OutputShapeError"), (3, "OutputShapeError")]
    assert "2 dims" in errors[0]["message"]
    assert "outputs W differ" in errors[1]["message"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_order_and_commit_rules(fmt: str, tmp_path: Path) -> None:
    writer = writer_for(fmt, tmp_path)
    writer.open()
    writer.write(0, outputs_of(0))
    with pytest.raises(ValueError, match="row 0 came where"):
        writer.write(0, outputs_of(0))
    with pytest.raises(ValueError, match="would write it again"):
        writer.commit(0)
    writer.write_error(1, "bad")
    with pytest.raises(RuntimeError, match="commit them first"):
        writer.close()
    writer.commit(2)
    writer.close()
    with pytest.raises(CheckpointMismatch, match="fingerprint 'job-1'"):
        writer_for(fmt, tmp_path, fingerprint="job-2").open()


def assert_same_output(fmt: str, got: Path, want: Path) -> None:
    if fmt == "npy":
        np.testing.assert_array_equal(read_output(fmt, got), read_output(fmt, want))
    elif fmt == "parquet":
        assert read_output(fmt, got).equals(read_output(fmt, want))
    else:
        assert (got / "out.jsonl").read_bytes() == (want / "out.jsonl").read_bytes()
    assert (got / "errors.jsonl").read_bytes() == (want / "errors.jsonl").read_bytes()


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_run_given_up_without_commit_resumes_to_the_uninterrupted_output(fmt: str, tmp_path: Path) -> None:
    rows = 60
    whole, crashed = tmp_path / "whole", tmp_path / "crashed"
    whole.mkdir()
    crashed.mkdir()
    assert run_job(fmt, whole, rows) == 0
    # Each run writes rows past its last commit and stops there; the next resumes at that commit.
    starts = [run_job(fmt, crashed, rows, stop_at=stop) for stop in (5, 23, 24, 40, 59)]
    assert starts == [0, 0, 21, 21, 35]
    assert run_job(fmt, crashed, rows) == 56
    assert_same_output(fmt, crashed, whole)
    again = writer_for(fmt, crashed)
    assert again.open() == rows
    assert again.rows_written + again.errors_written == rows
    assert again.errors_written == sum(fails(i) for i in range(rows))
    again.close()


# A job killed with SIGKILL at random points: rows 0..n-1 as in run_job, committing every 7 rows.
WORKER = """
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[3])
from test_jobs_formats import run_job
run_job(sys.argv[1], Path(sys.argv[2]), int(sys.argv[4]))
"""
KILL_ROWS = 1200
DEADLINE_S = 120.0  # a bound on waiting for the worker's progress, never a synchronisation delay


def _committed_rows(checkpoint: Path) -> int:
    try:
        return int(json.loads(checkpoint.read_text())["rows"])
    except (FileNotFoundError, json.JSONDecodeError):
        return 0


# Parquet's commit protocol (a part file per commit) gets the most kill points.
@pytest.mark.parametrize(("fmt", "kill_points"), [("npy", 3), ("parquet", 5)])
def test_killed_at_random_points_every_row_lands_exactly_once(fmt: str, kill_points: int, tmp_path: Path) -> None:
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    whole.mkdir()
    killed.mkdir()
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    tests_dir = str(Path(__file__).resolve().parent)
    command = [sys.executable, str(script), fmt, str(killed), tests_dir, str(KILL_ROWS)]
    checkpoint = killed / f"out.{fmt}.checkpoint.json"
    rng = random.Random(9)
    targets = sorted(rng.sample(range(50, KILL_ROWS // 2), kill_points))
    kills = 0
    for target in targets:
        proc = subprocess.Popen(command)
        try:
            deadline = time.monotonic() + DEADLINE_S
            while _committed_rows(checkpoint) < target and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.001)
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                kills += 1
        finally:
            proc.wait()
    assert kills == len(targets), f"only {kills} of {len(targets)} runs were still going when their kill point came"
    assert not json.loads(checkpoint.read_text())["complete"]
    assert subprocess.run(command, check=False, timeout=DEADLINE_S).returncode == 0
    run_job(fmt, whole, KILL_ROWS)
    assert_same_output(fmt, killed, whole)
    assert json.loads(checkpoint.read_text())["complete"]
    assert sorted(os.listdir(killed)) == sorted(os.listdir(whole))
