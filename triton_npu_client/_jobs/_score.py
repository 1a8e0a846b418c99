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
import time
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias, TypedDict, Unpack

import attrs
import numpy as np
import numpy.typing as npt

from .._call import USE_CLIENT_DEFAULT, Call, RetryPolicy, UseClientDefault, run_with_retry
from .._errors import (
    JobAborted,
    RowParseError,
    UsageError,
)
from .._model import Arrays, ModelSpec, checked_request, validate_batch, validate_row
from .._wire import InferResult
from ._ordered import aiter_any, ordered_map
from ._plan import plan_job
from ._preflight import check_model
from ._progress import Progress
from ._safety import InputFileError, JobPathError
from .formats import MAX_LINE_BYTES, BadRow, ResultWriter, RowSource, read_rows
from .formats import output_format as output_format_of

if TYPE_CHECKING:
    from .._client import Model

__all__ = [
    "Row", "ScoreOptions", "ScoreSummary", "ScoredBatch", "ScoredRow", "score", "score_batches", "score_rows",
    "score_sync",
]

_log = logging.getLogger("triton_npu_client.score")

Row: TypeAlias = Mapping[str, Any] | Any
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
    # The complete job removed its errors file, which held no row (keep_checkpoint=False).
    errors_removed: bool = False

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
            f"{self.rows_ok:,} ok, {self.rows_failed:,} failed{state}; output {self.output}, "
            + ("no errors file (no row failed)" if self.errors_removed else f"errors {self.errors}")
        )


# -- chunks: consecutive rows, checked together --------------------------------------------------------------------


class _Chunk(Protocol):
    """Consecutive rows ``start .. start+length-1``: as columns when every row was parsed, else one by one."""

    @property
    def start(self) -> int: ...

    @property
    def length(self) -> int: ...

    @property
    def columns(self) -> Mapping[str, Any] | None: ...

    def row(self, i: int) -> Any: ...


@attrs.frozen
class _MemoryChunk:
    """A chunk of rows from an iterable (``rows``), or a slice of a caller's column batch (``columns``)."""

    start: int
    length: int
    columns: Mapping[str, Any] | None = None
    rows: Sequence[Any] | None = None

    def row(self, i: int) -> Any:
        if self.rows is not None:
            return self.rows[i]
        assert self.columns is not None
        return {name: column[i] for name, column in self.columns.items()}


@attrs.frozen
class _Unit:
    """One slot of ordered_map: a chunk, the batches its good rows travel in, and the rows refused before sending.

    ``parts``: (positions within the chunk, validated arrays) per request; rows of one request share their shapes.
    ``refused``: position -> the typed error that refused the row. Refused rows ride along, so order is kept.
    """

    chunk: _Chunk
    parts: list[tuple[Sequence[int], Arrays]]
    refused: dict[int, Exception]


def _as_columns(chunk: _Chunk, spec: ModelSpec) -> Mapping[str, Any] | None:
    """The chunk's rows as one column per input, or None when a row needs a look of its own."""
    inputs = spec.inputs
    names = [t.name for t in inputs]
    if chunk.columns is not None:
        # A caller's batch may carry columns of its own (an id): left behind here as on the row path below, so the
        # batch stays on the fast path instead of failing the batch check and going row by row.
        return {name: column for name, column in chunk.columns.items() if name in names}
    columns: dict[str, list[Any]] = {name: [] for name in names}
    for i in range(chunk.length):
        row = chunk.row(i)
        if isinstance(row, BadRow):
            return None
        if not isinstance(row, Mapping):
            if len(names) != 1:
                return None
            columns[names[0]].append(row)
            continue
        for name in names:  # keys that are not inputs (an id, say) are left behind, as a file reader leaves them
            if name not in row:
                return None
            columns[name].append(row[name])
    return columns


