"""Scoring: push many rows through a stateless model, packed into batches, bounded, in order, losing none.

:func:`score_rows` is the engine, for your own code: rows in, one :class:`ScoredRow` per row out, in input order.
:func:`score` drives it from a file or an iterable into a resumable output file (see ``_formats``), with progress,
an errors file and a summary; :func:`score_sync` is the same for scripts that are not async.

How a row travels:

1. It is checked alone against the model's config (names, dtype, shape): a bad row becomes an error row at once
   and never spoils the request its neighbours travel in.
2. Consecutive good rows of the same shapes are packed into one request of up to ``batch_size`` rows (default:
   the model's ``max_batch_size``). A shape change (variable-length inputs) starts a new request.
3. At most ``concurrency`` requests are in flight (``ordered_map``); the input is pulled only as they finish, so
   memory stays bounded whatever the input's size.
4. A request that fails *transiently* (no connection, server unavailable, the model gone while a server restarts,
   a timeout) is sent again with backoff until ``patience_s`` has passed since its first failure; then the job
   stops with that error, and a re-run of :func:`score` resumes from the last commit. A transient failure never
   turns a row into an error row: the row was never judged.
5. A request that fails for another reason (the server refused it, the model raised) is split in halves and each
   half sent again, down to single rows: only the rows that fail alone become error rows.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

import attrs
import numpy as np
import numpy.typing as npt

from .._call import USE_CLIENT_DEFAULT, UseClientDefault
from .._errors import (
    ConnectError,
    InputShapeError,
    JobAborted,
    MissingInputError,
    ModelNotFoundError,
    ModelNotReadyError,
    RequestTimeout,
    RowParseError,
    ServerUnavailable,
    UsageError,
)
from .._model import ModelSpec, TensorSpec
from .._model._build import _fmt, _shape_matches
from .._wire import InferResult
from .._wire._dtypes import coerce
from ._formats import MAX_LINE_BYTES, BadRow, read_rows
from ._ordered import ordered_map
from ._plan import plan_job
from ._progress import Progress
from ._safety import InputFileError, JobPathError

if TYPE_CHECKING:
    from .._client import Model

__all__ = ["Row", "ScoreSummary", "ScoredRow", "score", "score_rows", "score_sync"]

_log = logging.getLogger("triton_npu_client.score")

Row: TypeAlias = Mapping[str, Any] | Any
Arrays: TypeAlias = dict[str, npt.NDArray[Any]]
PathLike: TypeAlias = str | os.PathLike[str]


@attrs.frozen
class ScoredRow:
    """One input row's outcome: its outputs (one sample each, no batch dim), or the typed error that refused it."""

    index: int
    outputs: Mapping[str, npt.NDArray[Any]] | None
    error: Exception | None = None
    # The row as given, kept only when it failed: what the errors file records for a re-run.
    input: Any = attrs.field(default=None, repr=False, eq=False)

    @property
    def ok(self) -> bool:
        return self.error is None


@attrs.frozen(kw_only=True)
class ScoreSummary:
    """What a :func:`score` run did. ``rows_ok``/``rows_failed`` count this run; ``resumed_from`` the rows before it;
    ``job_rows_ok``/``job_rows_failed`` count every run of the job (what the output and errors files hold)."""

    output: Path
    errors: Path
    rows_ok: int
    rows_failed: int
    resumed_from: int
    elapsed_s: float
    complete: bool
    job_rows_ok: int = -1
    job_rows_failed: int = -1

    def __attrs_post_init__(self) -> None:
        # A summary made by hand (no earlier runs known): the job is this run.
        if self.job_rows_ok < 0:
            object.__setattr__(self, "job_rows_ok", self.rows_ok)
        if self.job_rows_failed < 0:
            object.__setattr__(self, "job_rows_failed", self.rows_failed)

    @property
    def job_rows(self) -> int:
        return self.job_rows_ok + self.job_rows_failed

    @property
    def rows(self) -> int:
        return self.rows_ok + self.rows_failed

    @property
    def rows_per_s(self) -> float:
        return self.rows / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def __str__(self) -> str:
        resumed = f", resumed after {self.resumed_from:,} rows" if self.resumed_from else ""
        state = "" if self.complete else " (incomplete)"
        return (
            f"scored {self.rows:,} rows in {self.elapsed_s:.1f} s ({self.rows_per_s:,.0f} rows/s){resumed}: "
            f"{self.rows_ok:,} ok, {self.rows_failed:,} failed{state}; output {self.output}, errors {self.errors}"
        )


