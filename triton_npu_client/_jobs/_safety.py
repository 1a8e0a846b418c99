"""A scoring job's paths, checked before any file is opened: the job never destroys data it did not write.

Rules (see docs/scoring.md, "What the job refuses"):

- The output, errors and checkpoint paths are never the input: not the same path, not a symlink to it, not a hard
  link to it (compared by ``st_dev``/``st_ino``). Always refused, ``overwrite`` or not.
- No two of output, errors and checkpoint are the same file.
- A symlink is never followed into truncating its target: a job path that is a symlink is refused; with
  ``overwrite`` the link itself is removed and replaced by a regular file (its target is left alone).
- An existing file the job did not write is refused, unless ``overwrite``. A file the job wrote is recognised by its
  checkpoint (``<output>.checkpoint.json``), which every run writes before it creates the output files.

The typed errors it raises are :class:`UsageError` subclasses (defined in the one tree, ``_errors``); the CLI maps
each to its own exit code.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

# Defined in the one error tree; re-exported here, where the job raises them.
from .._errors import (
    CheckpointFilesMismatch,
    CheckpointMismatch,
    InputFileError,
    InputFileNotFound,
    JobPathError,
    OutputExistsError,
    OutputFolderError,
    ResumeNotConfirmed,
    SameFileError,
    UnknownFormatError,
)

__all__ = [
    "CheckpointFilesMismatch",
    "CheckpointMismatch",
    "InputFileError",
    "InputFileNotFound",
    "JobPathError",
    "OutputExistsError",
    "OutputFolderError",
    "ResumeNotConfirmed",
    "SameFileError",
    "UnknownFormatError",
    "check_input",
    "check_job_paths",
    "read_checkpoint_state",
]


def read_checkpoint_state(path: Path) -> dict[str, Any] | None:
    """A checkpoint's JSON state; None when there is no file. A file that is not a checkpoint raises
    :class:`OutputExistsError` (the job did not write it)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except IsADirectoryError:
        raise OutputExistsError(f"the checkpoint path {path} is a directory", path=path, role="checkpoint") from None
    try:
        state = json.loads(raw)
    except (ValueError, RecursionError):
        state = None
    if not isinstance(state, dict) or not isinstance(state.get("fingerprint"), str) or "rows" not in state:
        raise OutputExistsError(
            f"{path} is not a scoring checkpoint, so the job did not write it: remove it, choose another output, or "
            "pass overwrite=True (--overwrite) to replace it",
            path=path, role="checkpoint",
        )
    return state


