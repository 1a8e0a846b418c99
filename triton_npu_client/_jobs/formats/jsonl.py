"""JSONL: a JSON value per line in (an object keyed by input names, or a bare value for a single-input model);
``{"row": i, "<OUTPUT>": value}`` per line out."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator, Mapping
from typing import IO, Any

import numpy.typing as npt

from .._checkpoint import SavedCheckpoint
from ._base import BadRow, Row, RowSource, Writer, bounded_lines, decoded, strip_bom, too_long


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
                if line is None:
                    yield too_long(f"line {lineno}", self.max_line_bytes)
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


class JsonlWriter(Writer):
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
            record[name] = decoded(value.tolist()) if value.dtype.kind in "OSV" else value.tolist()
        self._ckpt.write(json.dumps(record, ensure_ascii=False).encode() + b"\n")
        return None

