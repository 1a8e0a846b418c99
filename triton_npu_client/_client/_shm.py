"""System shared memory for inference when client and server share a host: a pool of registered regions.

A :class:`SharedMemoryPool` owns ``slots`` pairs of POSIX shared-memory regions (one for a request's inputs, one
for its outputs), registered with the server. A request takes a free slot, its tensors are written into the input
region, and the request names the region instead of carrying the bytes; the server writes the outputs into the
output region, and they are copied out before the slot is handed to the next request.

Region names carry a fixed prefix and their owner: ``triton-npu-shm-<pid>-<start>-<pidns>-<n>`` (``start``: the
process's start time, so a reused pid is not mistaken for the owner; ``pidns``: its pid namespace, so processes
that share ``/dev/shm`` but not a pid namespace never judge each other). Cleanup, from the most to the least
orderly end: ``aclose()`` (also ``async with``); a forgotten pool at exit or garbage collection (a finaliser
unregisters over a blocking channel and unlinks); a crash (SIGKILL, OOM): the next ``open()`` on the same host,
in any process, sweeps regions whose owner is dead, from ``/dev/shm`` and from the server's registrations.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import re
import time
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Final, Self

import attrs
import numpy as np
import tritonclient.utils.shared_memory as tshm
from tritonclient.grpc import service_pb2

from .._call import USE_CLIENT_DEFAULT, UseClientDefault, run_with_retry
from .._errors import (
    ClientClosedError,
    InternalServerError,
    InvalidArgumentError,
    RequestTimeout,
    ServerError,
    TritonError,
    UsageError,
)
from .._transport import GrpcTransport, server_timeout_us
from .._wire import InferRequest, InferResult, ShmPlace, from_wire, numpy_dtype
from ._model import Model

__all__ = ["PREFIX", "SharedMemoryPool", "SharedMemoryStats"]

_log = logging.getLogger("triton_npu_client.shm")

PREFIX: Final = "triton-npu-shm-"
_NAME = re.compile(re.escape(PREFIX) + r"(\d+)-(\d+)-(\d+)-(\d+)\Z")
_DEV_SHM: Final = Path("/dev/shm")
_ALIGN: Final = 64  # tensor offsets inside a region: cache-line aligned
_PAGE: Final = 4096
_INITIAL_BYTES: Final = 1 << 16
_LEARNED_MAX: Final = 256
_EXIT_TIMEOUT_S: Final = 3.0
_CLEANUP_TIMEOUT_S: Final = 10.0

# Region numbers, unique in this process across pools (the name also carries the pid and start time).
_numbers = itertools.count()


# -- owners -----------------------------------------------------------------------------------------------


def _start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks after boot, from /proc; None when there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        # The command name (field 2) may hold spaces and parentheses: fields are counted after its last ')'.
        return int(stat.rpartition(")")[2].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


_HAS_PROC: Final = Path("/proc/self/stat").exists()


def _owner_tag(pid: int) -> str:
    return f"{PREFIX}{pid}-{(_start_ticks(pid) or 0) if _HAS_PROC else 0}-{_pid_namespace()}-"


def _alive(pid: int, start: int) -> bool:
    """Whether the process that made a region lives; in doubt (its /proc entry hidden from us), it does."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists, under another user
    if not _HAS_PROC or start == 0:
        return True
    now = _start_ticks(pid)
    return now is None or now == start  # another start time: the pid was reused, the owner is gone


def _orphaned(name: str) -> bool:
    """Whether ``name`` is a region of this SDK whose owner process, in this pid namespace, is gone."""
    match = _NAME.match(name)
    if match is None:
        return False
    pid, start, namespace = int(match[1]), int(match[2]), int(match[3])
    if namespace != _pid_namespace():
        return False  # another pid namespace: its pids mean nothing here
    return not _alive(pid, start)


# -- regions ------------------------------------------------------------------------------------------------