# -- one row, checked alone -------------------------------------------------------------------------------------


def _row_arrays(row: Row, spec: ModelSpec) -> Arrays:
    """The row's value for each model input, coerced and shape-checked as one sample; raises a typed InputError."""
    inputs = spec.inputs
    if not isinstance(row, Mapping):
        if len(inputs) != 1:
            raise UsageError(
                f"model {spec.name!r} has {len(inputs)} inputs ({', '.join(t.name for t in inputs)}): "
                f"give each row as a mapping from input name to value, not a {type(row).__name__}",
                model=spec.name,
            )
        row = {inputs[0].name: row}
    arrays: Arrays = {}
    for tensor in inputs:
        if tensor.name not in row:
            if tensor.optional:
                continue
            raise MissingInputError(
                f"input {tensor.name!r} missing from the row (it has {', '.join(map(repr, row)) or 'no keys'})",
                input_name=tensor.name,
                model=spec.name,
            )
        arrays[tensor.name] = _sample(row[tensor.name], tensor, spec)
    return arrays


def _sample(value: object, tensor: TensorSpec, spec: ModelSpec) -> npt.NDArray[Any]:
    arr = coerce(value, tensor.dtype, name=tensor.name, model=spec.name)
    dims = tensor.dims
    if arr.ndim == 0 and len(dims) == 1 and dims[0] in (1, -1):
        arr = arr.reshape(1)  # a scalar for a one-element vector input: the usual "TEXT dims [1]" case
    if not _shape_matches(arr.shape, dims):
        raise InputShapeError(
            f"input {tensor.name!r}: expected shape {_fmt(dims)} per row, given {_fmt(arr.shape)}",
            input_name=tensor.name,
            model=spec.name,
        )
    return arr


# -- packing ----------------------------------------------------------------------------------------------------


@attrs.frozen
class _Chunk:
    """What one slot of ordered_map carries: consecutive rows, in order.

    ``entries`` are every row's (index, its own error or None, the row as given); the good ones travel together
    as ``batch`` (one array per input, rows stacked in order) in one request. Refused rows ride along, so order
    is kept for free.
    """

    entries: list[tuple[int, Exception | None, Any]]
    good: list[int]
    batch: Arrays | None


def _fast_batch(raw: list[tuple[int, Any]], spec: ModelSpec) -> Arrays | None:
    """All rows coerced and checked at once, or None when any row needs a look of its own.

    The common case (every row well formed) costs one conversion per input instead of one per row; whenever it
    fails, the per-row path decides, so the outcome is the same as checking each row alone.
    """
    inputs = spec.inputs
    single = len(inputs) == 1
    columns: dict[str, list[Any]] = {t.name: [] for t in inputs}
    for _, row in raw:
        if isinstance(row, BadRow):
            return None
        if not isinstance(row, Mapping):
            if not single:
                return None
            columns[inputs[0].name].append(row)
            continue
        for tensor in inputs:
            if tensor.name not in row:
                return None  # missing, or an optional input some rows leave out
            columns[tensor.name].append(row[tensor.name])
    batch: Arrays = {}
    try:
        for tensor in inputs:
            arr = coerce(columns[tensor.name], tensor.dtype, name=tensor.name, model=spec.name)
            dims = tensor.dims
            if arr.ndim == 1 and len(dims) == 1 and dims[0] in (1, -1):
                arr = arr.reshape(-1, 1)
            if arr.shape[0] != len(raw) or not _shape_matches(arr.shape[1:], dims):
                return None
            batch[tensor.name] = arr
    except UsageError:
        return None
    return batch


