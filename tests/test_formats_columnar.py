"""The columnar side of the scoring job's files: readers' ``chunks()`` give what iteration gives, a chunk at a time
(columns where the rows allow, row by row where they do not), and writers' ``write_rows()`` make the same bytes as
``write()`` row by row. Pure file tests: no server."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from triton_npu_client._jobs.formats import BadRow, ColumnChunk, _base, open_writer, read_rows

SIZES = (1, 7, 64)


def same(a: Any, b: Any) -> bool:
    """Equal values of the same types (arrays: dtype and shape too; NaN equals NaN)."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (
            isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape
            and bool(np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"))
        )
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b or (a != a and b != b))


def check_chunks(path: Path, names: list[str], starts: tuple[int, ...] = (0, 3), **kw: Any) -> list[ColumnChunk]:
    """Assert that chunks() of every size gives, row for row, what iterating the reader gives; return the chunks
    (of the first start, size 7)."""
    kept: list[ColumnChunk] = []
    for start in starts:
        want = list(read_rows(path, input_names=names, start=start, **kw))
        for size in SIZES:
            source = read_rows(path, input_names=names, start=start, **kw)
            got: list[Any] = []
            chunks = list(source.chunks(size))
            for k, chunk in enumerate(chunks):
                assert chunk.start == start + len(got)
                assert chunk.length == size or (k == len(chunks) - 1 and 0 < chunk.length < size)
                if chunk.columns is None:
                    assert chunk.rows is not None
                    assert len(chunk.rows) == chunk.length
                else:
                    assert all(len(column) == chunk.length for column in chunk.columns.values())
                got += [chunk.row(i) for i in range(chunk.length)]
            assert len(got) == len(want), (path.name, start, size)
            for i, (g, w) in enumerate(zip(got, want, strict=True)):
                assert same(g, w), (path.name, start, size, start + i, g, w)
            if (start, size) == (starts[0], 7):
                kept = chunks
    return kept


def columnar(chunks: list[ColumnChunk]) -> list[bool]:
    return [chunk.columns is not None for chunk in chunks]


# --- readers --------------------------------------------------------------------------------------------------------


def test_jsonl_chunks_are_columns_of_objects_and_bare_values(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"X": rng.random(4).tolist(), "id": i, "T": f"é{i}"}) + "\n" for i in range(30)))
    chunks = check_chunks(path, ["X", "T"])
    assert all(columnar(chunks))
    assert set(chunks[0].columns or ()) == {"X", "T"}  # "id" is no input: not a column
    assert chunks[0].columns is not None
    assert chunks[0].columns["X"][2] == json.loads(path.read_text().splitlines()[2])["X"]
    assert all(columnar(check_chunks(path, [])))  # no names: the objects as they are
    bare = tmp_path / "bare.jsonl"
    bare.write_text("".join(f"[{i}, {i}.5]\n" for i in range(20)))
    assert all(columnar(check_chunks(bare, ["X"])))
    assert not any(columnar(check_chunks(bare, ["X", "Y"])))  # a bare value for two inputs: BadRows