def _prepare(chunk: _Chunk, spec: ModelSpec, literal: bool = False, allow_lossy: bool = False) -> _Unit:
    """Check a chunk against the model: as one batch when it can be, row by row only when a row is refused.

    Either way the outcome is what checking each row alone gives (the one validator, ``validate_row`` and
    ``validate_batch``, applies the same rules); the batch check costs one conversion per input instead of one per
    row, which is what keeps a job of many small rows off the Python interpreter. ``literal``: the rows come from
    a file whose numbers convert as Python numbers do (see ``validate_row``). ``allow_lossy``: any numeric cast is
    the caller's choice (a float64 array into an FP32 input).
    """
    columns = _as_columns(chunk, spec)
    if columns is not None:
        try:
            batch = validate_batch(spec, columns, rows=True, literal=literal, allow_lossy=allow_lossy)
        except UsageError:
            pass
        else:
            if all(arr.shape[0] == chunk.length for arr in batch.values()):
                return _Unit(chunk, [(range(chunk.length), batch)], {})
    parts: list[tuple[Sequence[int], Arrays]] = []
    refused: dict[int, Exception] = {}
    inputs = {t.name for t in spec.inputs}
    group: list[tuple[int, Arrays]] = []
    signature: object = None

    def flush() -> None:
        stacked = {name: np.stack([arrays[name] for _, arrays in group]) for name in group[0][1]}
        parts.append(([i for i, _ in group], stacked))
        group.clear()

    for i in range(chunk.length):
        row = chunk.row(i)
        if isinstance(row, BadRow):
            refused[i] = RowParseError(row.reason)
            continue
        if isinstance(row, Mapping) and not all(name in inputs for name in row):
            row = {name: value for name, value in row.items() if name in inputs}  # a record's other fields
        try:
            arrays = validate_row(spec, row, literal=literal, allow_lossy=allow_lossy)
        except UsageError as err:
            refused[i] = err
            continue
        sig = tuple((name, arr.shape) for name, arr in arrays.items())
        if group and sig != signature:
            flush()
        signature = sig
        group.append((i, arrays))
    if group:
        flush()
    return _Unit(chunk, parts, refused)


async def _row_chunks(rows: Iterable[Any] | AsyncIterable[Any], size: int, start: int) -> AsyncIterator[_Chunk]:
    """Rows from an iterable, ``size`` at a time."""
    index = start
    buffer: list[Any] = []
    async for row in aiter_any(rows):
        buffer.append(row)
        if len(buffer) >= size:
            yield _MemoryChunk(index, len(buffer), rows=buffer)
            index += len(buffer)
            buffer = []
    if buffer:
        yield _MemoryChunk(index, len(buffer), rows=buffer)


def _batch_length(batch: Mapping[str, Any]) -> int:
    lengths = {}
    for name, column in batch.items():
        try:
            lengths[name] = len(column)
        except TypeError:  # a scalar, a 0-d array: not a column of rows
            raise UsageError(
                f"column {name!r} of a batch is a {type(column).__name__} without a length: give a value per row "
                "(an array whose first axis is the rows, or a list)"
            ) from None
    if len(set(lengths.values())) > 1:
        told = ", ".join(f"{name}={n}" for name, n in lengths.items())
        raise UsageError(f"the columns of a batch differ in length ({told}): give every input a value per row")
    return next(iter(lengths.values()), 0)


async def _column_chunks(
    batches: Iterable[Mapping[str, Any]] | AsyncIterable[Mapping[str, Any]], size: int, start: int
) -> AsyncIterator[_Chunk]:
    """A caller's column batches, sliced into chunks of at most ``size`` rows (a chunk never spans two batches)."""
    index = start

    def sliced(batch: Mapping[str, Any]) -> Iterator[_Chunk]:
        nonlocal index
        if not isinstance(batch, Mapping):
            raise UsageError(
                f"a batch is a mapping from input name to a column of values, not a {type(batch).__name__}"
            )
        n = _batch_length(batch)
        for lo in range(0, n, size):
            hi = min(lo + size, n)
            yield _MemoryChunk(index, hi - lo, columns={name: column[lo:hi] for name, column in batch.items()})
            index += hi - lo

    async for batch in aiter_any(batches):
        for chunk in sliced(batch):
            yield chunk


async def _file_chunks(reader: RowSource, size: int) -> AsyncIterator[_Chunk]:
    for chunk in reader.chunks(size):
        yield chunk


# -- results ------------------------------------------------------------------------------------------------------