def _pack(raw: list[tuple[int, Any]], spec: ModelSpec) -> list[_Chunk]:
    fast = _fast_batch(raw, spec)
    if fast is not None:
        return [_Chunk([(index, None, row) for index, row in raw], [index for index, _ in raw], fast)]
    # Row by row: refused rows get their own error; good rows are grouped by shape, in order.
    chunks: list[_Chunk] = []
    entries: list[tuple[int, Exception | None, Any]] = []
    good: list[tuple[int, Arrays]] = []
    signature: object = None

    def flush() -> None:
        batch = {name: np.stack([arrays[name] for _, arrays in good]) for name in good[0][1]} if good else None
        chunks.append(_Chunk(list(entries), [index for index, _ in good], batch))
        entries.clear()
        good.clear()

    for index, row in raw:
        if isinstance(row, BadRow):
            entries.append((index, RowParseError(row.reason), None))
            continue
        try:
            arrays = _row_arrays(row, spec)
        except UsageError as err:
            entries.append((index, err, row))
            continue
        sig = tuple((name, arr.shape) for name, arr in arrays.items())
        if good and sig != signature:
            flush()
        signature = sig
        good.append((index, arrays))
        entries.append((index, None, row))
    if entries:
        flush()
    return chunks


async def _chunks(
    rows: Iterable[Any] | AsyncIterable[Any], spec: ModelSpec, batch_size: int, start: int
) -> AsyncIterator[_Chunk]:
    raw: list[tuple[int, Any]] = []
    index = start
    source: AsyncIterator[Any] | None = aiter(rows) if isinstance(rows, AsyncIterable) else None
    iterator = None if source is not None else iter(rows)  # type: ignore[arg-type]
    try:
        while True:
            if source is not None:
                try:
                    row = await anext(source)
                except StopAsyncIteration:
                    break
            else:
                assert iterator is not None
                try:
                    row = next(iterator)
                except StopIteration:
                    break
            raw.append((index, row))
            index += 1
            if len(raw) >= batch_size:
                for chunk in _pack(raw, spec):
                    yield chunk
                raw = []
        if raw:
            for chunk in _pack(raw, spec):
                yield chunk
    finally:
        close = getattr(source, "aclose", None)
        if close is not None:
            await close()


# -- sending, with retries and isolation ----------------------------------------------------------------------------


def _transient(err: BaseException) -> bool:
    # A model that is missing or not ready was there when the job began (its config was read): it is coming back
    # with a restarting server. A timeout on a stateless request is safe to repeat.
    return isinstance(err, ConnectError | ServerUnavailable | RequestTimeout | ModelNotFoundError | ModelNotReadyError)


@attrs.define
class _Sender:
    model: Model
    outputs: Sequence[str] | None
    timeout_s: float | UseClientDefault | None
    patience_s: float
    pool: Any = None  # a SharedMemoryPool when shared memory is on

    async def send(self, indices: list[int], batch: Arrays) -> dict[int, Mapping[str, npt.NDArray[Any]] | Exception]:
        """Each row's outputs or error; isolates the rows that fail alone by halving."""
        try:
            result = await self._send_transient(batch)
        except JobAborted:
            raise
        except Exception as err:
            if len(indices) == 1:
                return {indices[0]: err}
            mid = len(indices) // 2
            first = await self.send(indices[:mid], {name: arr[:mid] for name, arr in batch.items()})
            return first | await self.send(indices[mid:], {name: arr[mid:] for name, arr in batch.items()})
        outs = {name: result[name] for name in result}
        return {index: {name: out[i] for name, out in outs.items()} for i, index in enumerate(indices)}

    async def _send_transient(self, batch: Arrays) -> InferResult:
        first_failure: float | None = None
        delay = 0.1
        while True:
            try:
                if self.pool is not None:
                    return await self.pool.infer_batch(batch, outputs=self.outputs)  # type: ignore[no-any-return]
                return await self.model.infer_batch(batch, outputs=self.outputs, timeout_s=self.timeout_s)
            except Exception as err:
                if not _transient(err):
                    raise
                now = time.monotonic()
                if first_failure is None:
                    first_failure = now
                elif now - first_failure > self.patience_s:
                    raise JobAborted(
                        f"model {self.model.name!r} unreachable for {now - first_failure:.0f} s "
                        f"(patience_s={self.patience_s:g}); last error: {err}",
                        model=self.model.name,
                    ) from err
                _log.info("transient failure (%s); retrying in %.2f s", err, delay)
                await asyncio.sleep(delay * (0.5 + random.random() / 2))  # jitter: many slots do not retry in step
                delay = min(delay * 2, 2.0)


