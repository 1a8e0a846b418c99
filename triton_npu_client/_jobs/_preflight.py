"""A scoring job judged against the model's config before any file is opened or any request sent.

:func:`check_model` refuses a model or options no job can use (a stateful or decoupled model, one without a batch
dim, a batch size over ``max_batch_size``, an output the model lacks, a ``.npy`` output for several outputs or a
text output); :func:`score` runs it first. :func:`check_source` refuses an input file every row of which would
fail (a CSV or Parquet file without a column for a required input, a ``.npy`` array of a dtype or row shape the
input does not take, text lines for an input that is not text); ``triton-npu score`` runs both, before a server
starts when the model is in a local repository (:func:`repository_spec` reads its ``config.pbtxt``), and once it
has the server's config otherwise. A row-level problem that only some rows have stays an error row, as always.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .._errors import InputFileError, JobPathError, UnknownOutputError, UsageError
from .._model import ModelSpec, validate_batch, validate_row
from .formats import read_rows
from .formats._base import pyarrow_modules

__all__ = ["check_model", "check_source", "repository_spec"]


def repository_spec(repository: Path, model: str) -> ModelSpec | None:
    """The spec of ``model`` from ``repository/model/config.pbtxt``; None when there is no such file, or when the
    file leaves its inputs or outputs to Triton's auto-complete (then only the server knows them)."""
    path = repository / model / "config.pbtxt"
    try:
        text = path.read_text(encoding="utf-8")
    except (FileNotFoundError, NotADirectoryError):
        return None
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    config = model_config_pb2.ModelConfig()
    try:
        text_format.Parse(text, config)
    except text_format.ParseError as err:
        raise UsageError(f"{path}: not a valid Triton model config: {err}", model=model) from None
    if not config.input or not config.output:
        return None
    config.name = config.name or model  # Triton names a model after its folder
    return ModelSpec.from_config(config)


def check_model(
    spec: ModelSpec,
    *,
    batch_size: int | None,
    concurrency: int,
    outputs: Sequence[str] | None,
    output_format: str | None = None,
    keep: Sequence[str] = (),
) -> int:
    """The rows per request; raises :class:`UsageError` for a model or options a scoring job cannot use.

    ``output_format``: the output file's format (``"npy"`` holds one numeric output); ``keep``: input columns
    carried to the output, which must not be named like an output (or ``row``).
    """
    if spec.sequence is not None or spec.decoupled:
        raise UsageError(
            f"model {spec.name!r} is {'stateful' if spec.sequence is not None else 'decoupled'}: "
            "score() sends stateless requests",
            model=spec.name,
        )
    if not spec.batched:
        raise UsageError(f"model {spec.name!r} has no batch dimension (max_batch_size 0): score() packs rows "
                         "into batches", model=spec.name)
    size = spec.max_batch_size if batch_size is None else batch_size
    if not 1 <= size <= spec.max_batch_size:
        raise UsageError(f"batch_size must be in [1, {spec.max_batch_size}] (the model's max_batch_size), got {size}",
                         model=spec.name)
    if concurrency < 1:
        raise UsageError(f"concurrency must be >= 1, got {concurrency}")
    names = ", ".join(t.name for t in spec.outputs)
    for name in outputs or ():
        if spec.output(name) is None:
            raise UnknownOutputError(f"model {spec.name!r} has no output {name!r} (it has {names})", model=spec.name)
    chosen = [spec.output(name) for name in outputs] if outputs else list(spec.outputs)
    if output_format == "npy":
        if len(chosen) != 1:
            raise UsageError(
                f"model {spec.name!r} gives {len(chosen)} outputs ({', '.join(t.name for t in chosen if t)}) and a "
                ".npy file holds one: choose it with outputs=[NAME] (--output-name), or write JSONL or Parquet, "
                "which hold them all",
                model=spec.name,
            )
        if chosen[0] is not None and chosen[0].dtype == "BYTES":
            raise UsageError(f"output {chosen[0].name!r} of model {spec.name!r} is text (BYTES) and a .npy file "
                             "holds numbers: write JSONL or Parquet", model=spec.name)
        if keep:
            raise UsageError("a .npy output holds one output, not the input columns of keep= (--keep): write "
                             "JSONL or Parquet", model=spec.name)
    for column in keep:
        if column == "row" or spec.output(column) is not None:
            raise UsageError(f"keep= (--keep) column {column!r} is named like a column of the output (row, "
                             f"{names}): rename it in the input", model=spec.name)
    return size


def check_source(
    spec: ModelSpec, source: Path, input_format: str, *, allow_lossy: bool = False, keep: Sequence[str] = ()
) -> None:
    """Raise :class:`UsageError` when every row of the input file ``source`` would fail on ``spec``'s model, or a
    ``keep`` column is not in it; reads its header only (a CSV's first record, a Parquet schema, a ``.npy``
    header)."""
    names = [t.name for t in spec.inputs]
    required = [t.name for t in spec.inputs if not t.optional]
    try:
        # As score() opens it: a file of one value per row for a model of several inputs is refused here.
        reader = read_rows(source, input_names=names, format=input_format)
    except JobPathError:
        raise
    except (ValueError, OSError) as err:
        raise InputFileError(f"input file {source}: {err}", path=source, role="input") from err
    columns: list[str] | None = None
    if input_format == "csv":
        columns = list(getattr(reader, "header", []))
    elif input_format == "parquet":
        columns = list(pyarrow_modules()[1].read_schema(source).names)
    if keep and input_format not in ("jsonl", "csv", "parquet"):
        raise UsageError(f"keep= (--keep) takes named columns of the input, and a {input_format} file has none: "
                         "use JSONL, CSV or Parquet", model=spec.name)
    if columns is not None:
        lacking = [column for column in keep if column not in columns]
        if lacking:
            raise UsageError(f"input file {source} has no column {', '.join(map(repr, lacking))} for keep= (--keep) "
                             f"(its columns: {', '.join(columns)})", model=spec.name)
        one_column_one_input = len(columns) == 1 and len(names) == 1  # the reader pairs them whatever the names
        missing = [name for name in required if name not in columns]
        if missing and not one_column_one_input:
            others = [c for c in columns if c not in names]
            raise UsageError(
                f"input file {source} has no column for input {', '.join(map(repr, missing))} of model "
                f"{spec.name!r} (its inputs: {', '.join(names)}; the file's columns "
                f"{', '.join(others) or 'none'} are not inputs): every row would fail",
                model=spec.name,
            )
        return
    if input_format == "npy" and len(names) == 1:
        shape: tuple[int, ...] = getattr(reader, "shape", ())
        dtype: np.dtype[np.generic] | None = getattr(reader, "dtype", None)
        if dtype is None or len(shape) < 1:
            return
        # A zero row of the file's dtype and row shape: the dtype and shape verdicts do not depend on the values.
        probe = np.zeros((1, *shape[1:]), dtype=dtype)
        try:
            validate_batch(spec, {names[0]: probe}, rows=True, allow_lossy=allow_lossy)
        except UsageError as err:
            raise UsageError(f"input file {source} ({dtype}, rows of shape {shape[1:]}): every row would fail: {err}",
                             model=spec.name) from None
    elif input_format == "txt" and len(names) == 1:
        try:
            validate_row(spec, {names[0]: "text"}, allow_lossy=allow_lossy)
        except UsageError as err:
            raise UsageError(f"input file {source} has a line of text per row: every row would fail: {err}",
                             model=spec.name) from None
