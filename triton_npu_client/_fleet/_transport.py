"""A transport over several Triton replicas: the router below the sessions.

It is a :class:`~triton_npu_client._transport.Transport` like the one-server transports, so nothing above it (model
handles, coalescing, sessions, chats, scoring) knows how many replicas there are. Per call it picks a replica:

- **stateless requests** go to the healthy replica serving the model with the fewest requests in flight from this
  client, once: a replica that fails with "unreachable" (:func:`is_replica_failure`) is taken out, and the caller's
  retry loop, told by :meth:`FleetTransport.elsewhere` that another replica is there, sends the same :class:`Call`
  again at once (the policy's "other"), which goes to another replica; the fleet has no retry loop of its own;
- **sequence steps** (so chats too) go to the replica the sequence is pinned to. A START pins it by rendezvous
  hashing of (model, sequence id) over the healthy replicas serving the model, so other client processes pick the
  same replica unaided; the pin then holds for the sequence's life, whatever joins later. A step whose replica
  has failed since the pin raises :class:`SequenceLost` without being sent (its state went with the replica).

Replicas are checked in the background (server ready + the models READY in its repository), taken out on a failed
check or a failed call, probed again with backoff, and put back when they answer; a replica taken out starts a new
epoch, and sequences pinned in an earlier epoch are lost. ``dns+`` names are resolved again periodically: every
A/AAAA record is a replica (a Kubernetes headless Service).

Everything here runs on the client's event loop; the state has no locks because nothing else touches it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Final, Literal, Self, TypeVar

from .._errors import (
    ClientClosedError,
    PermissionDeniedError,
    SequenceLost,
    ServerUnavailable,
    TritonError,
    UsageError,
)
from .._trace import note_replica
from .._transport import Call, Json, OneResponse, Responses, Transport, is_replica_failure
from .._wire import InferResult
from ._discovery import Endpoint, Place, system_resolver
from ._hashing import rendezvous, sequence_key
from ._options import FleetOptions, Resolver
from ._replica import Replica, ReplicaStatus

__all__ = ["FleetTransport"]

_log = logging.getLogger("triton_npu_client.fleet")

T = TypeVar("T")
MakeTransport = Callable[[Place], Transport]

_NUMERIC_MAX: Final = frozenset({"last_inference"})


class FleetTransport:
    """One client's view of several replicas (see the module docstring)."""

    def __init__(
        self,
        endpoints: Sequence[Endpoint],
        make_transport: MakeTransport,
        *,
        options: FleetOptions | None = None,
        resolver: Resolver | None = None,
    ) -> None:
        if not endpoints:
            raise UsageError("a fleet needs at least one URL")
        schemes = {e.scheme for e in endpoints}
        if len({"grpc" if s.startswith("grpc") else "http" for s in schemes}) > 1:
            raise UsageError(
                "the URLs of one client must all be gRPC (grpc://, grpcs://) or all HTTP (http://, https://), "
                f"given {sorted(schemes)}"
            )
        self._endpoints = tuple(endpoints)
        self._make = make_transport
        self._options = options or FleetOptions()
        self._resolver = resolver or system_resolver
        self._protocol: Final = "grpc" if next(iter(schemes)).startswith("grpc") else "http"
        self._replicas: dict[str, Replica] = {}
        for endpoint in endpoints:
            if not endpoint.dns:
                place = endpoint.fixed()
                self._replicas.setdefault(place.url, Replica(place, make_transport(place)))
        self._dns = tuple(e for e in endpoints if e.dns)
        self._resolved_at = -float("inf")
        self._resolve_error: str | None = None
        # (model, sequence id) -> the replica and the epoch it was pinned in.
        self._pins: dict[bytes, tuple[Replica, int]] = {}
        self._turn = 0  # rotates ties among equally loaded replicas
        self._first: asyncio.Task[None] | None = None
        self._watch: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None
        self._retired: list[Replica] = []
        self._stale: set[Transport] = set()  # replaced by a fresh connection after an outage; closed later
        self._closing: set[asyncio.Task[None]] = set()
        self._closed = False

    def __repr__(self) -> str:
        return f"<FleetTransport {[e.url for e in self._endpoints]} replicas={len(self._replicas)}>"

    @property
    def protocol(self) -> str:
        return self._protocol

    @property
    def can_stream(self) -> bool:
        return self._protocol == "grpc"

    @property
    def options(self) -> FleetOptions:
        return self._options

    # -- watching the replicas ------------------------------------------------------------------------

    async def ready(self) -> None:
        """Wait for the first round of health checks (and DNS lookups), started on first use."""
        first = self._first
        if first is None:
            if self._closed:
                raise ClientClosedError("this client is closed")
            first = self._first = asyncio.get_running_loop().create_task(self._first_round())
        if not first.done():
            # Shielded: one caller's cancellation must not cancel the round every other caller waits on.
            await asyncio.shield(first)

    async def _first_round(self) -> None:
        try:
            await self._resolve()
            await asyncio.gather(*(self._check(r) for r in list(self._replicas.values())))
        finally:
            if not self._closed:
                self._watch = asyncio.get_running_loop().create_task(self._watch_loop())

    async def _watch_loop(self) -> None:
        options = self._options
        self._wake = wake = asyncio.Event()
        while not self._closed:
            try:
                now = time.monotonic()
                if self._dns and now - self._resolved_at >= options.resolve_interval_s:
                    await self._resolve()
                due = [r for r in self._replicas.values() if r.next_check_at <= time.monotonic()]
                if due:
                    await asyncio.gather(*(self._check(r) for r in due))
                self._close_retired()
            except Exception:
                # The watch must outlive any one bad round, or no replica would ever come back.
                _log.exception("a round of fleet health checks failed; the next one runs as planned")
            times = [r.next_check_at for r in self._replicas.values()]
            if self._dns:
                times.append(self._resolved_at + options.resolve_interval_s)
            wait = max(0.0, min(times, default=time.monotonic() + options.health_interval_s) - time.monotonic())
            wake.clear()
            with contextlib.suppress(TimeoutError):
                # No event tells us a replica came back: probing on a clock is the only way to know.
                async with asyncio.timeout(wait):
                    await wake.wait()

    async def _resolve(self) -> None:
        self._resolved_at = time.monotonic()
        if not self._dns:
            return
        want: dict[str, Place] = {}
        for endpoint in self._endpoints:
            if not endpoint.dns:
                place = endpoint.fixed()
                want[place.url] = place
                continue
            try:
                addresses = await self._resolver(endpoint.host, endpoint.port)
            except Exception as err:  # a user's resolver may raise anything; the fleet keeps going
                # Keep what this name stood for until it resolves again: a DNS hiccup is not a fleet gone.
                self._resolve_error = f"{endpoint.url}: {type(err).__name__}: {err}"
                _log.warning("resolving %s failed, keeping its known replicas: %s", endpoint.url, err)
                for r in self._replicas.values():
                    if r.place.server_name == endpoint.host:
                        want[r.url] = r.place
                continue
            self._resolve_error = None if addresses else f"{endpoint.url} has no address records"
            for place in endpoint.places(addresses):
                want[place.url] = place
        for url, place in want.items():
            if url not in self._replicas:
                _log.info("replica %s joined", url)
                self._replicas[url] = Replica(place, self._make(place))  # checked before any use (state None)
        for url in [u for u in self._replicas if u not in want]:
            replica = self._replicas.pop(url)
            _log.info("replica %s left", url)
            replica.state = False
            replica.epoch += 1  # its sequences are lost
            self._retired.append(replica)

    def _close_retired(self) -> None:
        for replica in [r for r in self._retired if r.outstanding == 0]:
            self._retired.remove(replica)
            self._stale.add(replica.transport)
            self._retire_transport(replica.transport)

    async def _check(self, replica: Replica) -> None:
        # A replica that is out is probed over a fresh connection: the old channel sits in gRPC's own reconnect
        # backoff (up to two minutes), which would hide a replica that is back from the probes for that long.
        fresh = self._make(replica.place) if replica.state is False else None
        transport = fresh if fresh is not None else replica.transport
        replica.checks_started += 1
        this_check = replica.checks_started
        limit = self._options.health_timeout_s
        try:
            if not await transport.is_server_ready(timeout_s=limit):
                raise ServerUnavailable("the server says it is not ready", status="UNAVAILABLE")
            try:
                index = await transport.repository_index(timeout_s=limit)
            except PermissionDeniedError:
                models = None  # a restricted repository API: the replica serves whatever it is asked for
            else:
                models = frozenset(str(m.get("name", "")) for m in index if str(m.get("state", "")) == "READY")
        except BaseException as err:
            if fresh is not None:
                await _close_quietly(fresh)
            if isinstance(err, asyncio.CancelledError) or not isinstance(err, Exception):
                raise
            if this_check > replica.check_applied:  # a later check already answered: this one is stale
                replica.check_applied = this_check
                self._take_out(replica, err)  # any failure of a probe means "not usable now"
            return
        if self._replicas.get(replica.url) is not replica or this_check < replica.check_applied:
            if fresh is not None:
                await _close_quietly(fresh)
            return  # left (DNS) while it was being checked, or a later check already answered
        replica.check_applied = this_check
        if fresh is not None:
            stale, replica.transport = replica.transport, fresh
            # Calls still on the old channel (to a server that failed) get a while to fail on their own.
            loop = asyncio.get_running_loop()
            loop.call_later(self._options.max_probe_backoff_s + 30.0, self._retire_transport, stale)
            self._stale.add(stale)
        replica.models = models
        if replica.state is not True:
            if replica.state is False:
                _log.info("replica %s is back (epoch %d)", replica.url, replica.epoch)
            replica.state = True
            replica.failures = 0
            replica.down_since = None
        replica.next_check_at = time.monotonic() + self._options.health_interval_s

    def _retire_transport(self, transport: Transport) -> None:
        if transport in self._stale:
            self._stale.discard(transport)
            task = asyncio.get_running_loop().create_task(_close_quietly(transport))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    def _take_out(self, replica: Replica, err: BaseException, *, epoch: int | None = None) -> None:
        """Take ``replica`` out after ``err``. ``epoch``: the epoch the failed call was sent in; a call sent before
        the replica was last taken out says nothing about it now (it may be back) and is ignored."""
        if epoch is not None and epoch != replica.epoch:
            return
        why = f"{type(err).__name__}: {err}"
        if replica.state is not False:
            replica.epoch += 1  # every sequence pinned to it so far is lost
            replica.down_since = time.monotonic()
            replica.failures = 0
            _log.warning("replica %s taken out: %s", replica.url, why)
        replica.state = False
        replica.failures += 1
        replica.last_error = why
        replica.next_check_at = time.monotonic() + self._options.backoff_s(replica.failures)
        if self._wake is not None:
            self._wake.set()

    # -- picking ----------------------------------------------------------------------------------------

    def _no_replica(self, model: str) -> ServerUnavailable:
        known = list(self._replicas.values())
        if not known:
            why = self._resolve_error or "no replica is known"
        else:
            down = [f"{r.url} ({r.last_error or 'not checked yet'})" for r in known if r.state is not True]
            why = "; ".join(down) if len(down) == len(known) else "no healthy replica has it READY"
        return ServerUnavailable(
            f"no replica can take a request for model {model!r}: {why}", model=model, status="UNAVAILABLE"
        )

    def _pick(self, model: str, tried: set[str]) -> Replica | None:
        """The least-loaded healthy replica serving ``model`` (any healthy one if none has it READY)."""
        replicas = [r for r in self._replicas.values() if r.url not in tried and r.state is True]
        serving = [r for r in replicas if r.models is None or model in r.models] or replicas
        if not serving:
            return None
        n = len(serving)
        self._turn = start = (self._turn + 1) % n
        best = serving[start]
        for i in range(1, n):
            candidate = serving[(start + i) % n]
            if candidate.outstanding < best.outstanding:
                best = candidate
        return best

    def _serving(self, model: str) -> list[Replica]:
        """The healthy replicas with ``model`` READY (every healthy one when none has it: the server then says why)."""
        healthy = [r for r in self._replicas.values() if r.state is True]
        return [r for r in healthy if r.models is None or model in r.models] or healthy

    def _place_sequence(self, model: str, sequence_id: int | str, start: bool) -> Replica:
        key = sequence_key(model, sequence_id)
        pin = self._pins.get(key)
        if pin is not None:
            replica, epoch = pin
            if replica.epoch == epoch and replica.state is not False and self._replicas.get(replica.url) is replica:
                return replica
            del self._pins[key]
            if not start:
                raise SequenceLost(
                    f"sequence {sequence_id!r} of model {model!r} was pinned to replica {replica.url}, which has "
                    f"failed or left since ({replica.last_error or 'no longer in the fleet'}): its state went with "
                    "it; start a new sequence (a chat opened with replay_on_loss=True replays on another replica)",
                    sequence_id=sequence_id,
                    model=model,
                    status="UNAVAILABLE",
                )
        chosen = rendezvous(key, ((r.url, r) for r in self._serving(model)))
        if chosen is None:
            raise self._no_replica(model)
        self._pins[key] = (chosen, chosen.epoch)
        return chosen

    def placement(self, model: str, sequence_id: int | str) -> str | None:
        """The URL of the replica holding this sequence (its pin), or where a START would go now; None if none can."""
        pin = self._pins.get(sequence_key(model, sequence_id))
        if pin is not None and pin[0].epoch == pin[1] and self._replicas.get(pin[0].url) is pin[0]:
            return pin[0].url
        chosen = rendezvous(sequence_key(model, sequence_id), ((r.url, r) for r in self._serving(model)))
        return None if chosen is None else chosen.url

    def _after_sequence_call(
        self, replica: Replica, model: str, sequence_id: int | str, *, end: bool, err: BaseException | None
    ) -> None:
        key = sequence_key(model, sequence_id)
        if err is None:
            if end:
                self._pins.pop(key, None)
            return
        gone = isinstance(err, SequenceLost)  # Triton's missing-START refusal too: the classifier types it
        if gone or is_replica_failure(err):
            self._pins.pop(key, None)

    # -- the call primitive -----------------------------------------------------------------------------

    def call(self, call: Call, /) -> Responses:
        if self._closed:
            raise ClientClosedError("this client is closed")
        if call.route != "unary" and not self.can_stream:
            raise UsageError(f"route {call.route!r} needs gRPC; this client speaks {self._protocol}")
        if call.stateless:
            return _Stateless(self, call)
        return _Routed(self, call)

    def elsewhere(self, call: Call) -> bool:
        """Whether a stateless ``call`` sent again now would find a healthy replica serving its model (replicas that
        failed it are out): the retry policy then moves it there at once instead of backing off."""
        return call.stateless and self._pick(call.model, set()) is not None

    # -- admin calls --------------------------------------------------------------------------------------

    async def _first_answer(self, model: str, ask: Callable[[Transport], Awaitable[T]]) -> T:
        """``ask`` one replica (serving ``model`` when it is not empty), moving on while replicas fail."""
        await self.ready()
        tried: set[str] = set()
        last: TritonError | None = None
        while (replica := self._pick(model, tried)) is not None:
            epoch = replica.epoch
            try:
                return await ask(replica.transport)
            except TritonError as err:
                if not is_replica_failure(err):
                    raise
                self._take_out(replica, err, epoch=epoch)
                tried.add(replica.url)
                last = err
        raise last or self._no_replica(model or "(any)")

    async def _everywhere(self, ask: Callable[[Transport], Awaitable[T]]) -> list[tuple[Replica, T]]:
        """``ask`` every healthy replica at once; the first failure is raised after all have answered."""
        await self.ready()
        healthy = [r for r in self._replicas.values() if r.state is True]
        if not healthy:
            raise self._no_replica("(any)")
        results = await asyncio.gather(*(ask(r.transport) for r in healthy), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return list(zip(healthy, results, strict=True))  # type: ignore[arg-type]

    async def is_server_live(self, *, timeout_s: float | None) -> bool:
        return any(ok for _, ok in await self._each(lambda t: t.is_server_live(timeout_s=timeout_s)))

    async def is_server_ready(self, *, timeout_s: float | None) -> bool:
        return any(ok for _, ok in await self._each(lambda t: t.is_server_ready(timeout_s=timeout_s)))

    async def is_model_ready(self, name: str, version: str, *, timeout_s: float | None) -> bool:
        answers = await self._each(lambda t: t.is_model_ready(name, version, timeout_s=timeout_s))
        return any(ok for _, ok in answers)

    async def _each(self, ask: Callable[[Transport], Awaitable[bool]]) -> list[tuple[Replica, bool]]:
        """A yes/no question to every known replica; one that cannot answer says no."""
        await self.ready()
        replicas = list(self._replicas.values())

        async def one(transport: Transport) -> bool:
            try:
                return await ask(transport)
            except TritonError:
                return False

        return list(zip(replicas, await asyncio.gather(*(one(r.transport) for r in replicas)), strict=True))

    async def server_metadata(self, *, timeout_s: float | None) -> Json:
        return await self._first_answer("", lambda t: t.server_metadata(timeout_s=timeout_s))

    async def model_metadata(self, name: str, version: str, *, timeout_s: float | None) -> Json:
        return await self._first_answer(name, lambda t: t.model_metadata(name, version, timeout_s=timeout_s))

    async def model_config(self, name: str, version: str, *, timeout_s: float | None) -> Json:
        return await self._first_answer(name, lambda t: t.model_config(name, version, timeout_s=timeout_s))

    async def repository_index(self, *, timeout_s: float | None) -> list[Json]:
        """The union of the healthy replicas' indexes: a model is READY if it is READY on one of them."""
        merged: dict[tuple[str, str], Json] = {}
        for _, index in await self._everywhere(lambda t: t.repository_index(timeout_s=timeout_s)):
            for entry in index:
                key = (str(entry.get("name", "")), str(entry.get("version", "")))
                if key not in merged or str(entry.get("state", "")) == "READY":
                    merged[key] = dict(entry)
        return [merged[k] for k in sorted(merged)]

    async def load_model(self, name: str, *, timeout_s: float | None) -> None:
        """Load ``name`` on every healthy replica (a fleet serves one repository)."""
        for replica, _ in await self._everywhere(lambda t: t.load_model(name, timeout_s=timeout_s)):
            if replica.models is not None:
                replica.models = replica.models | {name}

    async def unload_model(self, name: str, *, timeout_s: float | None) -> None:
        for replica, _ in await self._everywhere(lambda t: t.unload_model(name, timeout_s=timeout_s)):
            if replica.models is not None:
                replica.models = replica.models - {name}

    async def inference_statistics(self, name: str, version: str, *, timeout_s: float | None) -> list[Json]:
        """Each version's statistics summed over the healthy replicas (``last_inference``: the latest)."""
        per = await self._everywhere(lambda t: t.inference_statistics(name, version, timeout_s=timeout_s))
        merged: dict[tuple[str, str], Json] = {}
        for _, entries in per:
            for entry in entries:
                key = (str(entry.get("name", "")), str(entry.get("version", "")))
                merged[key] = _add(merged[key], entry) if key in merged else entry
        return [merged[k] for k in sorted(merged)]

    # -- per replica --------------------------------------------------------------------------------------

    def replica_status(self) -> tuple[ReplicaStatus, ...]:
        """A snapshot of every replica (see :class:`ReplicaStatus`), in URL order."""
        pinned: dict[str, int] = {}
        for replica, epoch in self._pins.values():
            if replica.epoch == epoch:
                pinned[replica.url] = pinned.get(replica.url, 0) + 1
        return tuple(r.status(pinned.get(r.url, 0)) for r in sorted(self._replicas.values(), key=lambda r: r.url))

    async def refresh(self) -> None:
        """Check every replica now (and resolve DNS names again)."""
        await self.ready()
        await self._resolve()
        await asyncio.gather(*(self._check(r) for r in list(self._replicas.values())))

    async def each_replica(
        self, ask: Callable[[Transport], Awaitable[T]]
    ) -> dict[str, T | TritonError]:
        """``ask`` every known replica (healthy or not) at once: each one's answer, or the error it gave."""
        await self.ready()
        replicas = list(self._replicas.values())

        async def one(transport: Transport) -> T | TritonError:
            try:
                return await ask(transport)
            except TritonError as err:
                return err

        answers = await asyncio.gather(*(one(r.transport) for r in replicas))
        return {r.url: a for r, a in zip(replicas, answers, strict=True)}

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        for task in (self._first, self._watch):
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        transports = [*(r.transport for r in [*self._replicas.values(), *self._retired]), *self._stale]
        self._retired.clear()
        self._stale.clear()
        await asyncio.gather(*(_close_quietly(t) for t in transports), *self._closing)


async def _close_quietly(transport: Transport) -> None:
    try:
        await transport.aclose()
    except Exception as err:  # closing is best effort: the connection is being dropped either way
        _log.debug("closing a replica's transport failed: %r", err)


def _add(a: Json, b: Json) -> Json:
    """Two statistics entries summed field by field (gRPC JSON carries int64 as strings)."""
    out: Json = {}
    for key in a.keys() | b.keys():
        x, y = a.get(key), b.get(key)
        if isinstance(x, dict) and isinstance(y, dict):
            out[key] = _add(x, y)
        elif _number(x) and _number(y):
            total = max(int(x), int(y)) if key in _NUMERIC_MAX else int(x) + int(y)  # type: ignore[arg-type]
            out[key] = str(total) if isinstance(x, str) else total
        else:
            out[key] = x if x is not None else y
    return out


def _number(value: object) -> bool:
    return (isinstance(value, int) and not isinstance(value, bool)) or (isinstance(value, str) and value.isdigit())


class _Stateless(OneResponse):
    """A stateless request, sent once to the least-loaded replica; a replica that fails it is taken out."""

    __slots__ = ("_call", "_fleet")

    def __init__(self, fleet: FleetTransport, call: Call) -> None:
        super().__init__()
        self._fleet = fleet
        self._call = call

    async def _send(self) -> InferResult:
        fleet = self._fleet
        if fleet._first is None or not fleet._first.done():
            await fleet.ready()
        call = self._call
        replica = fleet._pick(call.model, set())
        if replica is None:
            raise fleet._no_replica(call.model)
        note_replica(replica.url)
        replica.outstanding += 1
        replica.requests += 1
        epoch = replica.epoch
        began = time.perf_counter()
        try:
            result = await replica.transport.call(call).single()
        except TritonError as err:
            replica.errors += 1
            if is_replica_failure(err):
                fleet._take_out(replica, err, epoch=epoch)
            raise
        finally:
            replica.outstanding -= 1
        replica.latencies.append((time.perf_counter() - began) * 1e3)
        return result


class _Routed:
    """A sequence step or a streamed request: one replica, chosen when the answers are first read."""

    __slots__ = ("_began", "_call", "_done", "_epoch", "_fleet", "_inner", "_replica")

    def __init__(self, fleet: FleetTransport, call: Call) -> None:
        self._fleet = fleet
        self._call = call
        self._inner: Responses | None = None
        self._replica: Replica | None = None
        self._done: Literal[False, True] = False
        self._began = 0.0
        self._epoch = 0

    async def _open(self) -> Responses:
        fleet = self._fleet
        if fleet._first is None or not fleet._first.done():
            await fleet.ready()
        call = self._call
        if call.sequence_id is None:
            replica = fleet._pick(call.model, set())
            if replica is None:
                raise fleet._no_replica(call.model)
        else:
            replica = fleet._place_sequence(call.model, call.sequence_id, call.sequence_start)
        note_replica(replica.url)
        self._replica = replica
        self._epoch = replica.epoch
        replica.outstanding += 1
        replica.requests += 1
        self._began = time.perf_counter()
        inner = self._inner = replica.transport.call(call)
        return inner

    def _finish(self, err: BaseException | None, *, answered: bool) -> None:
        replica = self._replica
        if self._done or replica is None:
            return
        self._done = True
        replica.outstanding -= 1
        if err is not None:
            replica.errors += 1
            if is_replica_failure(err):
                self._fleet._take_out(replica, err, epoch=self._epoch)
        elif answered:
            replica.latencies.append((time.perf_counter() - self._began) * 1e3)
        call = self._call
        if call.sequence_id is not None and (err is not None or answered):
            self._fleet._after_sequence_call(replica, call.model, call.sequence_id, end=call.sequence_end, err=err)

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> InferResult:
        inner = self._inner if self._inner is not None else await self._open()
        try:
            return await inner.__anext__()
        except StopAsyncIteration:
            self._finish(None, answered=True)
            raise
        except TritonError as err:
            self._finish(err, answered=False)
            raise

    async def single(self) -> InferResult:
        inner = self._inner if self._inner is not None else await self._open()
        try:
            result = await inner.single()
        except TritonError as err:
            self._finish(err, answered=False)
            raise
        except BaseException:
            self._finish(None, answered=False)
            raise
        self._finish(None, answered=True)
        return result

    async def aclose(self) -> None:
        inner = self._inner
        try:
            if inner is not None:
                await inner.aclose()
        finally:
            self._finish(None, answered=False)