async def score_rows(
    model: Model,
    rows: Iterable[Any] | AsyncIterable[Any],
    *,
    concurrency: int = 4,
    batch_size: int | None = None,
    outputs: Sequence[str] | None = None,
    start: int = 0,
    shared_memory: bool = False,
    timeout_s: float | UseClientDefault | None = USE_CLIENT_DEFAULT,
    patience_s: float = 120.0,
) -> AsyncIterator[ScoredRow]:
    """Score ``rows`` on a stateless batched ``model``: one :class:`ScoredRow` per row, in input order.

    A row is a mapping from input name to one sample's value, or a bare value for a one-input model. ``start`` is
    the index given to the first row (a resumed job). See the module docstring for packing, retries and
    isolation; :class:`JobAborted` ends the iteration when the server stays unreachable past ``patience_s``.
    Leaving the loop early cancels the requests in flight.
    """
    spec = model.spec
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
    if outputs is not None:
        for name in outputs:
            if spec.output(name) is None:
                from .._errors import UnknownOutputError

                raise UnknownOutputError(
                    f"model {spec.name!r} has no output {name!r} (it has {', '.join(t.name for t in spec.outputs)})",
                    model=spec.name,
                )
    pool = None
    if shared_memory:
        from .._client._shm import SharedMemoryPool

        pool = await SharedMemoryPool.open(model, slots=concurrency)
    sender = _Sender(model, outputs, timeout_s, patience_s, pool)

    async def run(chunk: _Chunk) -> dict[int, Mapping[str, npt.NDArray[Any]] | Exception]:
        return await sender.send(chunk.good, chunk.batch) if chunk.batch is not None else {}

    try:
        # A window of 4x the requests in flight: a slow request at the head does not idle the other slots.
        chunks = _chunks(rows, spec, size, start)
        async for chunk, outcome in ordered_map(chunks, run, concurrency=concurrency, window=4 * concurrency):
            if isinstance(outcome, JobAborted):
                raise outcome
            for index, refused, row in chunk.entries:
                if refused is not None:
                    yield ScoredRow(index, None, refused, row)
                elif isinstance(outcome, Exception):
                    yield ScoredRow(index, None, outcome, row)  # not expected: send() isolates per row
                else:
                    got = outcome[index]
                    if isinstance(got, Exception):
                        yield ScoredRow(index, None, got, row)
                    else:
                        yield ScoredRow(index, got, None)
    finally:
        if pool is not None:
            await pool.aclose()


# -- the job: source -> model -> resumable output -----------------------------------------------------------------


def _skip(rows: Iterable[Any] | AsyncIterable[Any], n: int) -> Iterable[Any] | AsyncIterable[Any]:
    if n == 0:
        return rows
    if isinstance(rows, AsyncIterable):

        async def skipped() -> AsyncIterator[Any]:
            i = 0
            async for row in rows:
                if i >= n:
                    yield row
                i += 1

        return skipped()
    import itertools

    return itertools.islice(rows, n, None)


