"""Plain text in: a row per line, for a single-input model."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import numpy.typing as npt

from ._base import BadRow, ColumnChunk, Row, RowSource, bounded_lines, count_newlines, single_input, strip_bom, too_long


class TextSource(RowSource):
    """Plain text: every line is a row (an empty line is an empty string), its newline stripped."""

    format = "txt"

    def __init__(self, path: Path, input_names: tuple[str, ...], start: int, max_line_bytes: int) -> None:
        super().__init__(path, input_names, start, max_line_bytes)
        single_input(path, input_names, "txt")

    def _rows(self) -> Iterator[Row | BadRow]:
        with open(self.path, "rb") as f:
            lines = bounded_lines(f, self.max_line_bytes)
            for lineno, raw in enumerate(itertools.islice(lines, self.start, None), self.start + 1):
                yield self._row(lineno, raw)

    def _row(self, lineno: int, raw: bytes | None) -> Row | BadRow:
        if raw is None:
            return too_long(f"line {lineno}", self.max_line_bytes)
        line = strip_bom(raw) if lineno == 1 else raw
        line = line[:-1] if line.endswith(b"\n") else line
        line = line[:-1] if line.endswith(b"\r") else line
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as err:
            return BadRow(f"line {lineno}: not UTF-8: {err}")
        return self._keyed(text, f"line {lineno}")

    def _chunks(self, size: int) -> Iterator[ColumnChunk]:
        # A chunk's lines are decoded and split as one string; a line too long or not UTF-8 sends the chunk through
        # _row, line by line, for its BadRow.
        with open(self.path, "rb") as f:
            lines = itertools.islice(bounded_lines(f, self.max_line_bytes), self.start, None)
            index = self.start
            while raws := list(itertools.islice(lines, size)):
                texts = _split_lines(raws, first=index == 0)
                if texts is None:
                    yield ColumnChunk(index, len(raws), None, [self._row(index + 1 + j, r) for j, r in enumerate(raws)])
                else:
                    yield self._values_chunk(index, texts)
                index += len(raws)

    def _count(self) -> int:
        return count_newlines(self.path)



def _split_lines(raws: list[bytes | None], *, first: bool) -> npt.NDArray[np.object_] | None:
    """The lines' texts as :meth:`TextSource._row` gives them (newline, then one CR, stripped), or None when a line is
    too long or not UTF-8."""
    if any(raw is None for raw in raws):
        return None
    data = b"".join(raws)  # type: ignore[arg-type]  # no None left
    if first:
        data = strip_bom(data)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    # Lines end in "\n" (readline splits there and nowhere else), the last one perhaps not.
    parts = (text[:-1] if text.endswith("\n") else text).split("\n")
    if "\r" in text:
        parts = [part[:-1] if part.endswith("\r") else part for part in parts]
    values = np.empty(len(parts), dtype=object)
    values[:] = parts
    return values
