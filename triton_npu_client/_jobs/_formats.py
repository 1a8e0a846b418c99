"""The files of a scoring job: streaming readers of input rows, and resumable writers of results and errors.

Readers (:func:`read_rows`) yield one row per input sample, in file order, from ``start`` on, holding a bounded
slice of the file in memory whatever its size. A row is a mapping from model input name to a value without the
batch dim; a row the reader cannot parse comes as :class:`BadRow` in its place, so indices stay aligned with the
file. A line longer than ``max_line_bytes`` (JSONL, CSV, ``.txt``; default :data:`MAX_LINE_BYTES`, 8 MiB) is a
:class:`BadRow` too: it is skipped in bounded reads up to its newline, never held in memory whole.

Formats: JSONL (an object per line, or a bare value for a single-input model), CSV (a header row of input
names), ``.npy`` (a row per leading index), ``.txt`` (a row per line) and Parquet (with pyarrow).

Writers (:func:`open_writer`) append results as rows finish and commit now and then through
:class:`ResumableOutput`: after a crash, ``open()`` cuts everything back to the last commit and returns the row to
resume at, so a re-run leaves every row in the output (or the errors file) exactly once. Formats: JSONL
(``{"row": i, "<OUTPUT>": value}`` per line), ``.npy`` (one output, a slot per input row; failed rows are NaN for
floats, 0 for integers) and Parquet (a ``row`` column plus a column per output; written as one part file per commit
and merged at close).
"""

from __future__ import annotations

import contextlib
import csv
import itertools
import json
import logging
import math
import os
import re
import struct
from abc import abstractmethod
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from functools import cached_property
from pathlib import Path
from types import TracebackType
from typing import IO, Any, ClassVar, Protocol, Self, TypeAlias

import attrs
import numpy as np
import numpy.typing as npt

from ._checkpoint import ResumableOutput, SavedCheckpoint
from ._safety import CheckpointFilesMismatch, UnknownFormatError

__all__ = [
    "MAX_LINE_BYTES",
    "PARQUET_HINT",
    "BadRow",
    "OutputShapeError",
    "ResultWriter",
    "Row",
    "RowSource",
    "input_fingerprint",
    "input_format",
    "open_writer",
    "output_format",
    "read_rows",
]

_log = logging.getLogger("triton_npu_client.jobs")

# A row: a mapping from model input name to one sample's value (``{"TEXT": "hi"}``), or, for a single-input model
# and no input names given, the bare value.
Row: TypeAlias = Any
PathLike: TypeAlias = "str | os.PathLike[str]"

PARQUET_HINT = "pip install 'triton-npu-client[parquet]'"

# How much of a file a reader or writer holds at once (a block of .npy rows, a Parquet batch or row group).
_BLOCK_BYTES = 8 << 20
_MAX_BATCH_ROWS = 65536
# An errors-file line keeps the input row only when it is this small once in JSON.
_MAX_INPUT_JSON = 2000
# A longer line (JSONL, CSV, .txt) is an error row, skipped without being held: one line never costs more memory.
MAX_LINE_BYTES = 8 << 20
_SKIP_BYTES = 1 << 20

_READ_FORMATS = {"jsonl": "jsonl", "ndjson": "jsonl", "csv": "csv", "npy": "npy", "txt": "txt", "text": "txt",
                 "parquet": "parquet", "pq": "parquet"}
_WRITE_FORMATS = {"jsonl": "jsonl", "ndjson": "jsonl", "npy": "npy", "parquet": "parquet", "pq": "parquet"}


@attrs.frozen
class BadRow:
    """A row the reader could not parse, in its place: ``reason`` names the line (or row) and the parse error."""

    reason: str


class OutputShapeError(ValueError):
    """A row's outputs do not fit the output file: another shape, dtype or set of outputs than the first row's."""


def _format_of(path: Path, given: str | None, known: Mapping[str, str], what: str) -> str:
    choices = ", ".join(sorted(set(known.values())))
    if given is not None:
        try:
            return known[given.lower().lstrip(".")]
        except KeyError:
            raise UnknownFormatError(
                f"unknown {what} format {given!r}: use one of {choices}", path=path, role=what
            ) from None
    try:
        return known[path.suffix.lower().lstrip(".")]
    except KeyError:
        raise UnknownFormatError(
            f"cannot tell the {what} format of {path} from its suffix {path.suffix or '(none)'!r}: pass format= "
            f"one of {choices} (--{what}-format on the command line)",
            path=path, role=what,
        ) from None


def input_format(path: PathLike, format: str | None = None) -> str:  # the contract's name
    """The input format :func:`read_rows` would use for ``path`` (or raise :class:`UnknownFormatError`)."""
    return _format_of(Path(path), format, _READ_FORMATS, "input")


def output_format(path: PathLike, format: str | None = None) -> str:  # the contract's name
    """The output format :func:`open_writer` would use for ``path`` (or raise :class:`UnknownFormatError`)."""
    return _format_of(Path(path), format, _WRITE_FORMATS, "output")


def input_fingerprint(path: PathLike, fmt: str, st: os.stat_result | None = None) -> str:
    """The input file's identity for a checkpoint: format, resolved path, size and mtime (a stat, no read)."""
    file = Path(path)
    st = file.stat() if st is None else st
    return f"{fmt}:{file.resolve()}:{st.st_size}:{st.st_mtime_ns}"


def _bounded_lines(f: IO[bytes], cap: int) -> Iterator[bytes | None]:
    """Each line of ``f`` (its newline kept), or None for a line whose content is longer than ``cap`` bytes.

    A long line is skipped with reads of at most ``_SKIP_BYTES`` up to its newline: memory stays bounded by ``cap``.
    """
    readline = f.readline
    limit = cap + 1
    while line := readline(limit):
        if len(line) < limit or line.endswith(b"\n"):
            yield line
            continue
        while (rest := readline(_SKIP_BYTES)) and not rest.endswith(b"\n"):
            pass
        yield None