async def score(
    model: Model,
    source: PathLike | Iterable[Any] | AsyncIterable[Any],
    output: PathLike,
    *,
    errors: PathLike | None = None,
    concurrency: int = 4,
    batch_size: int | None = None,
    outputs: Sequence[str] | None = None,
    progress: bool | None = None,
    shared_memory: bool = False,
    input_format: str | None = None,
    output_format: str | None = None,
    timeout_s: float | UseClientDefault | None = USE_CLIENT_DEFAULT,
    patience_s: float = 120.0,
    commit_every_s: float = 1.0,
    overwrite: bool = False,
    resume: bool = False,
    max_line_bytes: int = MAX_LINE_BYTES,
) -> ScoreSummary:
    """Score every row of ``source`` (a file or an iterable) into ``output``; resumable. Returns a summary.

    Files: JSONL, CSV, ``.npy``, ``.txt`` (one row per line), Parquet with pyarrow. Output: JSONL (a ``row`` index
    and each output per line), ``.npy`` (one output) or Parquet. Rows the model refuses go to ``errors`` (default
    ``<output>.errors.jsonl``) with the reason, and the job goes on. The output is committed about every
    ``commit_every_s``; after a crash or Ctrl-C, calling again with the same arguments resumes after the last commit,
    and every row ends up in the output (or the errors file) exactly once. ``progress``: a progress bar on stderr
    (default: when it is a terminal).

    Before anything is opened the paths are checked (docs/scoring.md, "What the job refuses"): an output, errors or
    checkpoint path that is the input (also through a link) is refused, and so is an existing file the job did not
    write (its checkpoint vouches for those it did), a symlink, or a checkpoint that disagrees with its files, each
    with a typed :class:`UsageError`. ``overwrite``: replace such files (a symlink: the link itself, never its
    target) and start over; a job whose checkpoint matches still resumes. ``resume``: an iterable source cannot be
    checked for changes, so a job with one resumes from its checkpoint only when this is True (the iterable must
    yield the same rows in the same order), and is refused otherwise. ``max_line_bytes``: a longer line of a JSONL,
    CSV or text input is an error row, never read whole.
    """
    spec = model.spec
    in_memory = not isinstance(source, str | os.PathLike)
    plan = plan_job(
        None if in_memory else source,  # type: ignore[arg-type]
        output, model=spec.name, errors=errors, batch_size=batch_size, outputs=outputs,
        input_format_name=input_format, output_format_name=output_format, overwrite=overwrite, resume=resume,
    )
    output, errors_path, writer = plan.output, plan.errors, plan.writer
    names = [t.name for t in spec.inputs]
    strings = [t.name for t in spec.inputs if t.dtype == "BYTES"]  # CSV cells of these stay text
    reader = None
    if plan.source is not None:
        # Made before the writer opens anything: an input that cannot be read leaves no file behind.
        try:
            reader = read_rows(plan.source, input_names=names, format=plan.input_format, string_inputs=strings,
                               max_line_bytes=max_line_bytes)
        except JobPathError:
            raise
        except (ValueError, OSError) as err:
            raise InputFileError(f"input file {plan.source}: {err}", path=plan.source, role="input") from err
    started = time.monotonic()
    done = writer.open()
    if writer.complete:
        # A finished job: nothing to read, nothing to send.
        writer.close()
        return ScoreSummary(
            output=output, errors=errors_path, rows_ok=0, rows_failed=0, resumed_from=done,
            elapsed_s=time.monotonic() - started, complete=True, job_rows_ok=writer.rows_written,
            job_rows_failed=writer.errors_written,
        )
    rows: Iterable[Any] | AsyncIterable[Any]
    total: int | None
    if reader is not None:
        reader.start = done
        rows, total = reader, reader.total
    else:
        assert not isinstance(source, str | os.PathLike)
        rows = _skip(source, done)
        try:
            total = len(source)  # type: ignore[arg-type]
        except TypeError:
            total = None
    bar = Progress(total=total, done=done, enabled=progress)
    ok = failed = 0
    complete = False
    try:
        last_commit = time.monotonic()
        async for scored in score_rows(
            model, rows, concurrency=concurrency, batch_size=batch_size, outputs=outputs, start=done,
            shared_memory=shared_memory, timeout_s=timeout_s, patience_s=patience_s,
        ):
            if scored.outputs is not None:
                writer.write(scored.index, scored.outputs)
                ok += 1
            else:
                assert scored.error is not None
                writer.write_error(scored.index, scored.error, scored.input)
                failed += 1
            bar.update(ok, failed)
            now = time.monotonic()
            if now - last_commit >= commit_every_s:
                writer.commit(done + ok + failed)
                last_commit = now
        writer.commit(done + ok + failed)
        writer.close()
        complete = True
    except BaseException:
        # Ctrl-C, a cancelled task, an aborted job: what was written is whole rows up to here, so keep it.
        try:
            writer.commit(done + ok + failed)
        finally:
            writer.abandon()
        raise
    finally:
        bar.close()
    return ScoreSummary(
        output=output, errors=errors_path, rows_ok=ok, rows_failed=failed, resumed_from=done,
        elapsed_s=time.monotonic() - started, complete=complete, job_rows_ok=writer.rows_written,
        job_rows_failed=writer.errors_written,
    )


def score_sync(
    url: str,
    model: str,
    source: PathLike | Iterable[Any],
    output: PathLike,
    **options: Any,
) -> ScoreSummary:
    """:func:`score` for scripts: opens a client on ``url``, scores, closes. Options are :func:`score`'s."""
    from .._client import Client

    async def main() -> ScoreSummary:
        async with Client(url) as client:
            handle = await client.model(model)
            return await score(handle, source, output, **options)

    return asyncio.run(main())

