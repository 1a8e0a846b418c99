"""Append-only job output that survives a crash: every row exactly once after a re-run (groundwork for ``score()``).

A job writes its results (and its per-row errors) by appending to files, and now and then *commits*: it flushes and
fsyncs the files, then atomically replaces a small checkpoint file that records how many input rows are done and
how many bytes of each file hold them. Whatever happens after a commit (a SIGKILL mid-write, a power cut after the
fsync) is undone on the next :meth:`ResumableOutput.open`: the files are cut back to the recorded sizes and the job
resumes at the recorded row. So the output never holds a row twice or loses one, provided the job feeds rows in
the same order each run (the fingerprint, e.g. of the input file and the options, guards against resuming a
different job onto the same files).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Self

import attrs

__all__ = ["CheckpointMismatch", "ResumableOutput", "SavedCheckpoint"]


class CheckpointMismatch(RuntimeError):
    """The checkpoint beside the output belongs to another job (its fingerprint differs)."""


@attrs.frozen
class SavedCheckpoint:
    """A checkpoint as read back: the rows it covers, whether the job finished, and the writer's ``meta``."""

    rows: int
    complete: bool
    meta: Mapping[str, Any]


class ResumableOutput:
    """An output file, an optional errors file, and the checkpoint that makes them resumable. See the module docstring.

    ``open()`` returns how many input rows are already done (0 for a fresh job); then ``write()`` rows in order,
    ``commit(rows_done)`` whenever convenient (each commit costs two fsyncs), and ``close()`` once the last rows are
    committed (it marks the job complete); ``abandon()`` closes without committing.
    The checkpoint is ``<output>.checkpoint.json`` unless given; after a complete run it says ``"complete": true``.
    ``path=None`` (then ``checkpoint_path`` is required) keeps no output file of its own: for a writer that makes its
    own files durable before each commit and records what it needs in ``meta``.
    ``commit(..., meta=...)`` stores a small JSON-able dict beside the counts (a writer's own state: a row shape, a
    part count); ``open()`` gives it back as :attr:`meta`, and a commit without ``meta`` keeps the last one.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None,
        *,
        fingerprint: str,
        errors_path: str | os.PathLike[str] | None = None,
        checkpoint_path: str | os.PathLike[str] | None = None,
    ) -> None:
        self.path = None if path is None else Path(path)
        self.errors_path = None if errors_path is None else Path(errors_path)
        if checkpoint_path is not None:
            self.checkpoint_path = Path(checkpoint_path)
        elif self.path is not None:
            self.checkpoint_path = self.path.with_name(self.path.name + ".checkpoint.json")
        else:
            raise ValueError("without an output path, give checkpoint_path")
        self.fingerprint = fingerprint
        self.rows_done = 0
        self.meta: dict[str, Any] = {}
        self._opened = False
        self._out: IO[bytes] | None = None
        self._err: IO[bytes] | None = None
        self._dirty = False  # bytes written since the last commit

    def saved(self) -> SavedCheckpoint | None:
        """What the checkpoint says, touching no file; None when there is none.

        Raises :class:`CheckpointMismatch` when the checkpoint belongs to another job.
        """
        state = self._checked_state()
        if state is None:
            return None
        meta = state.get("meta")
        return SavedCheckpoint(
            rows=int(state["rows"]),
            complete=bool(state.get("complete")),
            meta=dict(meta) if isinstance(meta, dict) else {},
        )

    def open(self) -> int:
        """Cut the files back to the last commit and return the rows it covers (0: a fresh start)."""
        state = self._checked_state()
        if state is None:
            out_size = err_size = 0
            self.rows_done = 0
            self.meta = {}
        else:
            out_size, err_size, self.rows_done = int(state["out_bytes"]), int(state["err_bytes"]), int(state["rows"])
            meta = state.get("meta")
            self.meta = dict(meta) if isinstance(meta, dict) else {}
        if self.path is not None:
            self._out = _open_at(self.path, out_size)
        if self.errors_path is not None:
            self._err = _open_at(self.errors_path, err_size)
        self._opened = True
        return self.rows_done

    def _checked_state(self) -> dict[str, Any] | None:
        state = self._read_checkpoint()
        if state is not None and state.get("fingerprint") != self.fingerprint:
            files = " and ".join(str(p) for p in (self.path, self.errors_path) if p is not None)
            raise CheckpointMismatch(
                f"{self.checkpoint_path} belongs to another job (fingerprint {state.get('fingerprint')!r}, this "
                f"job's is {self.fingerprint!r}): remove it{' and ' + files if files else ''} to start over, or "
                "use other paths"
            )
        return state

    def write(self, data: bytes) -> None:
        """Append output bytes (for example one JSON line per row)."""
        if self._out is None:
            raise RuntimeError("open() the output first")
        self._out.write(data)
        self._dirty = True

    def write_error(self, data: bytes) -> None:
        """Append to the errors file (the reason a row failed)."""
        if self._err is None:
            raise RuntimeError("no errors_path was given, or open() was not called")
        self._err.write(data)
        self._dirty = True

    def commit(self, rows_done: int, *, complete: bool = False, meta: Mapping[str, Any] | None = None) -> None:
        """Make everything written so far durable, and record that the first ``rows_done`` input rows are in it."""
        if not self._opened:
            raise RuntimeError("open() the output first")
        if rows_done < self.rows_done:
            raise ValueError(f"rows_done went back from {self.rows_done} to {rows_done}")
        sizes = []
        for handle in (self._out, self._err):
            if handle is None:
                sizes.append(0)
                continue
            handle.flush()
            os.fsync(handle.fileno())
            sizes.append(handle.tell())
        saved_meta = dict(self.meta if meta is None else meta)
        # The data is on disk before the checkpoint that points to it: a crash between the two only loses work.
        state = {
            "fingerprint": self.fingerprint,
            "rows": rows_done,
            "out_bytes": sizes[0],
            "err_bytes": sizes[1],
            "complete": complete,
            "meta": saved_meta,
        }
        tmp = self.checkpoint_path.with_name(self.checkpoint_path.name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(json.dumps(state).encode())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.checkpoint_path)
        _fsync_dir(self.checkpoint_path.parent)
        self.rows_done = rows_done
        self.meta = saved_meta
        self._dirty = False

    def close(self) -> None:
        """Mark the job complete and close the files. Everything written must be committed first."""
        if self._opened:
            if self._dirty:
                raise RuntimeError("bytes were written after the last commit(rows_done): commit them before close()")
            self.commit(self.rows_done, complete=True)
        self._release()

    def abandon(self) -> None:
        """Close the files without committing: the next open() resumes from the last commit."""
        self._release()

    def _release(self) -> None:
        for handle in (self._out, self._err):
            if handle is not None:
                handle.close()
        self._out = self._err = None
        self._opened = False

    @property
    def complete(self) -> bool:
        """Whether the checkpoint says a previous run finished."""
        state = self._read_checkpoint()
        return bool(state and state.get("complete"))

    def _read_checkpoint(self) -> dict[str, Any] | None:
        try:
            raw = self.checkpoint_path.read_bytes()
        except FileNotFoundError:
            return None
        state = json.loads(raw)
        if not isinstance(state, dict):
            raise CheckpointMismatch(f"{self.checkpoint_path} is not a checkpoint")
        return state

    def __enter__(self) -> Self:
        self.open()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        # An exception leaves the job resumable, not complete: what was written since the last commit is cut
        # back by the next open(), as after a crash.
        if exc_type is None:
            self.close()
        else:
            self.abandon()


def _open_at(path: Path, size: int) -> IO[bytes]:
    """Open ``path`` for appending after cutting it to ``size`` bytes (creating it when absent)."""
    handle = open(path, "ab")  # noqa: SIM115  # the caller owns and closes it
    handle.truncate(size)
    handle.seek(size)
    return handle


def _fsync_dir(folder: Path) -> None:
    # The rename itself must survive a power cut: sync the folder's entry list too (POSIX).
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