def test_jsonl_chunks_with_bad_lines_give_the_same_bad_rows(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    good = [json.dumps({"X": [i, i + 1]}).encode() for i in range(40)]
    lines = [
        b'\xef\xbb\xbf{"X": [0, 1]}',  # a BOM on line 1
        b"",  # blank lines are no rows
        b'"bare"',
        b"{broken",
        b'{"x": 1}',  # no key names an input
        b'{"X": "\xff"}',  # not UTF-8
        *good[:10],
        # Lines that are no single value each, though together they would parse: each a BadRow of its own.
        b'{"X": [1, 2]}, {"X": [3, 4]}',
        b'{"X": [5',
        b'6]}',
        b'{"X": "a',
        b'b"}',
        *good[10:20],
        b'{"X": "' + b"x" * 300 + b'"}',  # longer than max_line_bytes
        *good[20:],
        b"\x00[1]",
        b'{"X": [7, 8]}',  # no final newline
    ]
    path.write_bytes(b"\n".join(lines))
    chunks = check_chunks(path, ["X"], starts=(0, 5, 17), max_line_bytes=200)
    flags = columnar(chunks)
    assert not flags[0]  # the bad lines' chunks go row by row
    assert any(flags)  # and the good stretches as columns
    rows = [chunks[k].row(i) for k in range(len(chunks)) for i in range(chunks[k].length)]
    assert isinstance(rows[15], BadRow)
    assert rows[15].reason.startswith("line 17: invalid JSON: Extra data")
    assert [isinstance(r, BadRow) for r in rows[15:20]] == [True] * 5
    too_long = rows[30]
    assert isinstance(too_long, BadRow)
    assert "max_line_bytes" in too_long.reason


def test_text_chunks_are_one_array_of_lines(tmp_path: Path) -> None:
    path = tmp_path / "in.txt"
    path.write_bytes(b"\xef\xbb\xbfa first\r\n" + b"".join(f"line {i} \xe9\n".encode() for i in range(40)) + b"\n\r\n"
                     + b"cr\r\r\nlast")
    chunks = check_chunks(path, ["TEXT"])
    assert all(columnar(chunks))
    assert chunks[0].columns is not None
    column = chunks[0].columns["TEXT"]
    assert isinstance(column, np.ndarray)
    assert column.dtype == object
    assert column[0] == "a first"
    check_chunks(path, [])  # no names: bare strings, row by row
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"".join(f"ok {i}\n".encode() for i in range(20)) + b"\xff\n" + b"y" * 500 + b"\nend\n")
    chunks = check_chunks(bad, ["TEXT"], starts=(0, 19), max_line_bytes=100)
    assert columnar(chunks) == [True, True, False, False]  # rows 20 (not UTF-8) and 21 (too long) in chunk 3


def test_csv_chunks_are_columns_when_every_record_is_good(tmp_path: Path) -> None:
    path = tmp_path / "in.csv"
    path.write_text("TEXT,N,V\n" + "".join(f'"t,{i}",{i},"[{i}, 1.5]"\n' for i in range(20)))
    assert all(columnar(check_chunks(path, ["TEXT", "N", "V"], string_inputs={"TEXT"})))
    bad = tmp_path / "bad.csv"
    bad.write_text("TEXT,N\n" + "".join(f"t{i},{i}\n" for i in range(10)) + "only one cell\n" + "u,1\n" * 10)
    assert columnar(check_chunks(bad, ["TEXT", "N"])) == [True, False, True]


def test_npy_chunks_are_slices_of_the_array(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_base, "BLOCK_BYTES", 100)  # iteration reads in small blocks; chunks do not follow them
    data = np.arange(50 * 3 * 2, dtype=np.float32).reshape(50, 3, 2)
    for name, array in [
        ("c.npy", data),
        ("fortran.npy", np.asfortranarray(data)),
        ("flat.npy", np.arange(50, dtype=np.int16)),
        ("empty_rows.npy", np.zeros((20, 0), dtype=np.float64)),
    ]:
        path = tmp_path / name
        np.save(path, array)
        chunks = check_chunks(path, ["X"])
        assert all(columnar(chunks))
        assert chunks[0].columns is not None
        column = chunks[0].columns["X"]
        assert isinstance(column, np.ndarray)
        np.testing.assert_array_equal(column, array[:7])
        check_chunks(path, [])