@attrs.frozen
class ScoredBatch:
    """Consecutive rows ``start .. start+length-1`` scored: runs of good rows with their outputs, and the failures.

    ``runs``: (index of the run's first row, outputs with the batch dim first) for each run of consecutive good
    rows, in order. ``errors``: (row index, the typed error, the row as given) for each row that failed, in order.
    Together they cover every row of the range exactly once. :meth:`rows` gives the same as :class:`ScoredRow`\\ s.
    """

    start: int
    length: int
    runs: tuple[tuple[int, Mapping[str, npt.NDArray[Any]]], ...]
    errors: tuple[tuple[int, Exception, Any], ...] = attrs.field(eq=False)

    @property
    def rows_ok(self) -> int:
        return self.length - len(self.errors)

    @property
    def rows_failed(self) -> int:
        return len(self.errors)

    def events(self) -> list[tuple[int, Mapping[str, npt.NDArray[Any]] | None, Exception | None, Any]]:
        """(index, outputs of a run, None, None) and (index, None, error, row) in index order."""
        merged: list[tuple[int, Mapping[str, npt.NDArray[Any]] | None, Exception | None, Any]] = [
            (index, outputs, None, None) for index, outputs in self.runs
        ]
        if self.errors:
            merged += [(index, None, error, row) for index, error, row in self.errors]
            merged.sort(key=lambda event: event[0])
        return merged

    def rows(self) -> Iterator[ScoredRow]:
        """One :class:`ScoredRow` per row, in order."""
        events = self.events()
        for k, (index, outputs, error, row) in enumerate(events):
            if outputs is None:
                assert error is not None
                yield ScoredRow(index, None, error, row)
                continue
            # A run ends where the next event starts (the events cover the range): no output's length to trust.
            end = events[k + 1][0] if k + 1 < len(events) else self.start + self.length
            for i in range(end - index):
                yield ScoredRow(index + i, {name: out[i] for name, out in outputs.items()}, None)


def _runs(positions: Sequence[int], outputs: Mapping[str, npt.NDArray[Any]]) -> Iterator[tuple[int, Arrays]]:
    """Split a request's outputs where its rows are not consecutive (rows refused between them)."""
    if isinstance(positions, range) or positions[-1] - positions[0] == len(positions) - 1:
        yield positions[0], dict(outputs)
        return
    lo = 0
    for hi in range(1, len(positions) + 1):
        if hi == len(positions) or positions[hi] != positions[hi - 1] + 1:
            yield positions[lo], {name: out[lo:hi] for name, out in outputs.items()}
            lo = hi


Outcome: TypeAlias = list[tuple[Sequence[int], "Mapping[str, npt.NDArray[Any]] | Exception"]]


def _scored(unit: _Unit, outcome: Outcome | Exception) -> ScoredBatch:
    chunk = unit.chunk
    start = chunk.start
    failed: dict[int, Exception] = dict(unit.refused)
    runs: list[tuple[int, Mapping[str, npt.NDArray[Any]]]] = []
    if isinstance(outcome, Exception):  # not expected: send() isolates per row
        for positions, _ in unit.parts:
            failed.update((i, outcome) for i in positions)
    else:
        for positions, got in outcome:
            if isinstance(got, Exception):
                failed.update((i, got) for i in positions)
            else:
                runs.extend((start + first, outs) for first, outs in _runs(positions, got))
    runs.sort(key=lambda run: run[0])

    def given(i: int) -> Any:
        row = chunk.row(i)
        return None if isinstance(row, BadRow) else row

    errors = tuple((start + i, failed[i], given(i)) for i in sorted(failed))
    return ScoredBatch(start, chunk.length, tuple(runs), errors)


# -- sending, with retries and isolation ----------------------------------------------------------------------------


