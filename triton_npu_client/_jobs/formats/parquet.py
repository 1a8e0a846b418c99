"""Parquet in and out, through pyarrow (an optional extra)."""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from .._checkpoint import ResumableOutput, SavedCheckpoint
from ._base import (
    MAX_BATCH_ROWS,
    BadRow,
    ColumnChunk,
    Row,
    RowSource,
    Writer,
    block_bytes,
    fsync_path,
    pyarrow_modules,
)


def _is_plain_number_type(pa: Any, t: Any) -> bool:
    return bool(pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t))


class ParquetSource(RowSource):
    """Parquet through pyarrow: batches of whole rows; only the columns named after model inputs are read."""

    format = "parquet"

    def __init__(self, path: Path, input_names: tuple[str, ...], start: int) -> None:
        self._pa, self._pq = pyarrow_modules()
        super().__init__(path, input_names, start)
        with self._pq.ParquetFile(path) as pf:
            names: list[str] = list(pf.schema_arrow.names)
            meta = pf.metadata
            self._group_rows = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
            rows, nbytes = meta.num_rows, sum(meta.row_group(g).total_byte_size for g in range(meta.num_row_groups))
        if not input_names:
            self._columns = [(name, name) for name in names]
        else:
            self._columns = [(name, name) for name in names if name in input_names]
            if not self._columns:
                if len(input_names) == 1 and len(names) == 1:
                    self._columns = [(names[0], input_names[0])]
                else:
                    raise ValueError(
                        f"{path}: no column ({', '.join(names)}) is an input of the model ({', '.join(input_names)})"
                    )
        self._batch_rows = max(1, min(MAX_BATCH_ROWS, block_bytes() * max(rows, 1) // max(nbytes, 1)))

    def _count(self) -> int:
        return sum(self._group_rows)

    def _batches(self) -> Iterator[Any]:
        """Record batches of the input columns from ``start`` on; whole row groups before it are never read (their
        row counts are in the footer)."""
        group, skip = 0, self.start
        while group < len(self._group_rows) and skip >= self._group_rows[group]:
            skip -= self._group_rows[group]
            group += 1
        if group == len(self._group_rows):
            return
        with self._pq.ParquetFile(self.path) as pf:
            batches = pf.iter_batches(
                batch_size=self._batch_rows, row_groups=list(range(group, len(self._group_rows))),
                columns=[c for c, _ in self._columns],
            )
            for batch in batches:
                if skip:
                    if batch.num_rows <= skip:
                        skip -= batch.num_rows
                        continue
                    batch, skip = batch.slice(skip), 0
                yield batch

    def _rows(self) -> Iterator[Row | BadRow]:
        index = self.start
        for batch in self._batches():
            yield from self._rows_of(batch.columns, batch.num_rows, index)
            index += batch.num_rows

    def _rows_of(self, arrays: Sequence[Any], n: int, index: int) -> Iterator[Row | BadRow]:
        """The rows of the input columns ``arrays`` (``n`` rows, the first at ``index``), one by one."""
        columns = [self._values(col) for col in arrays]
        for r in range(n):
            row: dict[str, Any] = {}
            for (column, name), (values, nulls) in zip(self._columns, columns, strict=True):
                if nulls is not None and nulls[r]:
                    yield BadRow(f"row {index + r}: column {column!r} {'is' if nulls[r] == 1 else 'holds a'} null")
                    break
                row[name] = values[r]
            else:
                yield row

    def _chunks(self, size: int) -> Iterator[ColumnChunk]:
        # Batches are sliced (no copy) into pieces of exactly `size` rows; a chunk that spans batches is concatenated.
        index, pieces, have = self.start, [], 0
        for batch in self._batches():
            while batch.num_rows:
                take = min(size - have, batch.num_rows)
                pieces.append(batch.slice(0, take))
                batch, have = batch.slice(take), have + take
                if have == size:
                    yield self._chunk(index, pieces)
                    index, pieces, have = index + have, [], 0
        if pieces:
            yield self._chunk(index, pieces)

    def _chunk(self, start: int, pieces: list[Any]) -> ColumnChunk:
        n = sum(piece.num_rows for piece in pieces)
        arrays = [
            self._pa.concat_arrays([piece.column(k) for piece in pieces]) if len(pieces) > 1 else pieces[0].column(k)
            for k in range(len(self._columns))
        ]
        columns: dict[str, Any] = {}
        for (_, name), col in zip(self._columns, arrays, strict=True):
            values = self._column_values(col)
            if values is None:
                return ColumnChunk(start, n, None, list(self._rows_of(arrays, n, start)))
            columns[name] = values
        return ColumnChunk(start, n, columns)

    def _column_values(self, col: Any) -> Any:
        """A whole column as one array whose rows are what :meth:`_values` gives row by row: numbers 1-D, lists of
        numbers of one length 2-D, text an object array; None for a column with a null or lists of several lengths.
        """
        pa = self._pa
        if col.null_count:
            return None
        t = col.type
        if _is_plain_number_type(pa, t):
            return col.to_numpy(zero_copy_only=False)
        if (pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)) and (
            _is_plain_number_type(pa, t.value_type)
        ):
            flat = col.flatten()
            lengths = col.value_lengths().to_numpy(zero_copy_only=False)
            if flat.null_count or (lengths != lengths[0]).any():
                return None
            return flat.to_numpy(zero_copy_only=False).reshape(len(col), int(lengths[0]))
        if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t) or pa.types.is_large_binary(t):
            return col.to_numpy(zero_copy_only=False)
        return col.to_pylist()

    def _values(self, col: Any) -> tuple[Sequence[Any], npt.NDArray[Any] | None]:
        """A column's values by row (numpy for numbers and lists of numbers), and when it has nulls, by row: 0 none,
        1 null, 2 a list holding a null."""
        pa = self._pa
        nulls = col.is_null().to_numpy(zero_copy_only=False) if col.null_count else None
        t = col.type
        if _is_plain_number_type(pa, t):
            # Without the fill, a null turns a whole integer column into floats.
            filled = col.fill_null(False if pa.types.is_boolean(t) else 0) if nulls is not None else col
            return filled.to_numpy(zero_copy_only=False), nulls
        if (pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)) and (
            _is_plain_number_type(pa, t.value_type)
        ):
            if not col.flatten().null_count:
                return col.to_numpy(zero_copy_only=False), nulls
            # A null inside a list: its row is bad, and the others keep their own dtype (a whole-column to_numpy()
            # would turn every list of integers into floats, the more so the more rows share a batch).
            dtype = t.value_type.to_pandas_dtype()
            lists = col.to_pylist()
            inner = np.array([v is not None and None in v for v in lists], dtype=np.uint8) * 2
            values = [None if v is None or None in v else np.array(v, dtype=dtype) for v in lists]
            return values, inner if nulls is None else np.maximum(inner, nulls)
        return col.to_pylist(), nulls


