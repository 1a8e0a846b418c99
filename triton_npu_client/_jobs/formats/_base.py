"""What the format modules share: the row and error types, the reader protocol (:class:`RowSource`) and the writer
base (:class:`Writer`, the order, errors-file, count and commit rules every output format keeps).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
from abc import abstractmethod
from collections.abc import Iterable, Iterator, Mapping, Sequence
from functools import cached_property
from pathlib import Path
from types import TracebackType
from typing import IO, Any, ClassVar, Protocol, Self, TypeAlias

import attrs
import numpy as np
import numpy.typing as npt

from .._checkpoint import ResumableOutput, SavedCheckpoint
from .._safety import CheckpointFilesMismatch, UnknownFormatError

_log = logging.getLogger("triton_npu_client.jobs")

# A row: a mapping from model input name to one sample's value (``{"TEXT": "hi"}``), or, for a single-input model
# and no input names given, the bare value.
Row: TypeAlias = Any
PathLike: TypeAlias = "str | os.PathLike[str]"

PARQUET_HINT = "pip install 'triton-npu-client[parquet]'"

# How much of a file a reader or writer holds at once (a block of .npy rows, a Parquet batch or row group).
BLOCK_BYTES = 8 << 20
MAX_BATCH_ROWS = 65536
# An errors-file line keeps the input row only when it is this small once in JSON.
MAX_INPUT_JSON = 2000
# A longer line (JSONL, CSV, .txt) is an error row, skipped without being held: one line never costs more memory.
MAX_LINE_BYTES = 8 << 20
SKIP_BYTES = 1 << 20

READ_FORMATS = {"jsonl": "jsonl", "ndjson": "jsonl", "csv": "csv", "npy": "npy", "txt": "txt", "text": "txt",
                "parquet": "parquet", "pq": "parquet"}
WRITE_FORMATS = {"jsonl": "jsonl", "ndjson": "jsonl", "npy": "npy", "parquet": "parquet", "pq": "parquet"}


@attrs.frozen
class BadRow:
    """A row the reader could not parse, in its place: ``reason`` names the line (or row) and the parse error."""

    reason: str


class OutputShapeError(ValueError):
    """A row's outputs do not fit the output file: another shape, dtype or set of outputs than the first row's."""


def block_bytes() -> int:
    """:data:`BLOCK_BYTES`, read when used (a test sets a smaller one)."""
    return BLOCK_BYTES


def format_of(path: Path, given: str | None, known: Mapping[str, str], what: str) -> str:
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
    return format_of(Path(path), format, READ_FORMATS, "input")


def output_format(path: PathLike, format: str | None = None) -> str:  # the contract's name
    """The output format :func:`open_writer` would use for ``path`` (or raise :class:`UnknownFormatError`)."""
    return format_of(Path(path), format, WRITE_FORMATS, "output")


def input_fingerprint(path: PathLike, fmt: str, st: os.stat_result | None = None) -> str:
    """The input file's identity for a checkpoint: format, resolved path, size and mtime (a stat, no read)."""
    file = Path(path)
    st = file.stat() if st is None else st
    return f"{fmt}:{file.resolve()}:{st.st_size}:{st.st_mtime_ns}"


def bounded_lines(f: IO[bytes], cap: int) -> Iterator[bytes | None]:
    """Each line of ``f`` (its newline kept), or None for a line whose content is longer than ``cap`` bytes.

    A long line is skipped with reads of at most ``SKIP_BYTES`` up to its newline: memory stays bounded by ``cap``.
    """
    readline = f.readline
    limit = cap + 1
    while line := readline(limit):
        if len(line) < limit or line.endswith(b"\n"):
            yield line
            continue
        while (rest := readline(SKIP_BYTES)) and not rest.endswith(b"\n"):
            pass
        yield None


def too_long(where: str, cap: int) -> BadRow:
    return BadRow(f"{where}: longer than {cap:,} bytes (max_line_bytes): skipped")