def test_parquet_chunks_are_arrays_and_nulls_or_ragged_lists_go_row_by_row(tmp_path: Path) -> None:
    n = 40
    table = pa.table({
        "N": pa.array(range(n), type=pa.int32()),
        "F": pa.array([i / 4 for i in range(n)], type=pa.float32()),
        "B": [i % 2 == 0 for i in range(n)],
        "FIXED": pa.array([[float(i), -float(i)] for i in range(n)], type=pa.list_(pa.float64(), 2)),
        "LIST": [[i, i + 1, i + 2] for i in range(n)],
        "TEXT": [f"t{i}" for i in range(n)],
        "NESTED": [[[i], [i]] for i in range(n)],
        "id": list(range(n)),
    })
    path = tmp_path / "in.parquet"
    pq.write_table(table, path, row_group_size=9)
    inputs = ["N", "F", "B", "FIXED", "LIST", "TEXT", "NESTED"]
    chunks = check_chunks(path, inputs, starts=(0, 3, 10, 39, 40))
    assert all(columnar(chunks))
    assert chunks[0].columns is not None
    assert chunks[0].columns["LIST"].shape == (7, 3)
    assert chunks[0].columns["FIXED"].dtype == np.float64
    assert chunks[0].columns["TEXT"].dtype == object
    assert all(columnar(check_chunks(path, [])))
    ragged = table.set_column(4, "LIST", pa.array([[0] * (1 + (i == 20)) for i in range(n)]))
    nulls = table.set_column(0, "N", pa.array([None if i == 30 else i for i in range(n)], type=pa.int32()))
    inner_null = pa.array([[None] if i == 2 else [i] for i in range(n)], type=pa.list_(pa.int64()))
    inner = table.set_column(4, "LIST", inner_null)
    for name, changed, row in (("ragged", ragged, 20), ("nulls", nulls, 30), ("inner", inner, 2)):
        path = tmp_path / f"{name}.parquet"
        pq.write_table(changed, path, row_group_size=9)
        chunks = check_chunks(path, inputs, starts=(0, 3))
        assert columnar(chunks) == [k != row // 7 for k in range(math.ceil(n / 7))], name
    # A null inside a list makes its row bad; the other rows keep the list's integers (not NaN-able floats).
    rows = list(read_rows(tmp_path / "inner.parquet", input_names=inputs))
    assert rows[2] == BadRow("row 2: column 'LIST' holds a null")
    assert rows[3]["LIST"].dtype == np.int64


# --- writers --------------------------------------------------------------------------------------------------------


def outputs_of(start: int, n: int) -> dict[str, np.ndarray]:
    """Rows start..start+n-1: a float vector with NaN and inf, an int matrix, a text (BYTES) value and a bool."""
    rows = np.arange(start, start + n)
    emb = (np.arange(4, dtype=np.float32)[None, :] + rows[:, None]) / 8
    emb[rows % 9 == 0, 1] = np.nan
    emb[rows % 13 == 0, 2] = -np.inf
    label = np.empty(n, dtype=object)
    label[:] = [f'label-{i}-é "q", [x]'.encode() + b"\x00" * (i % 2) for i in rows]
    return {
        "EMB": emb,
        "IDS": np.repeat(rows[:, None, None], 6, axis=1).reshape(n, 2, 3).astype(np.int64),
        "LABEL": label,
        "OK": rows % 3 == 0,
    }


# (kind, first row, rows): runs of good rows, failures, commits; the same job row by row or a run at a time.
PLAN = [("rows", 0, 5), ("error", 5, 1), ("rows", 6, 1), ("commit", 7, 0), ("rows", 7, 40), ("error", 47, 2),
        ("rows", 49, 3), ("commit", 52, 0), ("rows", 52, 200), ("error", 252, 1), ("commit", 253, 0)]


def run_plan(fmt: str, folder: Path, put: Callable[[Any, int, dict[str, np.ndarray]], None]) -> dict[str, bytes]:
    """Run PLAN into ``folder``; return the checkpoint after each commit and every file at the end."""
    folder.mkdir()
    output = {"npy": "EMB", "parquet": None, "jsonl": None}[fmt]
    writer = open_writer(folder / f"out.{fmt}", fingerprint="job", errors_path=folder / "errors.jsonl", output=output)
    writer.open()
    seen: dict[str, bytes] = {}
    for kind, start, n in PLAN:
        if kind == "rows":
            put(writer, start, outputs_of(start, n))
        elif kind == "error":
            for i in range(start, start + n):
                writer.write_error(i, ValueError(f"row {i} is bad"), {"TEXT": f"input {i}"})
        else:
            writer.commit(start)
            seen[f"checkpoint@{start}"] = writer.checkpoint_path.read_bytes()
            seen[f"out@{start}"] = (folder / f"out.{fmt}").read_bytes() if fmt != "parquet" else b""
    writer.close()
    for path in sorted(folder.iterdir()):
        seen[path.name] = path.read_bytes()
    return seen


def row_by_row(writer: Any, start: int, outputs: dict[str, np.ndarray]) -> None:
    for i in range(len(outputs["EMB"])):
        writer.write(start + i, {name: value[i] for name, value in outputs.items()})


def whole_runs(writer: Any, start: int, outputs: dict[str, np.ndarray]) -> None:
    writer.write_rows(start, outputs)


@pytest.mark.parametrize("fmt", ["jsonl", "npy", "parquet"])
def test_write_rows_makes_the_bytes_that_write_makes_row_by_row(
    fmt: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_base, "BLOCK_BYTES", 3000)  # Parquet flushes inside runs: row groups must match too
    by_row = run_plan(fmt, tmp_path / "rows", row_by_row)
    by_run = run_plan(fmt, tmp_path / "runs", whole_runs)
    assert by_run.keys() == by_row.keys()
    for name in by_row:
        assert by_run[name] == by_row[name], name
    if fmt == "jsonl":
        # The text json.dumps gives each row's record, as the writer always wrote it.
        want = []
        for kind, start, n in PLAN:
            runs = outputs_of(start, n) if kind == "rows" else {}
            for i in range(n if runs else 0):
                values = {name: run[i] for name, run in runs.items()}
                record = {k: v.decode() if isinstance(v, bytes) else v.tolist() for k, v in values.items()}
                want.append(json.dumps({"row": start + i, **record}, ensure_ascii=False))
        assert by_run["out.jsonl"].decode().splitlines() == want
        lines = [json.loads(line) for line in by_row["out.jsonl"].decode().splitlines()]
        first = lines[0]
        assert first.pop("EMB")[::2] == [0.0, -math.inf]  # [1] is NaN
        assert first == {"row": 0, "IDS": [[0, 0, 0], [0, 0, 0]], "LABEL": 'label-0-é "q", [x]', "OK": True}
    if fmt == "parquet":
        meta = pq.ParquetFile(tmp_path / "runs" / "out.parquet").metadata
        assert meta.num_row_groups > 1
        table = pq.read_table(tmp_path / "runs" / "out.parquet")
        assert table.column("LABEL").to_pylist()[1] == 'label-1-é "q", [x]\x00'  # a trailing NUL kept
    if fmt == "npy":
        array = np.load(tmp_path / "runs" / "out.npy")
        assert array.shape == (253, 4)
        np.testing.assert_array_equal(array[7:47], outputs_of(7, 40)["EMB"])
        assert np.isnan(array[5]).all()


def test_write_rows_turns_a_misfit_run_into_error_rows_and_checks_its_arguments(tmp_path: Path) -> None:
    writer = open_writer(tmp_path / "out.npy", fingerprint="f", errors_path=tmp_path / "errors.jsonl")
    writer.open()
    writer.write_rows(0, {"V": np.zeros((3, 2), dtype=np.float32)})
    writer.write_rows(3, {"V": np.zeros((2, 5), dtype=np.float32)})  # another row shape: both rows fail
    writer.write_rows(5, {"V": np.zeros((0, 2), dtype=np.float32)})  # no rows: nothing
    with pytest.raises(ValueError, match="one row count"):
        writer.write_rows(5, {"V": np.float32(1)})
    with pytest.raises(ValueError, match="row 4 came where row 5 was due"):
        writer.write_rows(4, {"V": np.zeros((1, 2), dtype=np.float32)})
    writer.commit(5)
    writer.close()
    errors = [json.loads(line) for line in (tmp_path / "errors.jsonl").read_text().splitlines()]
    assert [(e["row"], e["error"]) for e in errors] == [(3, "OutputShapeError"), (4, "OutputShapeError")]
    assert "shape (5,)" in errors[0]["message"]
    assert np.load(tmp_path / "out.npy").shape == (5, 2)
    jsonl = open_writer(tmp_path / "out.jsonl", fingerprint="f")
    jsonl.open()
    with pytest.raises(ValueError, match=r"A: 2, B: 3"):
        jsonl.write_rows(0, {"A": np.zeros(2), "B": np.zeros(3)})
    jsonl.abandon()