class ParquetWriter(Writer):
    """Rows go to ``<output>.parts/part-NNNNNN.parquet``, one part per commit (row groups of bounded size inside);
    the checkpoint records how many parts are committed. ``close()`` streams the parts' row groups into the final
    file (through a temporary name, replaced atomically), then removes the parts."""

    format = "parquet"

    def __init__(self, path: Path, *, fingerprint: str, errors_path: Path | None, output: str | None) -> None:
        self._pa, self._pq = pyarrow_modules()
        self.parts_dir = path.with_name(path.name + ".parts")
        super().__init__(path, fingerprint=fingerprint, errors_path=errors_path, output=output)
        self._schema: Any = None
        self._parts = 0
        self._buffer: list[tuple[int, int, Mapping[str, npt.NDArray[Any]]]] = []  # runs: first row, rows, outputs
        self._buffer_bytes = 0
        self._buffer_rows = 0
        self._part_writer: Any = None

    def _resumable(self) -> ResumableOutput:
        return ResumableOutput(
            None, fingerprint=self.fingerprint, errors_path=self.errors_path, checkpoint_path=self.checkpoint_path
        )

    def _part(self, k: int) -> Path:
        return self.parts_dir / f"part-{k:06d}.parquet"

    def extra_paths(self) -> list[tuple[str, Path]]:
        return [("parts", self.parts_dir), ("merging", self._merging())]

    def _verify_format(self, saved: SavedCheckpoint, mismatch: Any) -> None:
        if saved.complete:
            return
        parts = int(saved.meta.get("parts", 0))
        for k in range(parts):
            if not self._part(k).is_file():
                raise mismatch(f"records {parts} committed parts, but {self._part(k)} is missing", self.parts_dir)
        if parts == 0 and int(saved.meta.get("rows_written", 0)) > 0:
            raise mismatch(f"counts {saved.meta['rows_written']:,} rows written, but no committed part")

    def _forget(self) -> None:
        self._tidy_finished()
        self._merging().unlink(missing_ok=True)

    def _merging(self) -> Path:
        return self.path.with_name(self.path.name + ".merging")

    def _resume(self, meta: Mapping[str, Any]) -> None:
        self._parts = int(meta.get("parts", 0))
        self.parts_dir.mkdir(exist_ok=True)
        committed = {self._part(k).name for k in range(self._parts)}
        for leftover in self.parts_dir.glob("part-*.parquet"):
            if leftover.name not in committed:  # written after the last commit: redone by this run
                leftover.unlink()
        self._merging().unlink(missing_ok=True)
        if self._parts:
            self._schema = self._pq.read_schema(self._part(0))

    def _meta(self) -> dict[str, Any]:
        return {"parts": self._parts}

    def _settle(self, outputs: Mapping[str, npt.NDArray[Any]]) -> None:
        pa = self._pa
        if "row" in outputs:
            raise ValueError("an output named 'row' clashes with the row index column: choose the outputs")
        fields = [pa.field("row", pa.int64(), nullable=False)]
        for name, run in outputs.items():
            if run.dtype.kind in "OSU":
                leaf = pa.string()
            elif run.dtype.kind in "biuf":
                leaf = pa.from_numpy_dtype(run.dtype)
            else:
                raise TypeError(f"output {name!r} has dtype {run.dtype}, which Parquet output does not take")
            for _ in range(run.ndim - 1):
                leaf = pa.list_(leaf)
            fields.append(pa.field(name, leaf))
        self._schema = pa.schema(fields)

    def _write_run(self, start: int, n: int, outputs: Mapping[str, npt.NDArray[Any]]) -> str | None:
        if self._schema is None:
            self._settle(outputs)
        names = self._schema.names[1:]
        if set(outputs) != set(names):
            return f"outputs {', '.join(outputs)} differ from the first row's ({', '.join(names)})"
        for name in names:
            problem = self._mismatch(name, outputs[name])
            if problem is not None:
                return problem
        # Buffered and flushed where row by row it would be, so that the row groups, and the file, are the same.
        row_bytes = sum(
            v.dtype.itemsize * math.prod(v.shape[1:]) if v.dtype.kind != "O" else 64 * math.prod(v.shape[1:])
            for v in outputs.values()
        )
        done = 0
        while done < n:
            take = min(n - done, MAX_BATCH_ROWS - self._buffer_rows)
            if row_bytes:
                take = min(take, -(-(block_bytes() - self._buffer_bytes) // row_bytes))
            self._buffer.append((start + done, take, {name: v[done : done + take] for name, v in outputs.items()}))
            self._buffer_rows += take
            self._buffer_bytes += take * row_bytes
            done += take
            if self._buffer_bytes >= block_bytes() or self._buffer_rows >= MAX_BATCH_ROWS:
                self._flush()
        return None

    def _mismatch(self, name: str, run: npt.NDArray[Any]) -> str | None:
        pa = self._pa
        leaf, ndim = self._schema.field(name).type, 0
        while pa.types.is_list(leaf):
            leaf, ndim = leaf.value_type, ndim + 1
        if run.ndim - 1 != ndim:
            return f"output {name!r} has {run.ndim - 1} dims, but the Parquet column has {ndim} (the first row's)"
        if pa.types.is_string(leaf):
            ok = run.dtype.kind in "OSU"
        else:
            ok = run.dtype.kind in "biuf" and np.can_cast(run.dtype, leaf.to_pandas_dtype(), casting="safe")
        if not ok:
            return f"output {name!r} has dtype {run.dtype}, but the Parquet column is {leaf} (the first row's)"
        return None

    def _column(self, runs: list[npt.NDArray[Any]], name: str) -> Any:
        """Nested Arrow lists built from offsets (no per-element Python work for numbers)."""
        pa = self._pa
        leaf_type = self._schema.field(name).type
        ndim = 0
        while pa.types.is_list(leaf_type):
            leaf_type, ndim = leaf_type.value_type, ndim + 1
        if pa.types.is_string(leaf_type):
            leaves = pa.array(
                [s.decode("utf-8", "replace") if isinstance(s, bytes) else str(s)
                 for run in runs for s in run.reshape(-1).tolist()],
                type=pa.string(),
            )
        else:
            dtype = leaf_type.to_pandas_dtype()
            flat = np.concatenate([np.asarray(run, dtype=dtype).reshape(-1) for run in runs])
            leaves = pa.array(flat, type=leaf_type)
        for level in reversed(range(ndim)):
            # A run's rows share one shape: at this level, prod(shape[:level + 1]) lists of shape[level + 1] each.
            lengths = np.concatenate(
                [np.full(math.prod(run.shape[: level + 1]), run.shape[level + 1], dtype=np.int64) for run in runs]
            )
            offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
            np.cumsum(lengths, out=offsets[1:])
            leaves = pa.ListArray.from_arrays(pa.array(offsets, type=pa.int32()), leaves)
        return leaves

    def _flush(self) -> None:
        if not self._buffer:
            return
        pa = self._pa
        names = self._schema.names[1:]
        index = np.concatenate([np.arange(start, start + n, dtype=np.int64) for start, n, _ in self._buffer])
        columns = [pa.array(index, type=pa.int64())]
        columns += [self._column([run[name] for _, _, run in self._buffer], name) for name in names]
        table = pa.Table.from_arrays(columns, schema=self._schema)
        if self._part_writer is None:
            self._part_writer = self._pq.ParquetWriter(self._part(self._parts), self._schema)
        self._part_writer.write_table(table, row_group_size=table.num_rows)
        self._buffer, self._buffer_bytes, self._buffer_rows = [], 0, 0

    def _before_commit(self) -> None:
        self._flush()
        if self._part_writer is not None:
            self._part_writer.close()
            self._part_writer = None
            fsync_path(self._part(self._parts))
            fsync_path(self.parts_dir)
            self._parts += 1

    def _finish(self) -> None:
        pa, pq = self._pa, self._pq
        schema = self._schema if self._schema is not None else pa.schema([pa.field("row", pa.int64(), nullable=False)])
        merging = self._merging()
        with pq.ParquetWriter(merging, schema) as out:
            group: list[Any] = []
            group_bytes = 0
            for k in range(self._parts):
                with pq.ParquetFile(self._part(k)) as part:
                    for g in range(part.num_row_groups):
                        table = part.read_row_group(g)
                        group.append(table)
                        group_bytes += table.nbytes
                        if group_bytes >= block_bytes():
                            merged = pa.concat_tables(group)
                            out.write_table(merged, row_group_size=merged.num_rows)
                            group, group_bytes = [], 0
            if group:
                merged = pa.concat_tables(group)
                out.write_table(merged, row_group_size=merged.num_rows)
        fsync_path(merging)
        os.replace(merging, self.path)
        fsync_path(self.path.parent)

    def _release(self) -> None:
        if self._part_writer is not None:
            self._part_writer.close()  # an uncommitted part: the next open() removes it
            self._part_writer = None
        self._buffer, self._buffer_bytes, self._buffer_rows = [], 0, 0

    def _tidy_finished(self) -> None:
        if self.parts_dir.is_dir():
            for part in self.parts_dir.glob("part-*.parquet"):
                part.unlink()
            with contextlib.suppress(OSError):  # something else in there: leave it
                self.parts_dir.rmdir()