@attrs.define
class _Sender:
    """Sends a job's checked batches: each goes to the wire as it is (no second check, no coalescing), retried by the
    caller's one loop under the job's patient policy; a batch the server refuses is halved down to the bad rows."""

    model: Model
    outputs: Sequence[str] | None
    timeout_s: float | UseClientDefault | None
    patience_s: float
    pool: Any = None  # a SharedMemoryPool when shared memory is on
    # What may be transient (no connection, a server restarting, a model gone meanwhile: its config was read when
    # the job began, a timeout: a stateless request is safe to repeat) is retried for patience_s after its first
    # failure. The client's own policy is not applied as well: one loop, this policy.
    policy: RetryPolicy = attrs.field(init=False)
    _timeout: float | None = attrs.field(init=False)
    _wanted: tuple[str, ...] = attrs.field(init=False)
    _headers: dict[tuple[object, ...], bytes] = attrs.field(init=False, factory=dict)

    def __attrs_post_init__(self) -> None:
        self.policy = RetryPolicy.patient(self.patience_s)
        self._timeout = self.model.caller.timeout(self.timeout_s)
        self._wanted = tuple(self.outputs or ())

    async def send(self, positions: Sequence[int], batch: Arrays) -> Outcome:
        """The outputs of the rows at ``positions``, or the error of each part that failed alone (by halving)."""
        try:
            result = await self._send_patiently(batch)
        except JobAborted:
            raise
        except Exception as err:
            if len(positions) == 1:
                return [(positions, err)]
            mid = len(positions) // 2
            first = await self.send(positions[:mid], {name: arr[:mid] for name, arr in batch.items()})
            return first + await self.send(positions[mid:], {name: arr[mid:] for name, arr in batch.items()})
        return [(positions, {name: result[name] for name in result})]

    async def send_unit(self, unit: _Unit) -> Outcome:
        outcome: Outcome = []
        for positions, batch in unit.parts:
            outcome += await self.send(positions, batch)
        return outcome

    async def _send_patiently(self, batch: Arrays) -> InferResult:
        policy = self.policy
        try:
            if self.pool is not None:
                pool = self.pool
                return await run_with_retry(
                    lambda _budget: pool.infer_batch(batch, outputs=self.outputs), policy, timeout_s=self._timeout
                )
            # The batch was checked as a whole (_prepare): encoded once, sent as built (the job chose its shape).
            request = checked_request(self.model.spec, batch, outputs=self._wanted, headers=self._headers)
            return await self.model.caller.send(Call(request=request, timeout_s=self._timeout), policy)
        except Exception as err:
            if not policy.retriable(err):
                raise
            raise JobAborted(
                f"model {self.model.name!r} unreachable for over {self.patience_s:g} s (patience_s); last error: "
                f"{err}",
                model=self.model.name,
            ) from err


async def _score_chunks(
    model: Model,
    chunks: AsyncIterator[_Chunk],
    *,
    concurrency: int,
    outputs: Sequence[str] | None,
    shared_memory: bool,
    timeout_s: float | UseClientDefault | None,
    patience_s: float,
    literal: bool = False,
    allow_lossy: bool = False,
) -> AsyncIterator[ScoredBatch]:
    """The engine under score(), score_rows() and score_batches(): chunks in, scored batches out, in order."""
    spec = model.spec
    pool = None
    if shared_memory:
        from .._client import SharedMemoryPool

        pool = await SharedMemoryPool.open(model, slots=concurrency)
    sender = _Sender(model, outputs, timeout_s, patience_s, pool)

    async def units() -> AsyncIterator[_Unit]:
        try:
            async for chunk in chunks:
                yield _prepare(chunk, spec, literal, allow_lossy)
        finally:
            await chunks.aclose()  # type: ignore[attr-defined]

    try:
        # A window of 4x the requests in flight: a slow request at the head does not idle the other slots.
        async for unit, outcome in ordered_map(units(), sender.send_unit, concurrency=concurrency,
                                               window=4 * concurrency):
            if isinstance(outcome, JobAborted):
                raise outcome
            yield _scored(unit, outcome)
    finally:
        if pool is not None:
            await pool.aclose()


class ScoreOptions(TypedDict, total=False):
    """The options of :func:`score_rows` and :func:`score_batches` (see score_rows for each)."""

    concurrency: int
    batch_size: int | None
    outputs: Sequence[str] | None
    shared_memory: bool
    timeout_s: float | UseClientDefault | None
    patience_s: float


@attrs.frozen(kw_only=True)
class _Options:
    """:class:`ScoreOptions` with their defaults, and what the engine needs from them."""

    concurrency: int = 4
    batch_size: int | None = None
    outputs: Sequence[str] | None = None
    shared_memory: bool = False
    timeout_s: float | UseClientDefault | None = USE_CLIENT_DEFAULT
    patience_s: float = 120.0

    def run(self, model: Model, chunks: AsyncIterator[_Chunk]) -> AsyncIterator[ScoredBatch]:
        return _score_chunks(
            model, chunks, concurrency=self.concurrency, outputs=self.outputs, shared_memory=self.shared_memory,
            timeout_s=self.timeout_s, patience_s=self.patience_s,
        )

    def size(self, model: Model) -> int:
        return check_model(model.spec, batch_size=self.batch_size, concurrency=self.concurrency, outputs=self.outputs)