def check_input(path: Path) -> os.stat_result:
    """The input file's stat, or a typed error when it is missing, not a file, or unreadable."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise InputFileNotFound(f"input file {path} does not exist", path=path, role="input") from None
    except OSError as err:
        raise InputFileError(f"input file {path} cannot be read: {err.strerror}", path=path, role="input") from None
    if stat.S_ISDIR(st.st_mode):
        raise InputFileError(f"input {path} is a directory, not a file of rows", path=path, role="input")
    try:
        with open(path, "rb"):
            pass
    except OSError as err:
        raise InputFileError(f"input file {path} cannot be read: {err.strerror}", path=path, role="input") from None
    return st


@attrs.frozen
class _Found:
    role: str
    path: Path
    link: bool  # the path itself is a symlink
    st: os.stat_result | None  # what it names (through a link), None when absent or a dangling link


def _look(role: str, path: Path) -> _Found:
    try:
        lst = os.lstat(path)
    except FileNotFoundError:
        return _Found(role, path, False, None)
    if stat.S_ISLNK(lst.st_mode):
        try:
            return _Found(role, path, True, os.stat(path))
        except OSError:
            return _Found(role, path, True, None)
    return _Found(role, path, False, lst)


def _flag(role: str) -> str:
    return {"output": "output", "errors": "errors file", "checkpoint": "checkpoint"}.get(role, role)


def check_job_paths(
    *,
    input_path: Path | None,
    input_stat: os.stat_result | None,
    paths: Sequence[tuple[str, Path]],
    extra: Sequence[tuple[str, Path]] = (),
    overwrite: bool,
    apply: bool = True,
) -> bool:
    """Check the job's ``paths`` (role, path: output, errors, checkpoint) before anything is opened.

    ``extra``: paths the job may write inside (a Parquet parts folder), held only to the input and symlink rules.
    Returns whether a checkpoint exists (the job wrote the files there). With ``overwrite``, a symlink among the
    paths is removed here (the link, never its target) unless ``apply`` is False. Raises the typed errors of this
    module.
    """
    found = [_look(role, path) for role, path in paths]
    found_extra = [_look(role, path) for role, path in extra]
    # 1. Never the input, whatever else is allowed.
    if input_path is not None and input_stat is not None:
        key = (input_stat.st_dev, input_stat.st_ino)
        for f in (*found, *found_extra):
            if f.st is not None and (f.st.st_dev, f.st.st_ino) == key:
                if f.link:
                    what = "a symbolic link to the input"
                elif os.path.realpath(f.path) == os.path.realpath(input_path):
                    what = "the input"
                else:
                    what = "the input's file under another name (a hard link)"
                raise SameFileError(
                    f"the {_flag(f.role)} path {f.path} is {what} {input_path}: the job would destroy its input; "
                    "choose another path",
                    path=f.path, role=f.role, other_role="input",
                )
    # 2. No two of output, errors and checkpoint the same file (by resolved path, or by inode when they exist).
    for i, a in enumerate(found):
        for b in found[i + 1:]:
            same = os.path.realpath(a.path) == os.path.realpath(b.path) or (
                a.st is not None and b.st is not None and (a.st.st_dev, a.st.st_ino) == (b.st.st_dev, b.st.st_ino)
            )
            if same:
                raise SameFileError(
                    f"the {_flag(a.role)} and the {_flag(b.role)} are the same file ({a.path}, {b.path}): give each "
                    "its own path",
                    path=b.path, role=b.role, other_role=a.role,
                )
    # 3. Folders the job can write in; symlinks never written through.
    for f in found:
        folder = f.path.absolute().parent
        if not folder.is_dir():
            raise OutputFolderError(
                f"the folder of the {_flag(f.role)} {f.path} does not exist: create it first", path=f.path, role=f.role
            )
        if not os.access(folder, os.W_OK | os.X_OK):
            raise OutputFolderError(
                f"the folder of the {_flag(f.role)} {f.path} is not writable", path=f.path, role=f.role
            )
    for f in (*found, *found_extra):
        if f.link:
            if not overwrite:
                raise OutputExistsError(
                    f"the {_flag(f.role)} path {f.path} is a symbolic link (to {os.readlink(f.path)}): the job "
                    "writes only files it makes; remove the link, or pass overwrite=True (--overwrite) to replace "
                    "the link itself (its target is left alone)",
                    path=f.path, role=f.role,
                )
        elif f.st is not None and f.role != "parts" and not stat.S_ISREG(f.st.st_mode):
            raise OutputExistsError(
                f"the {_flag(f.role)} path {f.path} exists and is not a regular file", path=f.path, role=f.role
            )
    # 4. Existing files are the job's only when its checkpoint says so.
    checkpoint = next((f for f in found if f.role == "checkpoint"), None)
    owned = False
    if checkpoint is not None and checkpoint.st is not None and not checkpoint.link:
        try:
            owned = read_checkpoint_state(checkpoint.path) is not None
        except OutputExistsError:
            if not overwrite:
                raise
            if apply:
                os.unlink(checkpoint.path)  # not a checkpoint: a file like any other that overwrite replaces
    if not owned and not overwrite:
        for f in found:
            if f.st is not None:
                raise OutputExistsError(
                    f"the {_flag(f.role)} {f.path} exists and this job did not write it (no checkpoint "
                    f"{checkpoint.path if checkpoint else ''} vouches for it; a complete job removes its checkpoint "
                    "unless keep_checkpoint=True (--keep-checkpoint)): choose another path, remove it, or pass "
                    "overwrite=True (--overwrite) to replace it",
                    path=f.path, role=f.role,
                )
    if overwrite and apply:
        for f in (*found, *found_extra):
            if f.link:
                os.unlink(f.path)
    return owned
