"""A scoring job's plan: its paths checked, its formats known, its checkpoint judged, before any file is opened.

:func:`plan_job` is what :func:`score` runs first, and what ``triton-npu score`` runs before it starts a server, so
that every mistake in paths, formats or checkpoints is found in a stat or two, never after minutes of work. It
needs only the model's name, not the model.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import attrs

from ._checkpoint import SavedCheckpoint
from ._safety import CheckpointMismatch, ResumeNotConfirmed, check_input, check_job_paths
from .formats import ResultWriter, input_fingerprint, input_format, open_writer, output_format

__all__ = ["JobPlan", "plan_job"]

PathLike = str | os.PathLike[str]


@attrs.frozen
class JobPlan:
    """What :func:`plan_job` found. ``source``: the input file (None for an in-memory source); ``saved``: the
    checkpoint the job resumes from (None: a fresh start)."""

    source: Path | None
    input_format: str | None
    output: Path
    errors: Path
    checkpoint: Path
    fingerprint: str
    writer: ResultWriter
    saved: SavedCheckpoint | None


def default_errors_path(output: Path) -> Path:
    return output.with_name(output.name + ".errors.jsonl")


def plan_job(
    source: PathLike | None,
    output: PathLike,
    *,
    model: str,
    errors: PathLike | None = None,
    batch_size: int | None = None,
    outputs: Sequence[str] | None = None,
    input_format_name: str | None = None,
    output_format_name: str | None = None,
    overwrite: bool = False,
    resume: bool = False,
    apply: bool = True,
    keep: Sequence[str] = (),
) -> JobPlan:
    """Check a job before anything is opened; see :mod:`._safety` for the rules and errors.

    ``source`` None: an in-memory source, which resumes from a checkpoint only with ``resume`` (and starts over
    only with ``overwrite``). ``overwrite``: replace files the job did not write, a symlink at a job path (the link,
    not its target), and a checkpoint of another job or one that disagrees with its files (the job starts over).
    ``apply`` False: judge only, change nothing (the CLI before it starts a server). ``keep``: input fields the
    output carries (part of the job's identity).
    """
    output = Path(output)
    errors_path = Path(errors) if errors is not None else default_errors_path(output)
    src: Path | None = None
    fmt_in: str | None = None
    st = None
    if source is not None:
        src = Path(source)
        st = check_input(src)
        fmt_in = input_format(src, input_format_name)
    output_format(output, output_format_name)
    options = f"model={model};batch={batch_size};outputs={list(outputs) if outputs else None}"
    if keep:
        options += f";keep={list(keep)}"  # only then: the fingerprint of a job without keep is as it always was
    fingerprint = (input_fingerprint(src, fmt_in, st) if src is not None and fmt_in is not None else "iterable")
    fingerprint += f";{options}"
    writer = open_writer(output, fingerprint=fingerprint, errors_path=errors_path, format=output_format_name,
                         keep=keep, **({"output": outputs[0]} if outputs and len(outputs) == 1 else {}))
    owned = check_job_paths(
        input_path=src, input_stat=st,
        paths=[("output", output), ("errors", errors_path), ("checkpoint", writer.checkpoint_path)],
        extra=writer.extra_paths(), overwrite=overwrite, apply=apply,
    )
    saved = None
    if owned:
        if source is None and not resume:
            if not overwrite:
                raise ResumeNotConfirmed(
                    f"{writer.checkpoint_path} holds an earlier run of a job with an in-memory source, which cannot "
                    "be checked for changes: pass resume=True if the iterable yields the same rows in the same "
                    "order, overwrite=True to start over, or choose another output",
                    path=writer.checkpoint_path, role="checkpoint",
                )
            if apply:
                writer.reset()
        else:
            try:
                saved = writer.inspect()
            except CheckpointMismatch:
                if not overwrite:
                    raise
                if apply:
                    writer.reset()
    return JobPlan(
        source=src, input_format=fmt_in, output=output, errors=errors_path, checkpoint=writer.checkpoint_path,
        fingerprint=fingerprint, writer=writer, saved=saved,
    )
