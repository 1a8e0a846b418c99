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

Layout: one module per format (``jsonl``, ``csv``, ``text``, ``npy``, ``parquet``); what they share (the reader
protocol :class:`RowSource`, the writer base and its protocol :class:`ResultWriter`, the error rows, the helpers
for bounded lines) is in ``_base``. A new format is a module here plus a line in :func:`read_rows` or
:func:`open_writer` and in ``_base``'s format tables.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from pathlib import Path

from ._base import (
    MAX_LINE_BYTES,
    PARQUET_HINT,
    READ_FORMATS,
    WRITE_FORMATS,
    BadRow,
    ColumnChunk,
    OutputShapeError,
    PathLike,
    ResultWriter,
    Row,
    RowSource,
    format_of,
    input_fingerprint,
    input_format,
    output_format,
)
from .csv import CsvSource
from .jsonl import JsonlSource, JsonlWriter
from .npy import NpySource, NpyWriter
from .parquet import ParquetSource, ParquetWriter
from .text import TextSource

__all__ = [
    "MAX_LINE_BYTES",
    "PARQUET_HINT",
    "BadRow",
    "ColumnChunk",
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
    fmt = format_of(file, format, READ_FORMATS, "input")
    names = tuple(input_names)
    if start < 0:
        raise ValueError(f"start must be >= 0, got {start}")
    if max_line_bytes < 1:
        raise ValueError(f"max_line_bytes must be >= 1, got {max_line_bytes}")
    if fmt == "jsonl":
        return JsonlSource(file, names, start, max_line_bytes)
    if fmt == "csv":
        return CsvSource(file, names, start, frozenset(string_inputs), max_line_bytes)
    if fmt == "npy":
        return NpySource(file, names, start)
    if fmt == "txt":
        return TextSource(file, names, start, max_line_bytes)
    return ParquetSource(file, names, start)



def open_writer(
    path: PathLike,
    *,
    fingerprint: str,
    errors_path: PathLike | None = None,
    format: str | None = None,  # the contract's name
    output: str | None = None,
    keep: Sequence[str] = (),
) -> ResultWriter:
    """A writer of results to ``path`` (format from the suffix or ``format``: jsonl, npy, parquet); not opened yet.

    ``fingerprint`` identifies the job (input and options): ``open()`` refuses a checkpoint of another job with
    :class:`CheckpointMismatch`. ``errors_path``: JSONL, one line per failed row (without it failures are only
    counted). ``output``: the one output to write (required for ``.npy`` when the model has several; for the other
    formats it narrows the columns). ``keep``: input fields a run carries beside its outputs, written whatever
    ``output`` narrows to (JSONL and Parquet). Parquet needs pyarrow (an ImportError names the extra to install).
    """
    file = Path(path)
    fmt = format_of(file, format, WRITE_FORMATS, "output")
    errors = None if errors_path is None else Path(errors_path)
    writer: JsonlWriter | NpyWriter | ParquetWriter
    if fmt == "jsonl":
        writer = JsonlWriter(file, fingerprint=fingerprint, errors_path=errors, output=output)
    elif fmt == "npy":
        writer = NpyWriter(file, fingerprint=fingerprint, errors_path=errors, output=output)
    else:
        writer = ParquetWriter(file, fingerprint=fingerprint, errors_path=errors, output=output)
    writer.keep = tuple(keep)
    return writer


