"""CSV in: a header row of input names, then a row per record."""

from __future__ import annotations

import csv
import itertools
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from ._base import SKIP_BYTES, BadRow, Row, RowSource

_INT = re.compile(r"[+-]?\d+")
_FLOAT = re.compile(r"[+-]?(?:\d+\.?\d*(?:[eE][+-]?\d+)?|\.\d+(?:[eE][+-]?\d+)?|nan|inf|infinity)", re.IGNORECASE)


def _all_strings(value: Any) -> bool:
    if isinstance(value, list):
        return all(_all_strings(v) for v in value)
    return isinstance(value, str)


class CsvSource(RowSource):
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
            while (rest := readline(SKIP_BYTES)) and rest[-1] not in "\r\n":
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

