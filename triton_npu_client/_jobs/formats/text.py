"""Plain text in: a row per line, for a single-input model."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

from ._base import BadRow, Row, RowSource, bounded_lines, count_newlines, single_input, strip_bom, too_long


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
                if raw is None:
                    yield too_long(f"line {lineno}", self.max_line_bytes)
                    continue
                line = strip_bom(raw) if lineno == 1 else raw
                line = line[:-1] if line.endswith(b"\n") else line
                line = line[:-1] if line.endswith(b"\r") else line
                try:
                    text = line.decode("utf-8")
                except UnicodeDecodeError as err:
                    yield BadRow(f"line {lineno}: not UTF-8: {err}")
                    continue
                yield self._keyed(text, f"line {lineno}")

    def _count(self) -> int:
        return count_newlines(self.path)