class _Region:
    """One POSIX shared-memory object, created through tritonclient's shared-memory utilities."""

    __slots__ = ("byte_size", "handle", "name")

    def __init__(self, byte_size: int) -> None:
        self.name = f"{_owner_tag(os.getpid())}{next(_numbers)}"
        self.byte_size = byte_size
        # create_only: never attach to a leftover object of the same name (its size could differ).
        self.handle: Any = tshm.create_shared_memory_region(self.name, self.name, byte_size, create_only=True)

    @property
    def key(self) -> str:
        """The key the server opens (``shm_open`` form)."""
        return "/" + self.name

    def write(self, data: bytes, offset: int) -> None:
        tshm.set_shared_memory_region(self.handle, [np.frombuffer(data, dtype=np.uint8)], offset=offset)

    def read(self, offset: int, size: int) -> bytes:
        """A copy of ``size`` bytes: the region is reused by the next request."""
        data: bytes = tshm.get_contents_as_numpy(self.handle, np.uint8, [size], offset=offset).tobytes()
        return data

    def destroy(self) -> None:
        try:
            tshm.destroy_shared_memory_region(self.handle)
        except Exception as err:  # cleanup goes on with the other regions
            _log.warning("could not remove shared memory %s: %s", self.name, err)


class _Slot:
    __slots__ = ("inputs", "outputs")

    def __init__(self) -> None:
        self.inputs: _Region | None = None
        self.outputs: _Region | None = None


class _Registry:
    """What exists outside this process on behalf of one pool; shared with its finaliser (which must not hold it)."""

    __slots__ = ("local", "registered", "transport")

    def __init__(self, transport: GrpcTransport) -> None:
        self.transport = transport
        self.local: dict[str, _Region] = {}  # objects in /dev/shm this pool created and not yet removed
        self.registered: set[str] = set()  # region names the server holds for this pool


def _cleanup_at_exit(registry: _Registry) -> None:
    """The finaliser of a pool that was never closed: runs at garbage collection or interpreter exit."""
    try:
        if registry.registered:
            left = registry.transport.blocking_unregister(sorted(registry.registered), timeout_s=_EXIT_TIMEOUT_S)
            registry.registered.intersection_update(left)
        for region in list(registry.local.values()):
            region.destroy()
        registry.local.clear()
    except Exception:  # never raise from a finaliser
        _log.warning("shared memory cleanup at exit failed", exc_info=True)


