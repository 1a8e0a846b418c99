"""``.npy`` in (a row per leading index) and out (one output, a slot per input row)."""

from __future__ import annotations

import math
import os
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from .._checkpoint import SavedCheckpoint
from ._base import BadRow, ColumnChunk, Row, RowSource, Writer, block_bytes, single_input


class NpySource(RowSource):
    """A ``.npy`` array: a row per leading index, for a single-input model.

    The header comes from ``np.load(mmap_mode="r")``; the rows are then read in blocks with plain reads, because
    the pages a memory map touches count in the process's resident memory until the kernel drops them.
    """

    format = "npy"

    def __init__(self, path: Path, input_names: tuple[str, ...], start: int) -> None:
        super().__init__(path, input_names, start)
        single_input(path, input_names, "npy")
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
        row_bytes = self.dtype.itemsize * math.prod(self.shape[1:])
        index = self.start
        for block in self._blocks(max(1, block_bytes() // row_bytes if row_bytes else self.shape[0])):
            for j in range(len(block)):
                yield self._keyed(block[j], f"row {index + j}")
            index += len(block)

    def _chunks(self, size: int) -> Iterator[ColumnChunk]:
        # About a MiB per read, handed out as views of `size` rows: a read per chunk would cost a system call per
        # request, which is a measurable share of a job of small rows.
        row_bytes = max(1, self.dtype.itemsize * math.prod(self.shape[1:]))
        per_read = size * max(1, (1 << 20) // (row_bytes * size))
        index = self.start
        for block in self._blocks(per_read):
            for lo in range(0, len(block), size):
                part = block[lo : lo + size]
                yield self._values_chunk(index, part)
                index += len(part)

    def _blocks(self, rows: int) -> Iterator[npt.NDArray[Any]]:
        """The array from ``start`` on, ``rows`` rows at a time (the last block may be shorter)."""
        n, row_shape = self.shape[0], self.shape[1:]
        if self._fortran:
            # A Fortran-order row is strided across the whole file: slice the map (rare, and no plain read helps).
            arr = np.load(self.path, mmap_mode="r", allow_pickle=False)
            for i in range(self.start, n, rows):
                yield np.ascontiguousarray(arr[i : i + rows])
            return
        row_bytes = self.dtype.itemsize * math.prod(row_shape)
        if row_bytes == 0:
            for i in range(self.start, n, rows):
                yield np.zeros((min(rows, n - i), *row_shape), self.dtype)
            return
        with open(self.path, "rb") as f:
            f.seek(self._offset + self.start * row_bytes)
            for i in range(self.start, n, rows):
                k = min(rows, n - i)
                buf = f.read(k * row_bytes)
                if len(buf) != k * row_bytes:
                    raise ValueError(f"{self.path} is truncated: its header promises {n} rows, the data ends at {i}")
                yield np.frombuffer(buf, dtype=self.dtype).reshape((k, *row_shape))


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


class NpyWriter(Writer):
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

    def _write_run(self, start: int, n: int, outputs: Mapping[str, npt.NDArray[Any]]) -> str | None:
        if len(outputs) != 1:
            raise ValueError(
                f"{self.path}: a .npy output holds one output, and the model gives {', '.join(outputs)}: choose one "
                "(output=...)"
            )
        ((name, value),) = outputs.items()
        row_shape = value.shape[1:]
        if self._dtype is None:
            if value.dtype.kind not in "biufc":
                raise TypeError(
                    f"output {name!r} has dtype {value.dtype}: a .npy output takes numbers (write text outputs to "
                    "JSONL or Parquet)"
                )
            self.output = name
            self._settle(value.dtype, row_shape, write=True)
        assert self._dtype is not None
        if row_shape != self._row_shape:
            return f"output {name!r} has shape {row_shape}; the .npy rows have {self._row_shape} (the first row's)"
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

