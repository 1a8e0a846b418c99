"""JSONL: a JSON value per line in (an object keyed by input names, or a bare value for a single-input model);
``{"row": i, "<OUTPUT>": value}`` per line out."""

from __future__ import annotations

import itertools
import json
import secrets
from collections.abc import Iterator, Mapping
from typing import IO, Any

import numpy.typing as npt

from .._checkpoint import SavedCheckpoint
from ._base import BadRow, ColumnChunk, Row, RowSource, Writer, bounded_lines, decoded, strip_bom, too_long


class JsonlSource(RowSource):
    """JSONL: one JSON value per line; blank lines are no rows."""

    format = "jsonl"

    def _lines(self, f: IO[bytes]) -> Iterator[tuple[int, bytes | None]]:
        for lineno, line in enumerate(bounded_lines(f, self.max_line_bytes), 1):
            if line is None:
                yield lineno, None  # too long: a row, whatever it held
                continue
            if lineno == 1:
                line = strip_bom(line)
            if line.strip():
                yield lineno, line

    def _rows(self) -> Iterator[Row | BadRow]:
        with open(self.path, "rb") as f:
            for lineno, line in itertools.islice(self._lines(f), self.start, None):
                yield self._row(lineno, line)

    def _row(self, lineno: int, line: bytes | None) -> Row | BadRow:
        if line is None:
            return too_long(f"line {lineno}", self.max_line_bytes)
        try:
            value = json.loads(line)
        except (ValueError, RecursionError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            return BadRow(f"line {lineno}: invalid JSON: {err}")
        return self._keyed(value, f"line {lineno}")

    def _chunks(self, size: int) -> Iterator[ColumnChunk]:
        # A fresh sentinel per pass, which no file can hold but by chance (2**-128), marks where each line ended.
        sentinel = secrets.token_hex(16)
        glue = b',"' + sentinel.encode() + b'",'
        with open(self.path, "rb") as f:
            lines = itertools.islice(self._lines(f), self.start, None)
            index = self.start
            while batch := list(itertools.islice(lines, size)):
                values = _parse_together([line for _, line in batch], glue, sentinel)
                if values is None:
                    yield ColumnChunk(index, len(batch), None, [self._row(n, line) for n, line in batch])
                else:
                    yield self._parsed_chunk(index, [n for n, _ in batch], values)
                index += len(batch)

    def _parsed_chunk(self, start: int, linenos: list[int], values: list[Any]) -> ColumnChunk:
        """Parsed lines as a chunk: columns when they are objects of the same keys, or bare values for one input."""
        names, first = self.input_names, values[0]
        if names and isinstance(first, dict):
            keys = first.keys()
            picked = [k for k in keys if k in names]
            if picked and all(isinstance(v, dict) and v.keys() == keys for v in values):
                return ColumnChunk(start, len(values), {k: [v[k] for v in values] for k in picked})
        elif len(names) == 1 and not any(isinstance(v, dict) for v in values):
            return ColumnChunk(start, len(values), {names[0]: values})
        rows = [self._keyed(v, f"line {n}") for n, v in zip(linenos, values, strict=True)]
        return self._rows_chunk(start, rows)

    def _count(self) -> int:
        with open(self.path, "rb") as f:
            return sum(1 for _ in self._lines(f))


class JsonlWriter(Writer):
    format = "jsonl"

    def _verify_format(self, saved: SavedCheckpoint, mismatch: Any) -> None:
        written = int(saved.meta.get("rows_written", 0))
        if "rows_written" in saved.meta and (written > 0) != (saved.out_bytes > 0):
            raise mismatch(f"counts {written:,} rows written in {saved.out_bytes:,} bytes of {self.path}")

    def _write_run(self, start: int, n: int, outputs: Mapping[str, npt.NDArray[Any]]) -> str | None:
        if "row" in outputs:
            raise ValueError("an output named 'row' clashes with the row index in JSONL output: choose the outputs")
        # Each line is the text json.dumps({"row": i, name: value.tolist(), ...}, ensure_ascii=False) gives, put
        # together from each output's per-row texts, rendered a run at a time.
        line = '{"row": %d' + "".join(f", {_encode(name)}: %s".replace("%", "%%").replace("%%s", "%s")
                                      for name in outputs) + "}\n"
        texts = [_row_texts(value, n) for value in outputs.values()]
        rows = zip(range(start, start + n), *texts, strict=True)
        self._ckpt.write("".join([line % row for row in rows]).encode())
        return None


_encode = json.JSONEncoder(ensure_ascii=False).encode  # what json.dumps(..., ensure_ascii=False) uses


def _row_texts(run: npt.NDArray[Any], n: int) -> list[str]:
    """The JSON text of each row of ``run`` (``n`` rows on its first axis)."""
    if run.dtype.kind in "OSV":
        # Only BYTES outputs (object arrays) hold bytes to decode; numbers go out as tolist() gives them.
        return [_encode(value) for value in decoded(run.tolist())]
    if run.dtype.kind not in "biuf" or run.size == 0:
        return [_encode(value) for value in run.tolist()]
    # Numbers: one text for the run, cut between rows. A row of k dims is k brackets deep whole; only between
    # two rows do k closing brackets meet k opening ones (within a row at most k - 1 do), and no number holds ", ".
    k = run.ndim - 1
    parts = _encode(run.tolist())[1:-1].split("]" * k + ", " + "[" * k)
    if k and n > 1:
        parts = [parts[0] + "]" * k, *("[" * k + part + "]" * k for part in parts[1:-1]), "[" * k + parts[-1]]
    return parts


def _parse_together(lines: list[bytes | None], glue: bytes, sentinel: str) -> list[Any] | None:
    """The JSON value of each line from one parse of them all, or None when a line is too long or not exactly one
    valid JSON value (the caller then parses line by line, for the BadRow).

    The lines are parsed as ``[line1 ,"<sentinel>", line2 ...]``: every line keeps its newline, so no string can run
    from one line into the next (JSON forbids a raw newline in a string), and the sentinels sit at every odd place
    of the list exactly when each line held one whole value.
    """
    if any(line is None for line in lines):
        return None
    try:
        parsed = json.loads(b"[" + glue.join(lines) + b"]")  # type: ignore[arg-type]  # no None left
    except (ValueError, RecursionError):
        return None
    if len(parsed) != 2 * len(lines) - 1 or parsed[1::2] != [sentinel] * (len(lines) - 1):
        return None
    return parsed[::2]  # type: ignore[no-any-return]