def _too_long(where: str, cap: int) -> BadRow:
    return BadRow(f"{where}: longer than {cap:,} bytes (max_line_bytes): skipped")


def _pyarrow() -> tuple[Any, Any]:
    """``(pyarrow, pyarrow.parquet)``, or an ImportError that says which extra brings them."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as err:
        raise ImportError(f"Parquet files need pyarrow, which is not importable here ({err}): {PARQUET_HINT}") from err
    return pa, pq


# --- readers ------------------------------------------------------------------------------------------------------


def read_rows(
    path: PathLike,
    *,
    input_names: Sequence[str],
    format: str | None = None,  # the contract's name
    start: int = 0,
    string_inputs: Collection[str] = (),
    max_line_bytes: int = MAX_LINE_BYTES,
) -> RowSource:
    """Open ``path`` for streaming its rows from ``start`` on (0-based); the format comes from the suffix or ``format``.

    ``input_names``: the model's inputs. Rows are mappings keyed by them (keys or columns that are not inputs are
    dropped); a bare value (a ``.txt`` line, a ``.npy`` row, a JSONL line that is not an object) is keyed by the
    only input, and is a :class:`BadRow` for a model with several. With no names given, rows pass as they are.
    ``string_inputs``: inputs that take text (BYTES): their CSV cells stay strings (``"007"`` is not the number 7).
    ``max_line_bytes``: the longest line (JSONL, CSV, ``.txt``) read as a row; a longer one is a :class:`BadRow`.
    Parquet needs pyarrow (an ImportError names the extra to install).
    """
    file = Path(path)
    fmt = _format_of(file, format, _READ_FORMATS, "input")
    names = tuple(input_names)
    if start < 0:
        raise ValueError(f"start must be >= 0, got {start}")
    if max_line_bytes < 1:
        raise ValueError(f"max_line_bytes must be >= 1, got {max_line_bytes}")
    if fmt == "jsonl":
        return _JsonlSource(file, names, start, max_line_bytes)
    if fmt == "csv":
        return _CsvSource(file, names, start, frozenset(string_inputs), max_line_bytes)
    if fmt == "npy":
        return _NpySource(file, names, start)
    if fmt == "txt":
        return _TextSource(file, names, start, max_line_bytes)
    return _ParquetSource(file, names, start)


class RowSource(Iterable[Row | BadRow]):
    """The rows of an input file from ``start`` on; every iteration reads the file anew, holding a bounded part of it.

    ``total``: the number of rows in the file (all of them, ``start`` or not), or None when it is not cheap to know;
    computed on first use (a pass over the bytes for the text formats). ``fingerprint``: the file's identity
    (resolved path, size, mtime_ns, format), for telling a resumed job that its input changed.
    """

    format: ClassVar[str]

    def __init__(
        self, path: Path, input_names: tuple[str, ...], start: int, max_line_bytes: int = MAX_LINE_BYTES
    ) -> None:
        self.path = path
        self.input_names = input_names
        self.start = start
        self.max_line_bytes = max_line_bytes
        self.fingerprint = input_fingerprint(path, self.format)

    @cached_property
    def total(self) -> int | None:
        return self._count()

    def __iter__(self) -> Iterator[Row | BadRow]:
        return self._rows()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {str(self.path)!r} start={self.start}>"

    @abstractmethod
    def _rows(self) -> Iterator[Row | BadRow]: ...

    @abstractmethod
    def _count(self) -> int | None: ...

    def _keyed(self, value: Any, where: str) -> Row | BadRow:
        """Key a parsed value by the model's inputs (see :func:`read_rows`)."""
        names = self.input_names
        if isinstance(value, dict):
            if not names:
                return value
            picked = {k: v for k, v in value.items() if k in names}
            if value and not picked:
                return BadRow(
                    f"{where}: none of the keys ({', '.join(map(str, value))}) is an input of the model "
                    f"({', '.join(names)})"
                )
            return picked
        if len(names) == 1:
            return {names[0]: value}
        if not names:
            return value
        return BadRow(f"{where}: a bare value, but the model has inputs {', '.join(names)}: give an object")


def _single_input(path: Path, names: tuple[str, ...], fmt: str) -> None:
    if len(names) > 1:
        raise ValueError(
            f"{path}: a {fmt} file gives one value per row, but the model has inputs {', '.join(names)}: use "
            "JSONL, CSV or Parquet"
        )


def _strip_bom(line: bytes) -> bytes:
    return line[3:] if line.startswith(b"\xef\xbb\xbf") else line


def _count_newlines(path: Path) -> int:
    """Lines in a text file: newlines, plus a last line that has none."""
    count, last = 0, b""
    with open(path, "rb") as f:
        while chunk := f.read(_BLOCK_BYTES):
            count += chunk.count(b"\n")
            last = chunk[-1:]
    return count + (last not in (b"", b"\n"))