async def score_rows(
    model: Model, rows: Iterable[Any] | AsyncIterable[Any], *, start: int = 0, **options: Unpack[ScoreOptions]
) -> AsyncIterator[ScoredRow]:
    """Score ``rows`` on a stateless batched ``model``: one :class:`ScoredRow` per row, in input order.

    A row is a mapping from input name to one sample's value, or a bare value for a one-input model. ``start`` is
    the index given to the first row (a resumed job). Options: ``concurrency`` (requests in flight, default 4),
    ``batch_size`` (rows per request, default the model's ``max_batch_size``), ``outputs`` (the outputs to
    return, default all), ``shared_memory`` (send through system shared memory), ``timeout_s`` (per request),
    ``patience_s`` (how long a transient failure is retried, default 120). See the module docstring for packing,
    retries and isolation; :class:`JobAborted` ends the iteration when the server stays unreachable past
    ``patience_s``. Leaving the loop early cancels the requests in flight. For speed, :func:`score_batches` takes
    columns.
    """
    opts = _Options(**options)
    scored = opts.run(model, _row_chunks(rows, opts.size(model), start))
    try:
        async for batch in scored:
            for row in batch.rows():
                yield row
    finally:
        await scored.aclose()  # type: ignore[attr-defined]


async def score_batches(
    model: Model,
    batches: Iterable[Mapping[str, Any]] | AsyncIterable[Mapping[str, Any]],
    *,
    start: int = 0,
    **options: Unpack[ScoreOptions],
) -> AsyncIterator[ScoredBatch]:
    """Score column batches on a stateless batched ``model``: the fast path of :func:`score_rows`.

    A batch is a mapping from input name to a column (a numpy array, or a sequence) with one value per row; the
    batches may be of any length and are sliced into requests of ``batch_size`` rows (a request never spans two
    batches). Yields one :class:`ScoredBatch` per request, in order, with rows numbered from ``start``. A column
    that checks as a whole is sent without touching its rows one by one; a batch with a bad row is checked row by
    row, and only the bad rows fail. Options, retries, isolation and :class:`JobAborted` are those of
    :func:`score_rows`.
    """
    opts = _Options(**options)
    scored = opts.run(model, _column_chunks(batches, opts.size(model), start))
    try:
        async for batch in scored:
            yield batch
    finally:
        await scored.aclose()  # type: ignore[attr-defined]


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
    allow_lossy: bool = False,
    keep: Sequence[str] = (),
    keep_checkpoint: bool = True,
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

    ``allow_lossy``: cast numbers whatever they lose (a float64 ``.npy`` into an FP32 input; without it every such
    row is refused). ``keep``: input fields carried to the output beside the outputs (an ``id``; JSONL and Parquet
    outputs; a CSV cell is kept as its text; a row without the field keeps null). ``keep_checkpoint``: False
    removes ``<output>.checkpoint.json`` and an empty errors file once the job is complete (a re-run then finds
    files no checkpoint vouches for, and needs ``overwrite``); the default keeps them, so that a re-run does nothing.
    """
    spec = model.spec
    keep = tuple(keep)
    # Before any file is opened: the model and options a job cannot use, a .npy output for several outputs.
    size = check_model(model.spec, batch_size=batch_size, concurrency=concurrency, outputs=outputs,
                       output_format=output_format_of(output, output_format), keep=keep)
    in_memory = not isinstance(source, str | os.PathLike)
    plan = plan_job(
        None if in_memory else source,  # type: ignore[arg-type]
        output, model=spec.name, errors=errors, batch_size=batch_size, outputs=outputs,
        input_format_name=input_format, output_format_name=output_format, overwrite=overwrite, resume=resume,
        keep=keep,
    )
    output, errors_path, writer = plan.output, plan.errors, plan.writer
    names = [t.name for t in spec.inputs]
    strings = [t.name for t in spec.inputs if t.dtype == "BYTES"]  # CSV cells of these stay text
    reader = None
    if plan.source is not None:
        # Made before the writer opens anything: an input that cannot be read leaves no file behind. Kept columns
        # are read beside the inputs (and left behind by the check against the model).
        try:
            reader = read_rows(plan.source, input_names=[*names, *(k for k in keep if k not in names)],
                               format=plan.input_format, string_inputs=[*strings, *keep],
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
            errors_removed=not keep_checkpoint and _tidy(writer, errors_path),
        )
    chunks: AsyncIterator[_Chunk]
    total: int | None
    if reader is not None:
        reader.start = done
        chunks, total = _file_chunks(reader, size), reader.total
    else:
        assert not isinstance(source, str | os.PathLike)
        chunks = _row_chunks(_skip(source, done), size, done)
        try:
            total = len(source)  # type: ignore[arg-type]
        except TypeError:
            total = None
    bar = Progress(total=total, done=done, enabled=progress)
    ok = failed = 0
    # The counts come from the writer: a row the model answered but the output file refuses (another shape than
    # the first row's in a .npy) is a failed row, in the summary as in the errors file and the exit code.
    written_before, failed_before = writer.rows_written, writer.errors_written
    complete = False
    kept: dict[int, Mapping[str, npt.NDArray[Any]]] = {}
    if keep:
        chunks = _keeping(chunks, keep, kept)
    scored = _score_chunks(
        model, chunks, concurrency=concurrency, outputs=outputs, shared_memory=shared_memory, timeout_s=timeout_s,
        patience_s=patience_s,
        # Numbers in a JSONL, CSV or Parquet file are the file's, not a caller's typed array: a double column
        # rounds into an FP32 input as a JSON number does. A .npy file is a typed array, and keeps numpy's rule.
        literal=reader is not None and reader.format != "npy",
        allow_lossy=allow_lossy,
    )
    try:
        last_commit = time.monotonic()
        async for batch in scored:
            carried = kept.pop(batch.start, None)
            # A chunk at a time: a run of good rows is one write (one .npy slice, one Arrow batch, one JSONL block).
            if not batch.errors and carried is None:
                for index, outs in batch.runs:
                    writer.write_rows(index, outs)
            else:
                for index, run, error, row in batch.events():
                    if run is not None:
                        if carried is not None:
                            run = _with_kept(run, carried, index - batch.start)
                        writer.write_rows(index, run)
                    else:
                        assert error is not None
                        writer.write_error(index, error, row)
            ok, failed = writer.rows_written - written_before, writer.errors_written - failed_before
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
        except Exception as err:
            # A write that failed half-way (the output refused a run) leaves no commit that would be true: the
            # re-run resumes at the last one. The job's own error is the one to raise, not this.
            _log.warning("%s: not committed on the way out (%s); a re-run resumes at the last commit", output, err)
        finally:
            writer.abandon()
        raise
    finally:
        await scored.aclose()  # type: ignore[attr-defined]
        bar.close()
    return ScoreSummary(
        output=output, errors=errors_path, rows_ok=ok, rows_failed=failed, resumed_from=done,
        elapsed_s=time.monotonic() - started, complete=complete, job_rows_ok=writer.rows_written,
        job_rows_failed=writer.errors_written,
        errors_removed=not keep_checkpoint and _tidy(writer, errors_path),
    )


def _tidy(writer: ResultWriter, errors_path: Path) -> bool:
    """Remove a complete job's empty errors file, then its checkpoint (in that order: a crash between the two
    leaves a checkpoint that still agrees with its files). Returns whether the errors file is gone."""
    removed = False
    try:
        if errors_path.stat().st_size == 0:
            errors_path.unlink()
            removed = True
    except FileNotFoundError:
        removed = True
    writer.checkpoint_path.unlink(missing_ok=True)
    return removed


async def _keeping(
    chunks: AsyncIterator[_Chunk], keep: Sequence[str], kept: dict[int, Mapping[str, npt.NDArray[Any]]]
) -> AsyncIterator[_Chunk]:
    """The chunks as they come, with each one's ``keep`` fields noted in ``kept`` under its first row (the scored
    batch of a chunk starts there; the job pops it when it writes the batch, so ``kept`` holds the window only)."""
    try:
        async for chunk in chunks:
            kept[chunk.start] = {name: _kept_column(chunk, name) for name in keep}
            yield chunk
    finally:
        await chunks.aclose()  # type: ignore[attr-defined]


def _kept_column(chunk: _Chunk, name: str) -> npt.NDArray[Any]:
    """A chunk's values of field ``name``, one per row (None where a row lacks it): numbers as a numeric array,
    anything else as Python objects (written as the JSON or text they are)."""
    if chunk.columns is not None and name in chunk.columns:
        values = list(chunk.columns[name])
    else:
        values = []
        for i in range(chunk.length):
            row = chunk.row(i)
            values.append(row.get(name) if isinstance(row, Mapping) else None)
    if values and all(isinstance(v, int | float | np.integer | np.floating) and not isinstance(v, bool)
                      for v in values):
        return np.asarray(values)
    column = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):
        column[i] = value
    return column


def _with_kept(
    run: Mapping[str, npt.NDArray[Any]], carried: Mapping[str, npt.NDArray[Any]], offset: int
) -> dict[str, npt.NDArray[Any]]:
    """A run's outputs with the kept fields of its rows first (``offset``: the run's first row in its chunk)."""
    n = len(next(iter(run.values())))
    return {**{name: column[offset : offset + n] for name, column in carried.items()}, **run}


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