def pyarrow_modules() -> tuple[Any, Any]:
    """``(pyarrow, pyarrow.parquet)``, or an ImportError that says which extra brings them."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as err:
        raise ImportError(f"Parquet files need pyarrow, which is not importable here ({err}): {PARQUET_HINT}") from err
    return pa, pq


@attrs.frozen
class ColumnChunk:
    """Consecutive rows of an input file, ``start`` .. ``start + length - 1`` (indices in the file), parsed together.

    ``columns``: per input name one array-like (an ndarray where the format gives one, else a list) whose first axis
    is the rows, values as the file holds them (not yet coerced to the model's dtypes); None when the chunk must be
    looked at row by row (a bad row, a null, rows of other keys or shapes), and then ``rows`` holds exactly what
    iterating the reader gives. :meth:`row` is the one view both ways.
    """

    start: int
    length: int
    columns: Mapping[str, Any] | None
    rows: Sequence[Row | BadRow] | None = None

    def row(self, i: int) -> Row | BadRow:
        """The ``i``-th row of the chunk (0-based), exactly as iterating the reader gives it."""
        if self.rows is not None:
            return self.rows[i]
        assert self.columns is not None
        return {name: column[i] for name, column in self.columns.items()}


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

    def chunks(self, size: int) -> Iterator[ColumnChunk]:
        """The rows from ``start`` on in chunks of ``size`` rows (the last may be shorter), each parsed as a whole
        where the format allows (see :class:`ColumnChunk`); memory is bounded by a chunk. Reads the file anew."""
        if size < 1:
            raise ValueError(f"chunk size must be >= 1, got {size}")
        return self._chunks(size)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {str(self.path)!r} start={self.start}>"

    @abstractmethod
    def _rows(self) -> Iterator[Row | BadRow]: ...

    @abstractmethod
    def _count(self) -> int | None: ...

    def _chunks(self, size: int) -> Iterator[ColumnChunk]:
        """Chunks of the rows as iteration gives them, made columnar where every row has the same keys."""
        rows, index = self._rows(), self.start
        while batch := list(itertools.islice(rows, size)):
            yield self._rows_chunk(index, batch)
            index += len(batch)

    def _rows_chunk(self, start: int, rows: list[Row | BadRow]) -> ColumnChunk:
        """``rows`` (as iteration gives them) as a chunk: columns when every row is a mapping of the same keys."""
        first = rows[0]
        if isinstance(first, dict) and first:
            keys = first.keys()
            if all(isinstance(row, dict) and row.keys() == keys for row in rows):
                dicts: list[dict[str, Any]] = rows  # type: ignore[assignment]  # checked just above
                return ColumnChunk(start, len(rows), {k: [row[k] for row in dicts] for k in keys})
        return ColumnChunk(start, len(rows), None, rows)

    def _values_chunk(self, start: int, values: Sequence[Any] | npt.NDArray[Any]) -> ColumnChunk:
        """One bare value per row (a .txt line, a .npy row) as a chunk, keyed as :meth:`_keyed` keys each row."""
        if len(self.input_names) == 1:
            return ColumnChunk(start, len(values), {self.input_names[0]: values})
        return ColumnChunk(start, len(values), None, [self._keyed(v, "") for v in values])

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


def single_input(path: Path, names: tuple[str, ...], fmt: str) -> None:
    if len(names) > 1:
        raise ValueError(
            f"{path}: a {fmt} file gives one value per row, but the model has inputs {', '.join(names)}: use "
            "JSONL, CSV or Parquet"
        )


def strip_bom(line: bytes) -> bytes:
    return line[3:] if line.startswith(b"\xef\xbb\xbf") else line


def count_newlines(path: Path) -> int:
    """Lines in a text file: newlines, plus a last line that has none."""
    count, last = 0, b""
    with open(path, "rb") as f:
        while chunk := f.read(BLOCK_BYTES):
            count += chunk.count(b"\n")
            last = chunk[-1:]
    return count + (last not in (b"", b"\n"))


# --- writers ------------------------------------------------------------------------------------------------------


class ResultWriter(Protocol):
    """Where a scoring job's results go, resumably. See the module docstring and :func:`open_writer`.

    Call ``open()`` (rows already done: resume there), then ``write``/``write_rows``/``write_error`` in index order,
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

    def write_rows(self, start: int, outputs: Mapping[str, npt.NDArray[Any]]) -> None: ...

    def write_error(self, index: int, error: BaseException | str, row: object | None = None) -> None: ...

    def commit(self, rows_done: int) -> None: ...

    def close(self) -> None: ...

    def abandon(self) -> None: ...



def json_default(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        if value.size > 256:
            raise TypeError("too large")
        return decoded(value.tolist())
    if isinstance(value, np.generic):
        return decoded(value.item())
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    raise TypeError(type(value).__name__)


def decoded(value: Any) -> Any:
    """A nested list from ``ndarray.tolist()`` with bytes (BYTES elements) decoded as UTF-8."""
    if isinstance(value, list):
        return [decoded(v) for v in value]
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return value


def error_line(index: int, error: BaseException | str, row: object | None) -> bytes:
    if isinstance(error, BaseException):
        kind, message = type(error).__name__, str(error) or type(error).__name__
    else:
        kind, message = "Error", error
    record: dict[str, Any] = {"row": index, "error": kind, "message": message}
    if row is not None and not isinstance(row, BadRow):
        try:
            text = json.dumps(row, default=json_default, allow_nan=False)
        except (TypeError, ValueError, RecursionError):
            text = ""
        if text and len(text) <= MAX_INPUT_JSON:
            record["input"] = json.loads(text)
    return json.dumps(record).encode() + b"\n"


def one_row(value: Any) -> npt.NDArray[Any]:
    """A row's output as a run of one (batch dim first). Text and bytes stay Python objects, as a run of BYTES
    holds them (``np.asarray`` would make them fixed-width and drop trailing NULs)."""
    if isinstance(value, (str, bytes)) and not isinstance(value, np.generic):
        row = np.empty((1,), dtype=object)
        row[0] = value
        return row
    return np.asarray(value)[None]


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Writer:
    """What every format shares: order checks, the errors file, counts and the complete state."""

    format: ClassVar[str]
    gapless: ClassVar[bool] = False  # every index must come (a .npy slot per input row)
    keep: tuple[str, ...] = ()  # input fields a run carries beside the outputs; ``output`` never drops them

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

    def _take(self, index: int, n: int = 1) -> None:
        if self._state == "finished":
            raise RuntimeError(f"{self.path}: the job is already complete; no row goes in again")
        if self._state != "open":
            raise RuntimeError(f"{self.path}: the writer is {'not open yet' if self._state == 'new' else 'closed'}")
        if index < self._next or (self.gapless and index != self._next):
            expected = f"row {self._next}" if self.gapless else f"a row from {self._next} on"
            raise ValueError(f"{self.path}: row {index} came where {expected} was due: rows go in order, each once")
        self._next = index + n
        self._dirty = True

    def write(self, index: int, outputs: Mapping[str, Any]) -> None:
        """Append row ``index``'s outputs; a row that does not fit the first row's shapes becomes an error row."""
        # One row is a run of one: the same code, so the same bytes, as write_rows().
        self._put(index, 1, {name: one_row(value) for name, value in self._selected(outputs).items()})

    def write_rows(self, start: int, outputs: Mapping[str, npt.NDArray[Any]]) -> None:
        """Append rows ``start .. start + n - 1``, all good, at once: ``outputs[name]`` holds them on its first axis
        (``n`` rows, the same for every output). The files come out byte for byte as ``write()`` row by row makes
        them; when the run does not fit the first row's shapes, each of its rows becomes an error row."""
        arrays = {name: np.asarray(value) for name, value in self._selected(outputs).items()}
        lengths = {name: value.shape[0] if value.ndim else None for name, value in arrays.items()}
        n = next(iter(lengths.values()), None)
        if n is None or any(length != n for length in lengths.values()):
            shown = ", ".join(f"{name}: {'no batch dim' if k is None else k}" for name, k in lengths.items())
            raise ValueError(f"write_rows() takes outputs of one row count on the first axis; given {shown or 'none'}")
        if n:
            self._put(start, n, arrays)

    def _selected(self, outputs: Mapping[str, Any]) -> Mapping[str, Any]:
        if self.output is None:
            return outputs
        if self.output not in outputs:
            raise ValueError(f"output {self.output!r} is not among the row's outputs ({', '.join(outputs)})")
        selected = {name: outputs[name] for name in self.keep if name in outputs}
        selected[self.output] = outputs[self.output]
        return selected

    def _put(self, start: int, n: int, arrays: Mapping[str, npt.NDArray[Any]]) -> None:
        self._take(start, n)
        problem = self._write_run(start, n, arrays)
        if problem is None:
            self.rows_written += n
            return
        for index in range(start, start + n):
            self._failed(index, OutputShapeError(problem), None)

    def write_error(self, index: int, error: BaseException | str, row: object | None = None) -> None:
        """Record that row ``index`` failed (``row``: its input, kept in the errors file when small)."""
        self._take(index)
        self._failed(index, error, row)

    def _failed(self, index: int, error: BaseException | str, row: object | None) -> None:
        self.errors_written += 1
        if self.errors_path is not None:
            self._ckpt.write_error(error_line(index, error, row))
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

    def _write_run(self, start: int, n: int, outputs: Mapping[str, npt.NDArray[Any]]) -> str | None:
        """Append ``n`` rows (``outputs`` with the batch dim first); return why they do not fit the first row's
        shapes (they then become error rows; they all share their shapes, so they fit or fail together) or None."""
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