def _aligned(size: int) -> int:
    return -(-size // _ALIGN) * _ALIGN


def _layout(sizes: Sequence[int]) -> tuple[list[int], int]:
    """Offsets for tensors of ``sizes`` bytes packed in one region, and the bytes the region needs."""
    offsets = []
    end = 0
    for size in sizes:
        offsets.append(end)
        end += _aligned(size)
    return offsets, end


def _wire_itemsize(dtype: str) -> int:
    return 2 if dtype == "BF16" else numpy_dtype(dtype).itemsize


# What a pool learned about the outputs of one request signature: (name, dtype, wire bytes or None for BYTES).
_Learned = tuple[tuple[str, str, int | None], ...]


@attrs.frozen(kw_only=True)
class SharedMemoryStats:
    """A pool's counters since it opened.

    ``outputs_in_shm`` / ``outputs_plain``: outputs read from the slot's region / sent back in the response (the
    first request of each input-shape signature, and BYTES outputs, travel plainly: see :class:`SharedMemoryPool`).
    """

    slots: int
    in_use: int
    peak_in_use: int
    requests: int
    outputs_in_shm: int
    outputs_plain: int
    regions_grown: int
    reregistered: int
    swept: int
    region_bytes: tuple[tuple[int, int], ...]  # per slot: (input region, output region) sizes


class SharedMemoryPool:
    """Inference through system shared memory when client and server share a host (gRPC only).

    ::

        pool = await SharedMemoryPool.open(model, slots=4)
        async with pool:
            result = await pool.infer_batch({"INPUT0": batch})

    ``infer_batch`` validates exactly like ``model.infer_batch`` (same typed errors, before anything is sent),
    writes the inputs into a free slot, sends a request that names the slot's regions, and copies the outputs
    out. At most ``slots`` requests run at once; others wait for a slot. A region grows when a request needs
    more. Outputs: the first request of each signature (input shapes and outputs asked for) gets its outputs in
    the response, and the pool learns their sizes; later ones get them written into the slot's output region.
    BYTES outputs always come in the response (their size depends on their content). Transient failures are
    retried per the client's retry policy, and regions the server forgot (a restarted server) are registered
    again. A slot whose request may still be running on the server (cancelled, timed out) gets fresh regions.

    Cleanup: see the module docstring; ``open()`` also sweeps regions left by dead processes.
    """

    def __init__(self, model: Model, transport: GrpcTransport, slots: int, initial_bytes: int) -> None:
        """Use :meth:`open`."""
        self._model = model
        self._transport = transport
        self._initial = max(_PAGE, initial_bytes)
        self._slots = [_Slot() for _ in range(slots)]
        self._free: asyncio.Queue[_Slot] = asyncio.Queue()
        for slot in self._slots:
            self._free.put_nowait(slot)
        self._registry = _Registry(transport)
        self._finalizer = weakref.finalize(self, _cleanup_at_exit, self._registry)
        self._stale: set[str] = set()  # registered names of retired regions, to unregister when possible
        self._learned: dict[tuple[object, ...], _Learned] = {}
        self._closed = False
        self._in_use = 0
        self._peak = 0
        self._requests = 0
        self._outputs_in_shm = 0
        self._outputs_plain = 0
        self._grown = 0
        self._reregistered = 0
        self._swept = 0

    def __repr__(self) -> str:
        state = " closed" if self._closed else ""
        return f"<SharedMemoryPool {self._model.name!r} slots={len(self._slots)}{state}>"

    # -- lifecycle ----------------------------------------------------------------------------------------

    @classmethod
    async def open(cls, model: Model, *, slots: int, initial_bytes: int = _INITIAL_BYTES) -> SharedMemoryPool:
        """Sweep regions of dead processes, then create and register ``slots`` slots of ``initial_bytes`` each.

        Refused with :class:`UsageError` before anything is created: an HTTP client (Triton's shared-memory
        inference here goes over gRPC), a decoupled or stateful model, ``slots < 1``. A server on another host
        cannot open the regions: registering them fails with the server's error.
        """
        if slots < 1:
            raise UsageError(f"slots must be >= 1, got {slots}")
        caller = model.caller
        if caller.closed:
            raise ClientClosedError("the client this model handle belongs to is closed")
        transport = caller.transport
        if transport.protocol == "grpc" and not isinstance(transport, GrpcTransport):
            # Regions are registered with one server, which must see this machine's /dev/shm.
            raise UsageError(
                f"shared memory for model {model.name!r} needs a client of one server: this client spreads requests "
                "over several replicas; make a Client of the one replica on this machine for the pool",
                model=model.name,
            )
        if not isinstance(transport, GrpcTransport):
            raise UsageError(
                f"shared memory for model {model.name!r} needs a gRPC client (grpc://); this client speaks "
                f"{transport.protocol}",
                model=model.name,
            )
        spec = model.spec
        if spec.decoupled or spec.sequence is not None:
            kind = "decoupled" if spec.decoupled else "stateful (sequence batching)"
            raise UsageError(
                f"model {model.name!r} is {kind}: a shared-memory pool sends stateless requests only",
                model=model.name,
            )
        pool = cls(model, transport, slots, initial_bytes)
        try:
            deadline = pool._deadline(USE_CLIENT_DEFAULT)
            pool._swept = await _sweep(transport, _left(deadline))
            for slot in pool._slots:
                await pool._fit(slot, pool._initial, pool._initial, deadline)
        except BaseException:
            pool._closed = True
            await pool._cleanup()
            raise
        return pool

    async def aclose(self) -> None:
        """Wait for requests in flight, unregister every region from the server and unlink it; idempotent.

        Requests waiting for a slot fail with :class:`ClientClosedError`. Cancelled, it still unlinks.
        """
        if self._closed:
            return
        self._closed = True
        held: list[_Slot] = []
        try:
            for _ in self._slots:
                held.append(await self._free.get())
        finally:
            # A waiter for a slot fails only once a slot reaches it, and a release that woke one may have been
            # taken here instead (two releases before either taker runs): hand the slots back, so that each
            # waiter takes one, finds the pool closed and passes it on.
            for slot in held:
                self._free.put_nowait(slot)
            await self._cleanup()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    @property
    def is_closed(self) -> bool:
        return self._closed

    @property
    def model(self) -> Model:
        return self._model

    def region_names(self) -> tuple[str, ...]:
        """The names (and, with a leading ``/``, the keys) of the regions this pool holds now."""
        return tuple(sorted(self._registry.local))

    def stats(self) -> SharedMemoryStats:
        return SharedMemoryStats(
            slots=len(self._slots),
            in_use=self._in_use,
            peak_in_use=self._peak,
            requests=self._requests,
            outputs_in_shm=self._outputs_in_shm,
            outputs_plain=self._outputs_plain,
            regions_grown=self._grown,
            reregistered=self._reregistered,
            swept=self._swept,
            region_bytes=tuple(
                (s.inputs.byte_size if s.inputs else 0, s.outputs.byte_size if s.outputs else 0) for s in self._slots
            ),
        )

    # -- inference ----------------------------------------------------------------------------------------

    async def infer_batch(
        self,
        arrays: Mapping[str, object],
        *,
        outputs: Sequence[str] | None = None,
        timeout_s: float | UseClientDefault | None = USE_CLIENT_DEFAULT,
        allow_lossy: bool = False,
    ) -> InferResult:
        """Validate like ``model.infer_batch(arrays)``, then run the request through a free slot.

        The result equals what ``model.infer_batch`` returns (outputs are copies, independent of the pool).
        ``timeout_s`` bounds the whole call, the wait for a slot included.
        """
        if self._closed:
            raise ClientClosedError(f"the shared memory pool for model {self._model.name!r} is closed")
        request = self._model.batch_request(arrays, outputs=outputs, allow_lossy=allow_lossy)
        deadline = self._deadline(timeout_s)
        slot = await self._acquire(deadline)
        try:
            return await self._run(slot, request, deadline)
        finally:
            self._in_use -= 1
            self._free.put_nowait(slot)

    def _deadline(self, timeout_s: float | UseClientDefault | None) -> float | None:
        timeout = self._model.caller.timeout(timeout_s)
        return None if timeout is None else time.monotonic() + timeout

    async def _acquire(self, deadline: float | None) -> _Slot:
        try:
            if self._free.empty():
                slot = await asyncio.wait_for(self._free.get(), _left(deadline))
            else:
                slot = self._free.get_nowait()
        except TimeoutError:
            raise RequestTimeout(
                f"model {self._model.name!r}: no shared memory slot became free in time", model=self._model.name
            ) from None
        if self._closed:
            self._free.put_nowait(slot)  # for aclose, which is collecting every slot
            raise ClientClosedError(f"the shared memory pool for model {self._model.name!r} is closed")
        self._in_use += 1
        self._peak = max(self._peak, self._in_use)
        return slot

    async def _run(self, slot: _Slot, request: InferRequest, deadline: float | None) -> InferResult:
        sizes = [len(enc.data) for enc in request.inputs]
        in_offsets, in_need = _layout(sizes)
        signature = (tuple((enc.name, enc.shape) for enc in request.inputs), request.outputs)
        learned = self._learned.get(signature)
        out_offsets, out_need = _layout([size or 0 for _, _, size in learned or ()])
        await self._fit(slot, in_need, out_need, deadline)
        assert slot.inputs is not None
        assert slot.outputs is not None
        for enc, offset in zip(request.inputs, in_offsets, strict=True):
            slot.inputs.write(enc.data, offset)
        in_places = [ShmPlace(slot.inputs.name, size, off) for size, off in zip(sizes, in_offsets, strict=True)]
        out_places: list[tuple[str, ShmPlace | None]] | None = None
        if learned is not None:
            out_places = [
                (name, ShmPlace(slot.outputs.name, size, off) if size else None)
                for (name, _, size), off in zip(learned, out_offsets, strict=True)
            ]
        checked_regions = False
        while True:
            payload = request.grpc_shm_bytes(
                in_places, out_places, timeout_us=server_timeout_us(_left(deadline), None)
            )
            try:
                response = await self._send(slot, payload, deadline)
            except ServerError as err:
                # A request naming regions the server does not hold fails like a bad request: the regions are
                # checked (the server may have restarted) before the error is believed.
                if not checked_regions:
                    checked_regions = True
                    if await self._reregister_missing(slot, deadline):
                        continue
                # A learned output size that no longer fits (an output whose shape depends on values): the
                # outputs come back in the response instead, and are learned again.
                if out_places is not None and isinstance(err, InternalServerError | InvalidArgumentError):
                    out_places = None
                    self._learned.pop(signature, None)
                    continue
                raise
            break
        self._requests += 1
        return self._decode(response, slot.outputs, out_places, signature)

    async def _send(self, slot: _Slot, payload: bytes, deadline: float | None) -> service_pb2.ModelInferResponse:
        model = self._model

        async def attempt(remaining_s: float | None) -> service_pb2.ModelInferResponse:
            return await self._transport.infer_bytes(
                payload, timeout_s=remaining_s, model=model.name, version=model.spec.version or ""
            )

        answered = False
        try:
            response = await run_with_retry(attempt, model.caller.retry, timeout_s=_left(deadline))
            answered = True
            return response
        except ServerError:
            answered = True  # the server answered: it is done with the slot
            raise
        finally:
            if not answered:
                # Cancelled, timed out or cut off: the server may still read the inputs or write the outputs of
                # this request later, so the slot's regions are retired and the next request gets fresh ones.
                self._retire(slot)

    def _decode(
        self,
        response: service_pb2.ModelInferResponse,
        region: _Region,
        places: Sequence[tuple[str, ShmPlace | None]] | None,
        signature: tuple[object, ...],
    ) -> InferResult:
        in_shm = {name: place for name, place in places or () if place is not None}
        raw = response.raw_output_contents
        outputs = {}
        seen: list[tuple[str, str, int | None]] = []
        for i, out in enumerate(response.outputs):
            shape = tuple(out.shape)
            place = in_shm.get(out.name)
            if place is not None:
                size = int(np.prod(shape, dtype=np.int64)) * _wire_itemsize(out.datatype)
                data = region.read(place.offset, size)
                self._outputs_in_shm += 1
            else:
                data = raw[i] if i < len(raw) else b""
                self._outputs_plain += 1
            outputs[out.name] = from_wire(data, out.datatype, shape)
            seen.append((out.name, out.datatype, None if out.datatype == "BYTES" else len(data)))
        if places is None:
            if len(self._learned) >= _LEARNED_MAX:
                del self._learned[next(iter(self._learned))]
            self._learned[signature] = tuple(seen)
        return InferResult(
            model=response.model_name, version=response.model_version, request_id=response.id, outputs=outputs
        )

    # -- regions ------------------------------------------------------------------------------------------

    async def _fit(self, slot: _Slot, in_need: int, out_need: int, deadline: float | None) -> None:
        """Give ``slot`` regions of at least these sizes (new and registered; a smaller old one is retired)."""
        await self._drop_stale(deadline)
        for attr, need in (("inputs", in_need), ("outputs", out_need)):
            old: _Region | None = getattr(slot, attr)
            if old is not None and old.byte_size >= need:
                continue
            size = max(need, self._initial if old is None else 2 * old.byte_size)
            region = self._new_region(-(-size // _PAGE) * _PAGE)
            try:
                await self._register(region, deadline)
            except BaseException:
                self._forget(region)
                raise
            setattr(slot, attr, region)
            if old is not None:
                self._grown += 1
                self._forget(old)
                await self._drop_stale(deadline)

    def _new_region(self, byte_size: int) -> _Region:
        region = _Region(byte_size)
        self._registry.local[region.name] = region
        return region

    async def _register(self, region: _Region, deadline: float | None) -> None:
        # Counted as registered before the call: cancelled after the server took it, it must still be removed.
        self._registry.registered.add(region.name)
        await self._transport.register_system_shared_memory(
            region.name, region.key, region.byte_size, timeout_s=_left(deadline)
        )

    def _forget(self, region: _Region) -> None:
        """Unlink ``region`` now; its server registration, if any, goes on the stale list."""
        self._registry.local.pop(region.name, None)
        region.destroy()
        if region.name in self._registry.registered:
            self._stale.add(region.name)

    def _retire(self, slot: _Slot) -> None:
        for attr in ("inputs", "outputs"):
            region: _Region | None = getattr(slot, attr)
            if region is not None:
                self._forget(region)
                setattr(slot, attr, None)

    async def _drop_stale(self, deadline: float | None) -> None:
        for name in sorted(self._stale):
            try:
                await self._transport.unregister_system_shared_memory(name, timeout_s=_left(deadline))
            except ServerError:
                # Not held any more (a restarted server), or refused (still in use): left to aclose.
                self._stale.discard(name)
                continue
            except TritonError:
                return  # the server is unreachable: try again later
            self._registry.registered.discard(name)
            self._stale.discard(name)

    async def _reregister_missing(self, slot: _Slot, deadline: float | None) -> bool:
        """Register again those of ``slot``'s regions the server does not hold; whether there were any."""
        held = {r.get("name") for r in await self._transport.system_shared_memory_status(timeout_s=_left(deadline))}
        missing = [r for r in (slot.inputs, slot.outputs) if r is not None and r.name not in held]
        for region in missing:
            await self._register(region, deadline)
            self._reregistered += 1
        return bool(missing)

    async def _cleanup(self) -> None:
        """Unregister every region of this pool and unlink it (unlinking happens even when cancelled)."""
        try:
            names = sorted(self._registry.registered)
            deadline = time.monotonic() + _CLEANUP_TIMEOUT_S
            for name in names:
                try:
                    await self._transport.unregister_system_shared_memory(name, timeout_s=_left(deadline))
                except ServerError:
                    pass  # the server no longer holds it
                except TritonError:
                    break  # unreachable: the finaliser tries again at exit, and a later sweep after that
                self._registry.registered.discard(name)
                self._stale.discard(name)
        finally:
            for slot in self._slots:
                slot.inputs = slot.outputs = None
            for region in list(self._registry.local.values()):
                region.destroy()
            self._registry.local.clear()
            if not self._registry.registered:
                self._finalizer.detach()


def _left(deadline: float | None) -> float | None:
    """Seconds left until ``deadline``; :class:`RequestTimeout` when none are."""
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise RequestTimeout("the shared memory request ran out of time")
    return left


async def _sweep(transport: GrpcTransport, timeout_s: float | None) -> int:
    """Remove regions whose owner process is dead: from /dev/shm and from the server. How many were found."""
    swept: set[str] = set()
    with contextlib.suppress(OSError):
        for entry in os.listdir(_DEV_SHM):
            if entry.startswith(PREFIX) and _orphaned(entry):
                try:
                    (_DEV_SHM / entry).unlink()
                except OSError:
                    continue  # another sweeper got there first, or it is not ours to remove
                swept.add(entry)
    for region in await transport.system_shared_memory_status(timeout_s=timeout_s):
        name = str(region.get("name", ""))
        if name.startswith(PREFIX) and _orphaned(name):
            with contextlib.suppress(ServerError):  # another sweeper got there first
                await transport.unregister_system_shared_memory(name, timeout_s=timeout_s)
            swept.add(name)
    if swept:
        _log.info("removed %d shared memory regions of dead processes", len(swept))
    return len(swept)
