"""Append-only job output that survives a crash: every row exactly once after a re-run (groundwork for ``score()``).

A job writes its results (and its per-row errors) by appending to files, and now and then *commits*: it flushes and
fsyncs the files, then atomically replaces a small checkpoint file that records how many input rows are done and
how many bytes of each file hold them. Whatever happens after a commit (a SIGKILL mid-write, a power cut after the
fsync) is undone on the next :meth:`ResumableOutput.open`: the files are cut back to the recorded sizes and the job
resumes at the recorded row. So the output never holds a row twice or loses one, provided the job feeds rows in
the same order each run (the fingerprint, e.g. of the input file and the options, guards against resuming a
different job onto the same files).

The files are never grown to fit the checkpoint: an output that is missing or shorter than the bytes a checkpoint
committed is a :class:`CheckpointFilesMismatch` (restore the file, or delete the checkpoint to start over), never a
file padded with NUL bytes. A fresh job writes its checkpoint (0 rows) before it creates its files, so every file it
made is vouched for by a checkpoint, even after a crash before the first commit. Paths are opened without following
a symlink (``O_NOFOLLOW``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Self

import attrs

from ._safety import CheckpointFilesMismatch, CheckpointMismatch, read_checkpoint_state

__all__ = ["CheckpointFilesMismatch", "CheckpointMismatch", "ResumableOutput", "SavedCheckpoint"]


@attrs.frozen
class SavedCheckpoint:
    """A checkpoint as read back: the rows it covers, whether the job finished, and the writer's ``meta``."""

    rows: int
    complete: bool
    meta: Mapping[str, Any]
    out_bytes: int = 0
    err_bytes: int = 0


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
            out_bytes=int(state.get("out_bytes", 0)),
            err_bytes=int(state.get("err_bytes", 0)),
        )

    def verify(self, saved: SavedCheckpoint) -> None:
        """Raise :class:`CheckpointFilesMismatch` when a file the checkpoint describes is missing or shorter than the
        bytes it committed. Longer is normal: an uncommitted tail, cut back by ``open()``."""
        for path, committed in ((self.path, saved.out_bytes), (self.errors_path, saved.err_bytes)):
            if path is None or committed <= 0:
                continue
            try:
                size = os.lstat(path).st_size
            except FileNotFoundError:
                problem = "is missing"
            else:
                if size >= committed:
                    continue
                problem = f"has only {size:,} bytes"
            raise CheckpointFilesMismatch(
                f"{self.checkpoint_path} records {saved.rows:,} rows done in the first {committed:,} bytes of {path}, "
                f"but {path} {problem}: restore {path.name}, or delete {self.checkpoint_path.name} to start over"
            )

    def open(self) -> int:
        """Cut the files back to the last commit and return the rows it covers (0: a fresh start)."""
        state = self._checked_state()
        if state is None:
            out_size = err_size = 0
            self.rows_done = 0
            self.meta = {}
            # Before any file is made: from now on a checkpoint vouches for the files this job creates.
            self._write_state({"fingerprint": self.fingerprint, "rows": 0, "out_bytes": 0, "err_bytes": 0,
                               "complete": False, "meta": {}, "errors": self._errors_name()})
        else:
            saved = self.saved()
            assert saved is not None
            self.verify(saved)
            out_size, err_size, self.rows_done = saved.out_bytes, saved.err_bytes, saved.rows
            self.meta = dict(saved.meta)
        if self.path is not None:
            self._out = _open_at(self.path, out_size, self.checkpoint_path)
        if self.errors_path is not None:
            self._err = _open_at(self.errors_path, err_size, self.checkpoint_path)
        self._opened = True
        return self.rows_done

    def _errors_name(self) -> str | None:
        """The errors file as the checkpoint records it: relative to the checkpoint's folder (a moved job folder
        still matches)."""
        if self.errors_path is None:
            return None
        return os.path.relpath(os.path.abspath(self.errors_path), os.path.abspath(self.checkpoint_path.parent))

    def _checked_state(self) -> dict[str, Any] | None:
        state = self._read_checkpoint()
        if state is not None and "errors" in state and state["errors"] != self._errors_name():
            # Another errors file would be cut to the recorded size: it is not the file this checkpoint describes.
            raise CheckpointMismatch(
                f"{self.checkpoint_path} was written with the errors file {state['errors']!r} (relative to its "
                f"folder), and this job names {self._errors_name()!r}: give the same errors path to resume, or pass "
                "overwrite=True (--overwrite) to start over"
            )
        if state is not None and state.get("fingerprint") != self.fingerprint:
            files = " and ".join(str(p) for p in (self.path, self.errors_path) if p is not None)
            raise CheckpointMismatch(
                f"{self.checkpoint_path} belongs to another job (fingerprint {state.get('fingerprint')!r}, this "
                f"job's is {self.fingerprint!r}: the input or the options changed): remove it"
                f"{' and ' + files if files else ''} or pass overwrite=True (--overwrite) to start over, or use other "
                "paths"
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
            "errors": self._errors_name(),
        }
        self._write_state(state)
        self.rows_done = rows_done
        self.meta = saved_meta
        self._dirty = False

    def _write_state(self, state: Mapping[str, Any]) -> None:
        tmp = self.checkpoint_path.with_name(self.checkpoint_path.name + ".tmp")
        # A fresh name, never opened through a link: whatever sits at the tmp path (a leftover, a symlink) goes.
        tmp.unlink(missing_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        with open(fd, "wb") as f:
            f.write(json.dumps(state).encode())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.checkpoint_path)
        _fsync_dir(self.checkpoint_path.parent)

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
        # A file that is not a checkpoint raises OutputExistsError: the job did not write it.
        return read_checkpoint_state(self.checkpoint_path)

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


def _open_at(path: Path, size: int, checkpoint: Path) -> IO[bytes]:
    """Open ``path`` for appending after cutting it to ``size`` bytes (creating it only when ``size`` is 0).

    Never grows a file (truncate() past the end pads with NUL bytes) and never follows a symlink.
    """
    flags = os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_CREAT if size == 0 else 0)
    try:
        fd = os.open(path, flags, 0o666)
    except FileNotFoundError:
        raise CheckpointFilesMismatch(
            f"{checkpoint} records {size:,} committed bytes of {path}, but {path} is missing: restore it, or delete "
            f"{checkpoint.name} to start over"
        ) from None
    # A MiB of buffer: a job writes a run of rows at a time, and each system call costs more than the copy; commit()
    # flushes before it fsyncs, so what a checkpoint vouches for is on disk whatever the buffer holds.
    handle = open(fd, "ab", buffering=1 << 20)  # noqa: SIM115  # the caller owns and closes it
    try:
        have = os.fstat(fd).st_size
        if have < size:
            raise CheckpointFilesMismatch(
                f"{checkpoint} records {size:,} committed bytes of {path}, but it has only {have:,}: restore it, or "
                f"delete {checkpoint.name} to start over"
            )
        handle.truncate(size)
        handle.seek(size)
    except BaseException:
        handle.close()
        raise
    return handle


def _fsync_dir(folder: Path) -> None:
    # The rename itself must survive a power cut: sync the folder's entry list too (POSIX).
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
