"""Ray Data adapter: score a Ray Dataset through Triton with ``Dataset.map_batches``, one client per worker.

Ray Data builds one :class:`RayScorer` per actor of the pool and calls it with one numpy batch at a time. Each
batch goes through :func:`score_batches` as columns (the packing, retries and bad-row isolation of :func:`score`,
with no per-row Python for a batch whose rows are all good), so a batch of rows comes back as the same batch of
rows, in order, each with its outputs or its error.

This module never imports ``ray``: the class is plain Python that Ray pickles and constructs in its workers, and
``import triton_npu_client`` stays free of Ray whether or not it is installed.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import socket
import sys
import threading
import time
import zlib
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import numpy.typing as npt

from .._call import RetryPolicy
from .._errors import (
    ConnectError,
    JobAborted,
    MissingInputError,
    ModelNotFoundError,
    TritonError,
    UnknownInputError,
    UnknownOutputError,
    UsageError,
)
from .._wire import numpy_dtype
from ._score import ScoredBatch, score_batches

if TYPE_CHECKING:
    from .._client import Client, Model
    from .._model import ModelSpec, TensorSpec

__all__ = ["RayScorer"]

T = TypeVar("T")

# An endpoint that stayed unreachable is skipped by the worker's next batches for this long, so that a dead
# replica costs one failover wait per worker, not one per batch; afterwards it is tried again in its turn.
_DOWN_FOR_S = 30.0


class RayScorer:
    """A callable class for ``ray.data.Dataset.map_batches``: scores each batch on a Triton model.

    ::

        scored = ds.map_batches(
            RayScorer,
            fn_constructor_kwargs={"model": "minilm", "urls": ["grpc://triton-a:8001", "grpc://triton-b:8001"]},
            batch_format="numpy",
            batch_size=512,
            compute=ray.data.ActorPoolStrategy(size=4),
        )

    ``urls``: one Triton endpoint or several replicas (gRPC or HTTP URLs). Each worker starts at an endpoint chosen
    by a stable hash of its Ray actor id and moves to the next endpoint with every batch, so the load spreads over
    the replicas whatever the number of workers; it keeps one :class:`Client` per endpoint it has used, on an event
    loop of its own in a background thread. An endpoint unreachable for ``failover_after_s`` (no connection, server
    unavailable, model not ready: after the retries of :func:`score_rows`) hands the batch's remaining rows to the
    next one and is skipped for 30 s; when every endpoint stays unreachable for ``patience_s`` the batch raises
    :class:`JobAborted`, which fails the Ray task (Ray Data's own retry rules then apply).

    ``inputs`` maps dataset column -> model input name (default: each model input from the column of its name).
    ``outputs``: the model outputs to request (default: all). ``concurrency``: requests in flight per worker;
    ``batch_size``: rows per request (default: the model's ``max_batch_size``); give ``map_batches`` a
    ``batch_size`` of at least ``concurrency * batch_size`` rows to keep every slot busy.

    The returned batch holds the input columns (``keep_columns``), one column per output (the rows' outputs stacked;
    an object column of arrays when their shapes differ) and ``error_column``: ``""`` for a row that was scored,
    else ``"<ErrorType>: <message>"`` for a row the model refused or that does not fit its inputs. A failed row's
    outputs are filled: NaN for floats, 0 for integers, False for booleans, ``b""`` for BYTES.
    Input values follow the SDK's dtype rules: a float64 column does not narrow into an FP32 input (cast it first).
    ``client_options`` are passed to :class:`Client` (``timeout_s``, ``headers``, ``tls``, ...).
    """

    def __init__(
        self,
        model: str,
        urls: str | Sequence[str],
        *,
        inputs: Mapping[str, str] | None = None,
        outputs: Sequence[str] | None = None,
        concurrency: int = 4,
        batch_size: int | None = None,
        error_column: str = "error",
        keep_columns: bool = True,
        client_options: Mapping[str, Any] | None = None,
        failover_after_s: float = 10.0,
        patience_s: float = 120.0,
    ) -> None:
        url_list = [urls] if isinstance(urls, str) else list(urls)
        if not url_list or not all(isinstance(u, str) and u for u in url_list):
            raise UsageError(f"urls must be one URL or a non-empty list of URLs, got {urls!r}")
        if concurrency < 1:
            raise UsageError(f"concurrency must be >= 1, got {concurrency}")
        if not error_column:
            raise UsageError("error_column must be a non-empty column name")
        if not failover_after_s > 0 or not patience_s > 0:
            raise UsageError(f"failover_after_s and patience_s must be > 0, got {failover_after_s}, {patience_s}")
        self.model = model
        self.urls: tuple[str, ...] = tuple(url_list)
        self.inputs: dict[str, str] | None = dict(inputs) if inputs is not None else None
        self.outputs: tuple[str, ...] | None = tuple(outputs) if outputs is not None else None
        self.concurrency = concurrency
        self.batch_size = batch_size
        self.error_column = error_column
        self.keep_columns = keep_columns
        self.client_options: dict[str, Any] = dict(client_options or {})
        self.failover_after_s = failover_after_s
        self.patience_s = patience_s
        # The loop, its thread and the clients are made on the first batch, in the worker that runs it: a
        # constructed scorer stays cheap to build and to pickle.
        self._worker: _Worker | None = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"<RayScorer model={self.model!r} urls={list(self.urls)!r}>"

    # Pickled as its settings only: a copy opens its own loop and clients where it runs.
    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in ("_worker", "_lock")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._worker = None
        self._lock = threading.Lock()

    def __call__(self, batch: dict[str, npt.NDArray[Any]]) -> dict[str, npt.NDArray[Any]]:
        """Score one numpy batch (``batch_format="numpy"``); returns the batch with outputs and errors added."""
        worker = self._get_worker()
        return worker.run(self._score_batch(worker, batch))

    def close(self) -> None:
        """Close the clients and stop the loop thread; idempotent. Ray calls it through ``__del__``."""
        with self._lock:
            worker, self._worker = self._worker, None
        if worker is not None:
            worker.close()

    def __del__(self) -> None:
        # Ray Data drops its reference when the actor exits gracefully; a crashed worker's sockets die with it.
        # At interpreter shutdown there is no one left to report a failed close to.
        with contextlib.suppress(Exception):
            self.close()

    # -- internals ----------------------------------------------------------------------------------------------

    def _get_worker(self) -> _Worker:
        with self._lock:
            if self._worker is None:
                self._worker = _Worker(self)
            return self._worker

    async def _score_batch(self, worker: _Worker, batch: Mapping[str, npt.NDArray[Any]]) -> dict[str, npt.NDArray[Any]]:
        n = _batch_len(batch)
        spec = await worker.spec()
        names = self._columns(spec, batch)
        out_tensors = self._out_tensors(spec)
        result: dict[str, npt.NDArray[Any]] = dict(batch) if self.keep_columns else {}
        taken = [t.name for t in out_tensors] + [self.error_column]
        clash = sorted(set(taken) & set(result))
        if clash:
            raise UsageError(
                f"the batch already has column(s) {clash}, which the scorer would overwrite: rename them, choose "
                "another error_column, or pass keep_columns=False",
                model=self.model,
            )
        columns = {name: batch[column] for column, name in names.items()}
        scored = await worker.score(columns, n)
        errors = np.empty(n, dtype=object)
        errors[:] = ""
        runs = [run for part in scored for run in part.runs]
        for part in scored:
            for index, error, _ in part.errors:
                errors[index] = _describe(error)
        for tensor in out_tensors:
            result[tensor.name] = _output_column(runs, n, tensor)
        result[self.error_column] = errors
        return result

    def _columns(self, spec: ModelSpec, batch: Mapping[str, npt.NDArray[Any]]) -> dict[str, str]:
        """Dataset column -> model input name, checked against the batch's columns and the model's inputs."""
        if self.inputs is None:
            names = {t.name: t.name for t in spec.inputs if t.name in batch}
        else:
            missing = [c for c in self.inputs if c not in batch]
            if missing:
                raise UsageError(
                    f"inputs names column(s) {missing} that the batch does not have (it has {sorted(batch)})",
                    model=self.model,
                )
            for target in self.inputs.values():
                if spec.input(target) is None:
                    raise UnknownInputError(
                        f"model {self.model!r} has no input {target!r} "
                        f"(it has {', '.join(t.name for t in spec.inputs)})",
                        input_name=target,
                        model=self.model,
                    )
            names = dict(self.inputs)
        given = set(names.values())
        for tensor in spec.inputs:
            if not tensor.optional and tensor.name not in given:
                raise MissingInputError(
                    f"model {self.model!r} needs input {tensor.name!r}, and no column feeds it (the batch has "
                    f"{sorted(batch)}): pass inputs={{column: input name}}",
                    input_name=tensor.name,
                    model=self.model,
                )
        return names

    def _out_tensors(self, spec: ModelSpec) -> list[TensorSpec]:
        if self.outputs is None:
            return list(spec.outputs)
        tensors = []
        for name in self.outputs:
            tensor = spec.output(name)
            if tensor is None:
                raise UnknownOutputError(
                    f"model {self.model!r} has no output {name!r} (it has {', '.join(t.name for t in spec.outputs)})",
                    model=self.model,
                )
            tensors.append(tensor)
        return tensors


class _Worker:
    """What one Ray worker holds: an event loop in a thread, and a client per endpoint it has used."""

    def __init__(self, scorer: RayScorer) -> None:
        self.scorer = scorer
        self.urls = scorer.urls
        self.turn = zlib.crc32(_worker_key().encode()) % len(self.urls)
        self.down_until = dict.fromkeys(self.urls, 0.0)
        # The job's one retry policy: what is transient, how long the worker waits for it, the backoff between rounds.
        self.policy = RetryPolicy.patient(scorer.patience_s)
        self.clients: dict[str, Client] = {}
        self.models: dict[str, Model] = {}
        self._spec: ModelSpec | None = None
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="triton-npu-ray-scorer", daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def close(self) -> None:
        if self.loop.is_closed():
            return
        if threading.current_thread() is self.thread:
            # Dropped from a callback on its own loop: waiting here would deadlock; stop and let the thread end.
            self.loop.call_soon(self.loop.stop)
            return
        if self.thread.is_alive():
            try:
                asyncio.run_coroutine_threadsafe(self._aclose(), self.loop).result(timeout=30)
            finally:
                self.loop.call_soon_threadsafe(self.loop.stop)
                self.thread.join(timeout=30)
        if not self.thread.is_alive():
            self.loop.close()

    async def _aclose(self) -> None:
        clients, self.clients = list(self.clients.values()), {}
        self.models.clear()
        for client in clients:
            await client.aclose()

    async def model(self, url: str) -> Model:
        model = self.models.get(url)
        if model is None:
            client = self.clients.get(url)
            if client is None:
                from .._client import Client

                client = self.clients[url] = Client(url, **self.scorer.client_options)
            model = self.models[url] = await client.model(self.scorer.model)
            self._spec = self._spec or model.spec
        return model

    def _order(self) -> list[str]:
        """This batch's endpoints to try, in order: from the next in turn, reachable ones first."""
        n = len(self.urls)
        start, self.turn = self.turn, (self.turn + 1) % n
        ordered = [self.urls[(start + i) % n] for i in range(n)]
        now = time.monotonic()
        return sorted(ordered, key=lambda url: self.down_until[url] > now)  # stable: keeps the turn order

    async def spec(self) -> ModelSpec:
        """The model's spec, from the first endpoint that answers."""
        if self._spec is None:
            await self._with_endpoint(_fetched)
        assert self._spec is not None
        return self._spec

    async def score(self, columns: Mapping[str, npt.NDArray[Any]], n: int) -> list[ScoredBatch]:
        """Every row's outcome, in order, as columns; the rows left when an endpoint fails go to the next."""
        scored: list[ScoredBatch] = []
        done = 0
        deadline = time.monotonic() + self.scorer.patience_s

        async def attempt(model: Model) -> None:
            nonlocal done
            if done >= n:
                return
            async for part in score_batches(
                model,
                [{name: column[done:] for name, column in columns.items()}],
                start=done,
                concurrency=self.scorer.concurrency,
                batch_size=self.scorer.batch_size,
                outputs=self.scorer.outputs,
                patience_s=min(self.scorer.failover_after_s, max(0.1, deadline - time.monotonic())),
            ):
                scored.append(part)
                done += part.length

        await self._with_endpoint(attempt)
        return scored

    async def _with_endpoint(self, work: Callable[[Model], Awaitable[None]]) -> None:
        """Run ``work(model)`` on this batch's endpoints in turn until one completes it, within ``patience_s``.

        Where to go next and how long to wait is the retry policy's call (one policy for the whole job): an endpoint
        whose scoring gave up after ``failover_after_s`` hands over to the next one at once while there is one this
        round; when every endpoint failed once, the round backs off before the next.
        """
        policy = self.policy
        started = time.monotonic()
        waits = 0
        last: BaseException | None = None
        while True:
            not_found = 0
            for url in self._order():
                try:
                    await work(await self.model(url))
                    return
                except TritonError as err:
                    if not _unreachable(policy, err):
                        raise
                    last = err
                    not_found += isinstance(err, ModelNotFoundError)
                    self.down_until[url] = time.monotonic() + _DOWN_FOR_S
                    # The model may come back under another config (a reload): fetch it again next time.
                    self.models.pop(url, None)
                if time.monotonic() - started > policy.patience_s:  # type: ignore[operator]
                    raise self._aborted(last)
                # Another endpoint left this round: on to it at once (the policy's "other" for an unreachable one).
            if self._spec is None and not_found == len(self.urls):
                # No endpoint has ever known the model: a wrong name, not a replica restarting.
                assert last is not None
                raise last
            decision = policy.decide(
                _as_transient(last), waits=waits, failing_for_s=time.monotonic() - started,
            )  # fmt: skip
            if decision is None:
                raise self._aborted(last)
            waits += 1
            await asyncio.sleep(decision.delay_s)

    def _aborted(self, last: BaseException | None) -> JobAborted:
        err = JobAborted(
            f"no endpoint of {list(self.urls)} took model {self.scorer.model!r} for "
            f"{self.scorer.patience_s:g} s (patience_s); last error: {last}",
            model=self.scorer.model,
        )
        err.__cause__ = last
        return err


def _unreachable(policy: RetryPolicy, err: BaseException) -> bool:
    """"This endpoint cannot take work now" rather than "this row is wrong": another endpoint may. A scoring run
    that gave up (JobAborted) on its endpoint after ``failover_after_s`` is one."""
    return isinstance(err, JobAborted) or policy.retriable(err)


def _as_transient(err: BaseException | None) -> BaseException:
    # The policy judges Triton errors; an endpoint whose scoring gave up counts as one that is unreachable.
    return ConnectError(str(err)) if err is None or isinstance(err, JobAborted) else err


async def _fetched(model: Model) -> None:
    """Nothing more to do once the model's config is fetched (:meth:`_Worker.model` did it)."""


def _worker_key() -> str:
    """Identifies this worker: the Ray actor id inside Ray, else host and pid. Stable across calls."""
    ray = sys.modules.get("ray")  # imported by Ray's worker itself; never imported here
    if ray is not None:
        with contextlib.suppress(Exception):  # a driver without ray.init(), a partial install: use the process
            if ray.is_initialized():
                actor = ray.get_runtime_context().get_actor_id()
                if actor:
                    return str(actor)
    return f"{socket.gethostname()}:{os.getpid()}"


def _batch_len(batch: Mapping[str, npt.NDArray[Any]]) -> int:
    lengths = {len(v) for v in batch.values()}
    if len(lengths) > 1:
        raise UsageError(f"batch columns have different lengths: {sorted(lengths)}")
    return lengths.pop() if lengths else 0


def _describe(error: Exception | None) -> str:
    return "" if error is None else f"{type(error).__name__}: {error}"


def _fill_value(dtype: np.dtype[Any]) -> Any:
    if dtype.kind in "fc":
        return math.nan
    if dtype.kind == "b":
        return False
    if dtype.kind in "OSUV":
        return b""
    return 0


def _output_column(
    runs: Sequence[tuple[int, Mapping[str, npt.NDArray[Any]]]], n: int, tensor: TensorSpec
) -> npt.NDArray[Any]:
    """One output column for the batch's ``n`` rows from its runs of good rows; failed rows filled."""
    outs = [(index, outputs[tensor.name]) for index, outputs in runs if tensor.name in outputs]
    if len(outs) == 1 and outs[0][0] == 0 and len(outs[0][1]) == n:
        return outs[0][1]  # every row good, one request: the response's array as it came
    if len({out.shape[1:] for _, out in outs}) <= 1 and len({out.dtype for _, out in outs}) <= 1:
        dtype = outs[0][1].dtype if outs else numpy_dtype(tensor.dtype)
        shape = outs[0][1].shape[1:] if outs else tuple(max(d, 0) for d in tensor.dims)
        column = np.full((n, *shape), _fill_value(dtype), dtype=dtype)
        for index, out in outs:
            column[index : index + len(out)] = out
        return column
    values: list[npt.NDArray[Any] | None] = [None] * n
    for index, out in outs:
        for i in range(len(out)):
            values[index + i] = out[i]
    return _column(values, tensor)


def _column(values: list[npt.NDArray[Any] | None], tensor: TensorSpec) -> npt.NDArray[Any]:
    """One output column: the rows' arrays stacked, failed rows filled; an object column when shapes differ."""
    good = [v for v in values if v is not None]
    dtype = good[0].dtype if good else numpy_dtype(tensor.dtype)
    fill = _fill_value(dtype)
    shapes = {v.shape for v in good}
    if len(shapes) <= 1:
        shape = shapes.pop() if shapes else tuple(max(d, 0) for d in tensor.dims)
        column = np.empty((len(values), *shape), dtype=dtype)
        for i, v in enumerate(values):
            column[i] = fill if v is None else v
        return column
    # Variable-length outputs: Ray Data stores an object column of arrays as a variable-shaped tensor column.
    empty = np.full(tuple(max(d, 0) for d in tensor.dims), fill, dtype=dtype)
    ragged = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        ragged[i] = empty if v is None else v
    return ragged