class _JsonlSource(RowSource):
    """JSONL: one JSON value per line; blank lines are no rows."""

    format = "jsonl"

    def _lines(self, f: IO[bytes]) -> Iterator[tuple[int, bytes | None]]:
        for lineno, line in enumerate(_bounded_lines(f, self.max_line_bytes), 1):
            if line is None:
                yield lineno, None  # too long: a row, whatever it held
                continue
            if lineno == 1:
                line = _strip_bom(line)
            if line.strip():
                yield lineno, line

    def _rows(self) -> Iterator[Row | BadRow]:
        with open(self.path, "rb") as f:
            for lineno, line in itertools.islice(self._lines(f), self.start, None):
                if line is None:
                    yield _too_long(f"line {lineno}", self.max_line_bytes)
                    continue
                try:
                    value = json.loads(line)
                except (ValueError, RecursionError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
                    yield BadRow(f"line {lineno}: invalid JSON: {err}")
                    continue
                yield self._keyed(value, f"line {lineno}")

    def _count(self) -> int:
        with open(self.path, "rb") as f:
            return sum(1 for _ in self._lines(f))


class _TextSource(RowSource):
    """Plain text: every line is a row (an empty line is an empty string), its newline stripped."""

    format = "txt"

    def __init__(self, path: Path, input_names: tuple[str, ...], start: int, max_line_bytes: int) -> None:
        super().__init__(path, input_names, start, max_line_bytes)
        _single_input(path, input_names, "txt")

    def _rows(self) -> Iterator[Row | BadRow]:
        with open(self.path, "rb") as f:
            lines = _bounded_lines(f, self.max_line_bytes)
            for lineno, raw in enumerate(itertools.islice(lines, self.start, None), self.start + 1):
                if raw is None:
                    yield _too_long(f"line {lineno}", self.max_line_bytes)
                    continue
                line = _strip_bom(raw) if lineno == 1 else raw
                line = line[:-1] if line.endswith(b"\n") else line
                line = line[:-1] if line.endswith(b"\r") else line
                try:
                    text = line.decode("utf-8")
                except UnicodeDecodeError as err:
                    yield BadRow(f"line {lineno}: not UTF-8: {err}")
                    continue
                yield self._keyed(text, f"line {lineno}")

    def _count(self) -> int:
        return _count_newlines(self.path)


_INT = re.compile(r"[+-]?\d+")
_FLOAT = re.compile(r"[+-]?(?:\d+\.?\d*(?:[eE][+-]?\d+)?|\.\d+(?:[eE][+-]?\d+)?|nan|inf|infinity)", re.IGNORECASE)


def _all_strings(value: Any) -> bool:
    if isinstance(value, list):
        return all(_all_strings(v) for v in value)
    return isinstance(value, str)


class _CsvSource(RowSource):
    """CSV with a header row of input names. Cells: a JSON list is a list; integers, floats and true/false are parsed;
    anything else stays a string, and so does every cell of a string input (a JSON list of strings aside)."""

    format = "csv"

    def __init__(
        self, path: Path, input_names: tuple[str, ...], start: int, string_inputs: frozenset[str], max_line_bytes: int
    ) -> None:
        super().__init__(path, input_names, start, max_line_bytes)
        self.string_inputs = string_inputs
        with self._open() as f:
            header = next((rec for _, rec in self._records(f) if not isinstance(rec, csv.Error)), None)
        if header is None:
            raise ValueError(f"{path}: no header row (a CSV input starts with a row of input names)")
        if len(set(header)) != len(header):
            raise ValueError(f"{path}: the header names a column twice: {header}")
        self.header = header
        if not input_names:
            columns = [(i, name) for i, name in enumerate(header)]
        else:
            columns = [(i, name) for i, name in enumerate(header) if name in input_names]
            if not columns:
                if len(input_names) == 1 and len(header) == 1:
                    columns = [(0, input_names[0])]  # one column for a one-input model: the names need not match
                else:
                    raise ValueError(
                        f"{path}: no header column ({', '.join(header)}) is an input of the model "
                        f"({', '.join(input_names)})"
                    )
        self._columns = columns

    def _open(self) -> IO[str]:
        # Undecodable bytes survive as surrogates, so that one bad cell makes one BadRow, not a failed job.
        return open(self.path, newline="", encoding="utf-8-sig", errors="surrogateescape")

    def _lines(self, f: IO[str], overlong: list[int]) -> Iterator[str]:
        """The file's lines for csv.reader; a line longer than the cap (in characters) is skipped in bounded reads,
        noted in ``overlong`` and replaced by a placeholder, so that the record holding it becomes an error row."""
        readline = f.readline
        limit = self.max_line_bytes + 1
        while line := readline(limit):
            if len(line) < limit or line[-1] in "\r\n":
                yield line
                continue
            while (rest := readline(_SKIP_BYTES)) and rest[-1] not in "\r\n":
                pass
            overlong.append(1)
            yield "-\n"

    def _records(self, f: IO[str]) -> Iterator[tuple[int, list[str] | csv.Error]]:
        """``(line, record or the csv.Error that replaced it)`` for every non-blank record."""
        overlong: list[int] = []
        reader = csv.reader(self._lines(f, overlong))
        while True:
            before = reader.line_num
            try:
                record = next(reader)
            except StopIteration:
                return
            except csv.Error as err:
                if reader.line_num == before:
                    raise  # no progress: the reader would fail here forever
                overlong.clear()
                yield reader.line_num, err
                continue
            if overlong:
                overlong.clear()
                yield reader.line_num, csv.Error(
                    f"longer than {self.max_line_bytes:,} characters (max_line_bytes): skipped"
                )
            elif record:
                yield reader.line_num, record

    def _data(self, f: IO[str]) -> Iterator[tuple[int, list[str] | csv.Error]]:
        """The records after the header."""
        records = self._records(f)
        for _, record in records:
            if not isinstance(record, csv.Error):
                break
        return records

    def _rows(self) -> Iterator[Row | BadRow]:
        with self._open() as f:
            for line, record in itertools.islice(self._data(f), self.start, None):
                if isinstance(record, csv.Error):
                    yield BadRow(f"line {line}: {record}")
                else:
                    yield self._row(record, line)

    def _row(self, record: list[str], line: int) -> Row | BadRow:
        if len(record) != len(self.header):
            return BadRow(f"line {line}: {len(record)} cells, but the header has {len(self.header)}")
        row: dict[str, Any] = {}
        for i, name in self._columns:
            cell = record[i]
            if not cell.isascii():
                try:
                    cell.encode("utf-8")
                except UnicodeEncodeError:
                    return BadRow(f"line {line}: column {self.header[i]!r} is not UTF-8")
            value = self._cell(cell, name in self.string_inputs)
            if isinstance(value, BadRow):
                return BadRow(f"line {line}: column {self.header[i]!r}: {value.reason}")
            row[name] = value
        return row

    @staticmethod
    def _cell(cell: str, text: bool) -> Any:
        s = cell.strip()
        if s.startswith("["):
            try:
                value = json.loads(s)
            except (ValueError, RecursionError) as err:
                return cell if text else BadRow(f"invalid JSON list: {err}")
            if isinstance(value, list) and (not text or _all_strings(value)):
                return value
            return cell if text else BadRow("invalid JSON list")
        if text:
            return cell
        if _INT.fullmatch(s):
            return int(s)
        if _FLOAT.fullmatch(s):
            return float(s)
        if s.lower() in ("true", "false"):
            return s.lower() == "true"
        return cell

    def _count(self) -> int:
        with self._open() as f:
            return sum(1 for _ in self._data(f))


class _NpySource(RowSource):
    """A ``.npy`` array: a row per leading index, for a single-input model.

    The header comes from ``np.load(mmap_mode="r")``; the rows are then read in blocks with plain reads, because
    the pages a memory map touches count in the process's resident memory until the kernel drops them.
    """

    format = "npy"

    def __init__(self, path: Path, input_names: tuple[str, ...], start: int) -> None:
        super().__init__(path, input_names, start)
        _single_input(path, input_names, "npy")
        try:
            arr = np.load(path, mmap_mode="r", allow_pickle=False)
        except ValueError as err:
            raise ValueError(
                f"{path}: cannot stream this array ({err}); save it without Python objects (text as a fixed-width "
                "'U' array, or use JSONL, CSV or .txt)"
            ) from err
        if not isinstance(arr, np.memmap):
            raise ValueError(f"{path} is not a single .npy array (an .npz archive?)")
        if arr.ndim == 0:
            raise ValueError(f"{path} holds one value of shape (): a row input needs a leading row axis")
        self.shape: tuple[int, ...] = tuple(arr.shape)
        self.dtype: np.dtype[Any] = arr.dtype
        self._offset = int(arr.offset)
        self._fortran = arr.ndim > 1 and not arr.flags.c_contiguous
        del arr

    def _count(self) -> int:
        return self.shape[0]

    def _rows(self) -> Iterator[Row | BadRow]:
        n, row_shape = self.shape[0], self.shape[1:]
        if self._fortran:
            # A Fortran-order row is strided across the whole file: index the map (rare, and no block read helps).
            arr = np.load(self.path, mmap_mode="r", allow_pickle=False)
            for i in range(self.start, n):
                yield self._keyed(np.array(arr[i]), f"row {i}")
            return
        row_bytes = self.dtype.itemsize * math.prod(row_shape)
        if row_bytes == 0:
            for i in range(self.start, n):
                yield self._keyed(np.zeros(row_shape, self.dtype), f"row {i}")
            return
        block = max(1, _BLOCK_BYTES // row_bytes)
        with open(self.path, "rb") as f:
            f.seek(self._offset + self.start * row_bytes)
            i = self.start
            while i < n:
                k = min(block, n - i)
                buf = f.read(k * row_bytes)
                if len(buf) != k * row_bytes:
                    raise ValueError(f"{self.path} is truncated: its header promises {n} rows, the data ends at {i}")
                chunk = np.frombuffer(buf, dtype=self.dtype).reshape((k, *row_shape))
                for j in range(k):
                    yield self._keyed(chunk[j], f"row {i + j}")
                i += k


def _is_plain_number_type(pa: Any, t: Any) -> bool:
    return bool(pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t))


class _ParquetSource(RowSource):
    """Parquet through pyarrow: batches of whole rows; only the columns named after model inputs are read."""

    format = "parquet"

    def __init__(self, path: Path, input_names: tuple[str, ...], start: int) -> None:
        self._pa, self._pq = _pyarrow()
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
        self._batch_rows = max(1, min(_MAX_BATCH_ROWS, _BLOCK_BYTES * max(rows, 1) // max(nbytes, 1)))

    def _count(self) -> int:
        return sum(self._group_rows)

    def _rows(self) -> Iterator[Row | BadRow]:
        # Whole row groups before `start` are never read: their row counts are in the footer.
        group, skip = 0, self.start
        while group < len(self._group_rows) and skip >= self._group_rows[group]:
            skip -= self._group_rows[group]
            group += 1
        if group == len(self._group_rows):
            return
        index = self.start
        file_columns = [c for c, _ in self._columns]
        with self._pq.ParquetFile(self.path) as pf:
            batches = pf.iter_batches(
                batch_size=self._batch_rows, row_groups=list(range(group, len(self._group_rows))), columns=file_columns
            )
            for batch in batches:
                if skip:
                    if batch.num_rows <= skip:
                        skip -= batch.num_rows
                        continue
                    batch, skip = batch.slice(skip), 0
                columns = [self._values(batch.column(k)) for k in range(len(file_columns))]
                for r in range(batch.num_rows):
                    row: dict[str, Any] = {}
                    for (column, name), (values, nulls) in zip(self._columns, columns, strict=True):
                        if nulls is not None and nulls[r]:
                            yield BadRow(f"row {index}: column {column!r} is null")
                            break
                        row[name] = values[r]
                    else:
                        yield row
                    index += 1

    def _values(self, col: Any) -> tuple[Sequence[Any], Sequence[bool] | None]:
        """A column's values by row (numpy for numbers and lists of numbers), and its null mask when it has nulls."""
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
            return col.to_numpy(zero_copy_only=False), nulls
        return col.to_pylist(), nulls


# --- writers ------------------------------------------------------------------------------------------------------


class ResultWriter(Protocol):
    """Where a scoring job's results go, resumably. See the module docstring and :func:`open_writer`.

    Call ``open()`` (rows already done: resume there), then ``write``/``write_error`` each row in index order,
    ``commit(rows_done)`` now and then, ``close()`` at the end (or ``abandon()`` on the way out of a failure).
    ``rows_written``/``errors_written`` count over every run of the job (they are kept in the checkpoint).
    ``complete``: ``open()`` found a finished job (nothing to do: it returns the rows done, and writes, commits of
    those rows and close are no-ops or refused).
    """

    path: Path
    errors_path: Path | None
    checkpoint_path: Path
    rows_written: int
    errors_written: int
    rows_done: int
    complete: bool

    def open(self) -> int: ...

    def inspect(self) -> SavedCheckpoint | None: ...

    def reset(self) -> None: ...

    def extra_paths(self) -> list[tuple[str, Path]]: ...

    def write(self, index: int, outputs: Mapping[str, npt.NDArray[Any]]) -> None: ...

    def write_error(self, index: int, error: BaseException | str, row: object | None = None) -> None: ...

    def commit(self, rows_done: int) -> None: ...

    def close(self) -> None: ...

    def abandon(self) -> None: ...


def open_writer(
    path: PathLike,
    *,
    fingerprint: str,
    errors_path: PathLike | None = None,
    format: str | None = None,  # the contract's name
    output: str | None = None,
) -> ResultWriter:
    """A writer of results to ``path`` (format from the suffix or ``format``: jsonl, npy, parquet); not opened yet.

    ``fingerprint`` identifies the job (input and options): ``open()`` refuses a checkpoint of another job with
    :class:`CheckpointMismatch`. ``errors_path``: JSONL, one line per failed row (without it failures are only
    counted). ``output``: the one output to write (required for ``.npy`` when the model has several; for the other
    formats it narrows the columns). Parquet needs pyarrow (an ImportError names the extra to install).
    """
    file = Path(path)
    fmt = _format_of(file, format, _WRITE_FORMATS, "output")
    errors = None if errors_path is None else Path(errors_path)
    if fmt == "jsonl":
        return _JsonlWriter(file, fingerprint=fingerprint, errors_path=errors, output=output)
    if fmt == "npy":
        return _NpyWriter(file, fingerprint=fingerprint, errors_path=errors, output=output)
    return _ParquetWriter(file, fingerprint=fingerprint, errors_path=errors, output=output)


def _json_default(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        if value.size > 256:
            raise TypeError("too large")
        return _decoded(value.tolist())
    if isinstance(value, np.generic):
        return _decoded(value.item())
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    raise TypeError(type(value).__name__)


def _decoded(value: Any) -> Any:
    """A nested list from ``ndarray.tolist()`` with bytes (BYTES elements) decoded as UTF-8."""
    if isinstance(value, list):
        return [_decoded(v) for v in value]
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return value


def _error_line(index: int, error: BaseException | str, row: object | None) -> bytes:
    if isinstance(error, BaseException):
        kind, message = type(error).__name__, str(error) or type(error).__name__
    else:
        kind, message = "Error", error
    record: dict[str, Any] = {"row": index, "error": kind, "message": message}
    if row is not None and not isinstance(row, BadRow):
        try:
            text = json.dumps(row, default=_json_default, allow_nan=False)
        except (TypeError, ValueError, RecursionError):
            text = ""
        if text and len(text) <= _MAX_INPUT_JSON:
            record["input"] = json.loads(text)
    return json.dumps(record).encode() + b"\n"


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _Writer:
    """What every format shares: order checks, the errors file, counts and the complete state."""

    format: ClassVar[str]
    gapless: ClassVar[bool] = False  # every index must come (a .npy slot per input row)

    def __init__(self, path: Path, *, fingerprint: str, errors_path: Path | None, output: str | None) -> None:
        self.path = path
        self.errors_path = errors_path
        self.fingerprint = fingerprint
        self.output = output
        self.checkpoint_path = path.with_name(path.name + ".checkpoint.json")
        self.rows_written = 0
        self.errors_written = 0
        self.rows_done = 0
        self.complete = False
        self._ckpt = self._resumable()
        self._state = "new"  # new -> open -> closed; or new -> finished (open() found a complete job)
        self._next = 0  # the lowest index that may still come
        self._dirty = False

    def _resumable(self) -> ResumableOutput:
        return ResumableOutput(self.path, fingerprint=self.fingerprint, errors_path=self.errors_path)

    def open(self) -> int:
        """Cut the files back to the last commit; return the rows done there (0: a fresh job; all: a finished one)."""
        if self._state != "new":
            raise RuntimeError(f"{self.path}: open() was already called")
        saved = self._ckpt.saved()
        if saved is not None:
            self._verify(saved)
        if saved is not None and saved.complete:
            self._tidy_finished()
            self._counts(saved.meta)
            self.rows_done = self._next = saved.rows
            self.complete = True
            self._state = "finished"
            _log.info("%s is complete (%d rows): nothing to do", self.path, saved.rows)
            return saved.rows
        self.rows_done = self._next = self._ckpt.open()
        self._state = "open"
        try:
            self._counts(self._ckpt.meta)
            self._resume(self._ckpt.meta)
        except BaseException:
            self.abandon()
            raise
        return self.rows_done

    def inspect(self) -> SavedCheckpoint | None:
        """What the checkpoint says, checked against the files it describes, touching nothing; None when there is
        none. Raises :class:`CheckpointMismatch` (another job's) or :class:`CheckpointFilesMismatch`."""
        saved = self._ckpt.saved()
        if saved is not None:
            self._verify(saved)
        return saved

    def reset(self) -> None:
        """Forget the job: remove its checkpoint (and a format's own leftovers); the next ``open()`` starts over and
        cuts the files to nothing."""
        if self._state == "open":
            self.abandon()
        self._state = "new"
        self.checkpoint_path.unlink(missing_ok=True)
        self._forget()

    def extra_paths(self) -> list[tuple[str, Path]]:
        """Paths besides output, errors and checkpoint that the writer creates or writes in (role, path)."""
        return []

    def _verify(self, saved: SavedCheckpoint) -> None:
        """Raise :class:`CheckpointFilesMismatch` when the files disagree with the checkpoint ``saved``."""
        ckpt = self.checkpoint_path

        def mismatch(problem: str, restore: Path | None = None) -> CheckpointFilesMismatch:
            what = f"restore {restore.name}, or " if restore is not None else ""
            return CheckpointFilesMismatch(f"{ckpt}: {problem}: {what}delete {ckpt.name} to start over")

        if saved.complete and not self.path.exists():
            raise mismatch(f"says the job finished ({saved.rows:,} rows), but {self.path} is missing", self.path)
        self._ckpt.verify(saved)
        written, failed = int(saved.meta.get("rows_written", 0)), int(saved.meta.get("errors_written", 0))
        if written + failed > saved.rows:
            raise mismatch(f"counts {written:,} rows written and {failed:,} failed, more than the {saved.rows:,} rows "
                           "it says are done")
        if self.errors_path is not None and "errors_written" in saved.meta and (failed > 0) != (saved.err_bytes > 0):
            raise mismatch(f"counts {failed:,} failed rows in {saved.err_bytes:,} bytes of {self.errors_path}")
        self._verify_format(saved, mismatch)

    def _verify_format(self, saved: SavedCheckpoint, mismatch: Any) -> None:
        """The format's own checks of the checkpoint against its files."""

    def _forget(self) -> None:
        """Remove the format's own files besides the output (reset())."""

    def _counts(self, meta: Mapping[str, Any]) -> None:
        self.rows_written = int(meta.get("rows_written", 0))
        self.errors_written = int(meta.get("errors_written", 0))

    def _take(self, index: int) -> None:
        if self._state == "finished":
            raise RuntimeError(f"{self.path}: the job is already complete; no row goes in again")
        if self._state != "open":
            raise RuntimeError(f"{self.path}: the writer is {'not open yet' if self._state == 'new' else 'closed'}")
        if index < self._next or (self.gapless and index != self._next):
            expected = f"row {self._next}" if self.gapless else f"a row from {self._next} on"
            raise ValueError(f"{self.path}: row {index} came where {expected} was due: rows go in order, each once")
        self._next = index + 1
        self._dirty = True

    def write(self, index: int, outputs: Mapping[str, npt.NDArray[Any]]) -> None:
        """Append row ``index``'s outputs; a row that does not fit the first row's shapes becomes an error row."""
        self._take(index)
        if self.output is not None:
            if self.output not in outputs:
                raise ValueError(f"output {self.output!r} is not among the row's outputs ({', '.join(outputs)})")
            outputs = {self.output: outputs[self.output]}
        problem = self._write_row(index, {name: np.asarray(v) for name, v in outputs.items()})
        if problem is None:
            self.rows_written += 1
        else:
            self._failed(index, OutputShapeError(problem), None)

    def write_error(self, index: int, error: BaseException | str, row: object | None = None) -> None:
        """Record that row ``index`` failed (``row``: its input, kept in the errors file when small)."""
        self._take(index)
        self._failed(index, error, row)

    def _failed(self, index: int, error: BaseException | str, row: object | None) -> None:
        self.errors_written += 1
        if self.errors_path is not None:
            self._ckpt.write_error(_error_line(index, error, row))
        self._error_slot(index)

    def commit(self, rows_done: int) -> None:
        """Make the rows written so far durable; a re-run resumes at ``rows_done``."""
        if self._state == "finished":
            if rows_done != self.rows_done:
                raise RuntimeError(f"{self.path}: the job is already complete at {self.rows_done} rows")
            return
        if self._state != "open":
            raise RuntimeError(f"{self.path}: commit() needs an open writer")
        if rows_done < self._next:
            raise ValueError(
                f"commit({rows_done}) leaves row {self._next - 1}, already written, out of the rows done: a re-run "
                "would write it again"
            )
        if self.gapless and rows_done != self._next:
            raise ValueError(
                f"{self.path} keeps a slot per input row, but rows {self._next}..{rows_done - 1} were neither "
                "written nor failed"
            )
        self._before_commit()
        self._ckpt.commit(
            rows_done, meta={"rows_written": self.rows_written, "errors_written": self.errors_written, **self._meta()}
        )
        self.rows_done = self._next = rows_done
        self._dirty = False
        self._after_commit()

    def close(self) -> None:
        """Finish the output (a .npy header, the Parquet merge) and mark the job complete. Commit everything first."""
        if self._state == "finished":
            self._state = "closed"
            return
        if self._state != "open":
            raise RuntimeError(f"{self.path}: close() needs an open writer")
        if self._dirty:
            raise RuntimeError(f"{self.path}: rows were written after the last commit(rows_done): commit them first")
        self._finish()
        self._ckpt.close()
        self._release()
        self._state = "closed"
        self.complete = True
        self._tidy_finished()

    def abandon(self) -> None:
        """Close without committing: the next ``open()`` resumes at the last commit."""
        if self._state == "open":
            self._release()
            self._ckpt.abandon()
        self._state = "closed"

    def __enter__(self) -> Self:
        self.open()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abandon()

    # Format hooks.
    def _resume(self, meta: Mapping[str, Any]) -> None:
        """Pick up after ``open()`` cut the files back to the checkpoint whose writer state is ``meta``."""

    def _write_row(self, index: int, outputs: Mapping[str, npt.NDArray[Any]]) -> str | None:
        """Append one row; return why it does not fit (it then becomes an error row) or None."""
        raise NotImplementedError

    def _error_slot(self, index: int) -> None:
        """A failed row: fill its place in a positional output."""

    def _meta(self) -> dict[str, Any]:
        return {}

    def _before_commit(self) -> None:
        """Make the format's own files durable (the checkpoint comes after)."""

    def _after_commit(self) -> None: ...

    def _finish(self) -> None:
        """Final touches before the job is marked complete; everything is committed."""

    def _release(self) -> None: ...

    def _tidy_finished(self) -> None:
        """Remove what a finished job no longer needs."""


class _JsonlWriter(_Writer):
    format = "jsonl"

    def _verify_format(self, saved: SavedCheckpoint, mismatch: Any) -> None:
        written = int(saved.meta.get("rows_written", 0))
        if "rows_written" in saved.meta and (written > 0) != (saved.out_bytes > 0):
            raise mismatch(f"counts {written:,} rows written in {saved.out_bytes:,} bytes of {self.path}")

    def _write_row(self, index: int, outputs: Mapping[str, npt.NDArray[Any]]) -> str | None:
        if "row" in outputs:
            raise ValueError("an output named 'row' clashes with the row index in JSONL output: choose the outputs")
        record: dict[str, Any] = {"row": index}
        for name, value in outputs.items():
            # Only BYTES outputs (object arrays) hold bytes to decode; numbers go out as tolist() gives them.
            record[name] = _decoded(value.tolist()) if value.dtype.kind in "OSV" else value.tolist()
        self._ckpt.write(json.dumps(record, ensure_ascii=False).encode() + b"\n")
        return None


def _npy_header_text(dtype: np.dtype[Any], shape: tuple[int, ...]) -> str:
    return f"{{'descr': {dtype.str!r}, 'fortran_order': False, 'shape': {shape!r}, }}"


def _npy_header(dtype: np.dtype[Any], shape: tuple[int, ...], size: int) -> bytes:
    """A version 1.0 .npy header padded to ``size`` bytes, so that it can be rewritten in place with another count."""
    text = _npy_header_text(dtype, shape)
    room = size - 10 - 1  # magic, version and length before; the newline after
    if len(text) > room:
        raise ValueError("the .npy header outgrew its room")
    body = (text.ljust(room) + "\n").encode("latin1")
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(body)) + body


def _npy_header_size(row_shape: tuple[int, ...], dtype: np.dtype[Any]) -> int:
    # Room for the largest row count an int64 holds, rounded up to 64 bytes as numpy aligns its own headers.
    widest = _npy_header_text(dtype, (2**63 - 1, *row_shape))
    size = -(-(10 + len(widest) + 1) // 64) * 64
    if size - 10 > 0xFFFF:
        raise ValueError(f"row shape {row_shape} is too large for a .npy header")
    return size


class _NpyWriter(_Writer):
    """One output, a slot per input row. The header is written before the first row with room for any count,
    rewritten in place after each commit (a partial file reads as the rows committed) and at close."""

    format = "npy"
    gapless = True

    def __init__(self, path: Path, *, fingerprint: str, errors_path: Path | None, output: str | None) -> None:
        super().__init__(path, fingerprint=fingerprint, errors_path=errors_path, output=output)
        self._dtype: np.dtype[Any] | None = None
        self._row_shape: tuple[int, ...] = ()
        self._header_size = 0
        self._fill = b""
        self._pending = 0  # failed rows before the first good one settled the dtype: their slots come then
        self._fd: int | None = None

    def _resume(self, meta: Mapping[str, Any]) -> None:
        if "dtype" in meta:
            self._settle(np.dtype(meta["dtype"]), tuple(meta["row_shape"]), write=False)
            if meta.get("output") is not None:
                self.output = str(meta["output"])
        self._pending = int(meta.get("pending", 0))
        self._fd = os.open(self.path, os.O_WRONLY)

    def _verify_format(self, saved: SavedCheckpoint, mismatch: Any) -> None:
        meta = saved.meta
        if saved.complete:
            return  # the rows then sit in the file whole; the size was checked
        if "dtype" in meta:
            dtype, row_shape = np.dtype(meta["dtype"]), tuple(meta["row_shape"])
            expected = _npy_header_size(row_shape, dtype) + saved.rows * dtype.itemsize * math.prod(row_shape)
        else:
            expected = 0
        if saved.out_bytes != expected:
            raise mismatch(f"records {saved.out_bytes:,} bytes of {self.path} for {saved.rows:,} rows, where the "
                           f".npy layout needs {expected:,}")

    def _meta(self) -> dict[str, Any]:
        if self._dtype is None:
            return {"pending": self._pending}
        return {"dtype": self._dtype.str, "row_shape": list(self._row_shape), "output": self.output, "pending": 0}

    def _settle(self, dtype: np.dtype[Any], row_shape: tuple[int, ...], *, write: bool) -> None:
        self._dtype, self._row_shape = dtype, row_shape
        self._header_size = _npy_header_size(row_shape, dtype)
        fill = np.full(row_shape, np.nan if dtype.kind in "fc" else 0, dtype=dtype)
        self._fill = fill.tobytes()
        if write:
            # The count is set after each commit, when the header is surely in the file.
            self._ckpt.write(_npy_header(dtype, (0, *row_shape), self._header_size))
            for start in range(0, self._pending, 1024):
                self._ckpt.write(self._fill * min(1024, self._pending - start))
            self._pending = 0

    def _write_row(self, index: int, outputs: Mapping[str, npt.NDArray[Any]]) -> str | None:
        if len(outputs) != 1:
            raise ValueError(
                f"{self.path}: a .npy output holds one output, and the model gives {', '.join(outputs)}: choose one "
                "(output=...)"
            )
        ((name, value),) = outputs.items()
        if self._dtype is None:
            if value.dtype.kind not in "biufc":
                raise TypeError(
                    f"output {name!r} has dtype {value.dtype}: a .npy output takes numbers (write text outputs to "
                    "JSONL or Parquet)"
                )
            self.output = name
            self._settle(value.dtype, value.shape, write=True)
        assert self._dtype is not None
        if value.shape != self._row_shape:
            return f"output {name!r} has shape {value.shape}; the .npy rows have {self._row_shape} (the first row's)"
        if value.dtype != self._dtype and not np.can_cast(value.dtype, self._dtype, casting="safe"):
            return f"output {name!r} has dtype {value.dtype}, but the .npy rows are {self._dtype} (the first row's)"
        self._ckpt.write(np.ascontiguousarray(value, dtype=self._dtype).tobytes())
        return None

    def _error_slot(self, index: int) -> None:
        if self._dtype is None:
            self._pending += 1
        else:
            self._ckpt.write(self._fill)

    def _after_commit(self) -> None:
        # Only now is the header surely in the file (it may have sat in the append buffer); the next commit's
        # fsync makes the new count durable, and a stale count is harmless: the checkpoint, not the header, rules.
        if self._dtype is not None and self._fd is not None:
            header = _npy_header(self._dtype, (self.rows_done, *self._row_shape), self._header_size)
            os.pwrite(self._fd, header, 0)

    def _finish(self) -> None:
        if self._dtype is None:
            # No row ever succeeded: the failed rows are float64 NaNs.
            self._settle(np.dtype(np.float64), (), write=True)
            self.commit(self.rows_done)
        self._after_commit()

    def _release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class _ParquetWriter(_Writer):
    """Rows go to ``<output>.parts/part-NNNNNN.parquet``, one part per commit (row groups of bounded size inside);
    the checkpoint records how many parts are committed. ``close()`` streams the parts' row groups into the final
    file (through a temporary name, replaced atomically), then removes the parts."""

    format = "parquet"

    def __init__(self, path: Path, *, fingerprint: str, errors_path: Path | None, output: str | None) -> None:
        self._pa, self._pq = _pyarrow()
        self.parts_dir = path.with_name(path.name + ".parts")
        super().__init__(path, fingerprint=fingerprint, errors_path=errors_path, output=output)
        self._schema: Any = None
        self._parts = 0
        self._buffer: list[tuple[int, Mapping[str, npt.NDArray[Any]]]] = []
        self._buffer_bytes = 0
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
        for name, value in outputs.items():
            if value.dtype.kind in "OSU":
                leaf = pa.string()
            elif value.dtype.kind in "biuf":
                leaf = pa.from_numpy_dtype(value.dtype)
            else:
                raise TypeError(f"output {name!r} has dtype {value.dtype}, which Parquet output does not take")
            for _ in range(value.ndim):
                leaf = pa.list_(leaf)
            fields.append(pa.field(name, leaf))
        self._schema = pa.schema(fields)

    def _write_row(self, index: int, outputs: Mapping[str, npt.NDArray[Any]]) -> str | None:
        if self._schema is None:
            self._settle(outputs)
        names = self._schema.names[1:]
        if set(outputs) != set(names):
            return f"outputs {', '.join(outputs)} differ from the first row's ({', '.join(names)})"
        for name in names:
            problem = self._mismatch(name, outputs[name])
            if problem is not None:
                return problem
        self._buffer.append((index, outputs))
        self._buffer_bytes += sum(v.nbytes if v.dtype.kind != "O" else 64 * v.size for v in outputs.values())
        if self._buffer_bytes >= _BLOCK_BYTES or len(self._buffer) >= _MAX_BATCH_ROWS:
            self._flush()
        return None

    def _mismatch(self, name: str, value: npt.NDArray[Any]) -> str | None:
        pa = self._pa
        leaf, ndim = self._schema.field(name).type, 0
        while pa.types.is_list(leaf):
            leaf, ndim = leaf.value_type, ndim + 1
        if value.ndim != ndim:
            return f"output {name!r} has {value.ndim} dims, but the Parquet column has {ndim} (the first row's)"
        if pa.types.is_string(leaf):
            ok = value.dtype.kind in "OSU"
        else:
            ok = value.dtype.kind in "biuf" and np.can_cast(value.dtype, leaf.to_pandas_dtype(), casting="safe")
        if not ok:
            return f"output {name!r} has dtype {value.dtype}, but the Parquet column is {leaf} (the first row's)"
        return None

    def _column(self, values: list[npt.NDArray[Any]], name: str) -> Any:
        """Nested Arrow lists built from offsets (no per-element Python work for numbers)."""
        pa = self._pa
        leaf_type = self._schema.field(name).type
        ndim = 0
        while pa.types.is_list(leaf_type):
            leaf_type, ndim = leaf_type.value_type, ndim + 1
        if pa.types.is_string(leaf_type):
            leaves = pa.array(
                [s.decode("utf-8", "replace") if isinstance(s, bytes) else str(s)
                 for v in values for s in v.reshape(-1).tolist()],
                type=pa.string(),
            )
        else:
            dtype = leaf_type.to_pandas_dtype()
            leaves = pa.array(np.concatenate([np.asarray(v, dtype=dtype).reshape(-1) for v in values]), type=leaf_type)
        for level in reversed(range(ndim)):
            lengths = np.concatenate(
                [np.full(math.prod(v.shape[:level]), v.shape[level], dtype=np.int64) for v in values]
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
        columns = [pa.array([i for i, _ in self._buffer], type=pa.int64())]
        columns += [self._column([row[name] for _, row in self._buffer], name) for name in names]
        table = pa.Table.from_arrays(columns, schema=self._schema)
        if self._part_writer is None:
            self._part_writer = self._pq.ParquetWriter(self._part(self._parts), self._schema)
        self._part_writer.write_table(table, row_group_size=table.num_rows)
        self._buffer, self._buffer_bytes = [], 0

    def _before_commit(self) -> None:
        self._flush()
        if self._part_writer is not None:
            self._part_writer.close()
            self._part_writer = None
            _fsync_path(self._part(self._parts))
            _fsync_path(self.parts_dir)
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
                        if group_bytes >= _BLOCK_BYTES:
                            merged = pa.concat_tables(group)
                            out.write_table(merged, row_group_size=merged.num_rows)
                            group, group_bytes = [], 0
            if group:
                merged = pa.concat_tables(group)
                out.write_table(merged, row_group_size=merged.num_rows)
        _fsync_path(merging)
        os.replace(merging, self.path)
        _fsync_path(self.path.parent)

    def _release(self) -> None:
        if self._part_writer is not None:
            self._part_writer.close()  # an uncommitted part: the next open() removes it
            self._part_writer = None
        self._buffer, self._buffer_bytes = [], 0

    def _tidy_finished(self) -> None:
        if self.parts_dir.is_dir():
            for part in self.parts_dir.glob("part-*.parquet"):
                part.unlink()
            with contextlib.suppress(OSError):  # something else in there: leave it
                self.parts_dir.rmdir()
