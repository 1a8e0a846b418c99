"""Client-side batching (``Client(coalescing=Coalescing())``) against the real server, plus merge/split."""

from __future__ import annotations

import asyncio
import collections
import inspect
from typing import Any

import numpy as np
import pytest

from triton_npu_client import (
    Call,
    Client,
    ClientClosedError,
    Coalescing,
    ConnectError,
    InferResult,
    InvalidArgumentError,
    LocalTriton,
    Model,
    RequestTimeout,
)
from triton_npu_client._call._coalesce import Coalescer, merge, split
from triton_npu_client._client._client import DEFAULT_COALESCING
from triton_npu_client._model import ModelSpec, build_request
from triton_npu_client._transport import GrpcTransport, Transport
from triton_npu_client._wire import InferRequest

MODEL = "scale_fp32"


def _url(server: LocalTriton, protocol: str) -> str:
    return server.grpc_url if protocol == "grpc" else server.http_url


async def _counts(client: Client) -> tuple[int, int]:
    """(requests the server answered, rows it inferred) for MODEL so far."""
    stats = await client.inference_statistics(MODEL)
    return sum(s.success_count for s in stats), sum(s.inference_count for s in stats)


async def _counts_reaching(client: Client, rows: int) -> tuple[int, int]:
    """:func:`_counts` once the server has counted ``rows`` rows (or 30 s passed: the caller's assert fails).

    Triton updates a request's statistics after it has sent the response, so a caller holding its answer
    can read counts that do not include it yet. Each poll is one statistics call, which paces the loop.
    """
    loop = asyncio.get_running_loop()
    give_up = loop.time() + 30.0
    while True:
        counts = await _counts(client)
        if counts[1] >= rows or loop.time() > give_up:
            return counts


class _Gate:
    """A ``send`` for :meth:`Coalescer.infer` that records each merged request and holds it until opened.

    Opened, the merged request goes to the real server through a client without coalescing.
    """

    def __init__(self, model: Model) -> None:
        self.model = model
        self.sent: list[int] = []  # rows of each merged request, in the order they were sent
        self.timeouts: list[float | None] = []  # the timeout each was sent with
        self._opened: collections.defaultdict[int, asyncio.Event] = collections.defaultdict(asyncio.Event)

    def open(self, *indexes: int) -> None:
        """Let the merged requests of these indexes (0: the first sent) through."""
        for i in indexes:
            self._opened[i].set()

    async def __call__(self, merged: InferRequest, timeout_s: float | None) -> InferResult:
        index = len(self.sent)
        self.sent.append(merged.batch_size or 0)
        self.timeouts.append(timeout_s)
        await self._opened[index].wait()
        return await self.model.infer_request(merged, timeout_s=timeout_s)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
async def test_concurrent_callers_share_requests_and_get_their_own_rows(
    triton_server: LocalTriton, protocol: str
) -> None:
    """64 concurrent callers each get 2x their own input, in fewer server requests than calls, no row lost."""
    async with Client(_url(triton_server, protocol), coalescing=Coalescing(max_in_flight=1)) as client:
        model = await client.model(MODEL)
        before = await _counts(client)
        # Two lengths of the -1 dim: they cannot share a batch, so they travel in separate groups.
        inputs = [np.arange(3 + (i % 2) * 2, dtype=np.float32) + i for i in range(64)]
        results = await asyncio.gather(*(model.infer(INPUT0=x) for x in inputs))
        after = await _counts_reaching(client, before[1] + 64)
    for x, result in zip(inputs, results, strict=True):
        np.testing.assert_array_equal(result["OUTPUT0"], 2 * x[np.newaxis, :])
    requests, rows = after[0] - before[0], after[1] - before[1]
    assert rows == 64
    assert requests < 64


async def test_a_caller_cancelled_while_queued_is_never_sent(triton_server: LocalTriton) -> None:
    """With one request in flight, a queued caller that is cancelled sends nothing; the one behind it is answered."""
    async with Client(triton_server.grpc_url, coalescing=Coalescing(max_in_flight=1)) as client:
        model = await client.model(MODEL)
        before = await _counts(client)
        a = asyncio.create_task(model.infer(INPUT0=[1.0]))
        b = asyncio.create_task(model.infer(INPUT0=[2.0]))
        c = asyncio.create_task(model.infer(INPUT0=[3.0]))
        await asyncio.sleep(0)  # all three queued; a's request is leaving, b and c wait for its slot
        b.cancel()
        ra, rc = await a, await c
        with pytest.raises(asyncio.CancelledError):
            await b
        after = await _counts_reaching(client, before[1] + 2)
    assert ra["OUTPUT0"].tolist() == [[2.0]]
    assert rc["OUTPUT0"].tolist() == [[6.0]]
    assert after[1] - before[1] == 2  # rows of a and c only


async def test_closing_the_client_fails_queued_callers(triton_server: LocalTriton) -> None:
    """Callers still queued when the client closes get ClientClosedError, not a hang."""
    client = Client(triton_server.grpc_url, coalescing=Coalescing(max_in_flight=1))
    model = await client.model(MODEL)
    tasks = [asyncio.create_task(model.infer(INPUT0=[float(i)])) for i in range(5)]
    await asyncio.sleep(0)
    await client.aclose()
    outcomes = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(isinstance(o, ClientClosedError) for o in outcomes)


async def test_requests_with_an_id_are_not_coalesced(triton_server: LocalTriton) -> None:
    """A request given a request_id travels alone and its result carries that id."""
    async with Client(triton_server.grpc_url, coalescing=Coalescing()) as client:
        model = await client.model(MODEL)
        results = await asyncio.gather(*(model.infer(INPUT0=[float(i)], request_id=f"r{i}") for i in range(4)))
    assert [r.request_id for r in results] == ["r0", "r1", "r2", "r3"]
    assert [r["OUTPUT0"].tolist() for r in results] == [[[0.0]], [[2.0]], [[4.0]], [[6.0]]]


def test_merge_and_split_keep_rows_in_order_for_bytes() -> None:
    """Merged BYTES rows travel as one tensor and come back sliced per request, in order."""
    spec = ModelSpec.from_config(
        {
            "name": "m",
            "max_batch_size": 8,
            "input": [{"name": "T", "data_type": "TYPE_STRING", "dims": ["2"]}],
            "output": [{"name": "T", "data_type": "TYPE_STRING", "dims": ["2"]}],
        }
    )
    one = build_request(spec, {"T": ["a", "b\x00"]})
    two = build_request(spec, {"T": [["c", "d"], ["\u00e9", ""]]}, batch=True)
    merged = merge([one, two])
    assert merged.batch_size == 3
    assert merged.inputs[0].shape == (3, 2)
    arr = merged.arrays()["T"]
    parts = split(InferResult(model="m", outputs={"T": arr}), [1, 2])
    assert parts[0]["T"].tolist() == [[b"a", b"b\x00"]]
    assert parts[1]["T"].tolist() == [[b"c", b"d"], ["\u00e9".encode(), b""]]


async def test_a_full_queue_makes_callers_wait_for_room(triton_server: LocalTriton) -> None:
    """With max_queued=2, callers beyond two wait outside the queue: no batch is cut from more than two."""
    async with Client(triton_server.grpc_url) as plain:
        model = await plain.model(MODEL)
        gate = _Gate(model)
        gate.open(0, 1, 2, 3)
        coalescer = Coalescer(Coalescing(max_in_flight=1, max_queued=2))
        calls = [
            coalescer.infer(model.request(INPUT0=[float(i)]), timeout_s=None, max_batch_size=64, send=gate)
            for i in range(7)
        ]
        # The first leaves at once; the next two queue; the last four wait for room, admitted two by two.
        results = await asyncio.gather(*calls)
        await coalescer.aclose()
    assert [r["OUTPUT0"].tolist() for r in results] == [[[2.0 * i]] for i in range(7)]
    assert gate.sent == [1, 2, 2, 2]


@pytest.mark.parametrize("where", ["queued", "waiting_for_room"])
async def test_a_deadline_passing_while_queued_fails_the_caller_and_sends_nothing(
    triton_server: LocalTriton, where: str
) -> None:
    """The timeout counts from the call: queued (or waiting for room) when it passes, nothing is sent.

    The request already out (held by the gate) times out too: the coalescer enforces its callers' deadline
    whatever ``send`` does with its own.
    """
    async with Client(triton_server.grpc_url) as plain:
        model = await plain.model(MODEL)
        gate = _Gate(model)
        # Room for one: 1 queued, 2 and 3 waiting for room. Default room: 1 to 3 queued.
        policy = (
            Coalescing(max_in_flight=1, max_queued=1) if where == "waiting_for_room" else Coalescing(max_in_flight=1)
        )
        coalescer = Coalescer(policy)
        loop = asyncio.get_running_loop()
        started = loop.time()
        tasks = [
            asyncio.create_task(
                coalescer.infer(model.request(INPUT0=[float(i)]), timeout_s=0.5, max_batch_size=64, send=gate)
            )
            for i in range(4)
        ]  # 0 is sent at once and held by the gate
        # 30 s: only a hang-guard for code without deadlines; the timeouts are 0.5 s.
        done, _ = await asyncio.wait(tasks, timeout=30)
        elapsed = loop.time() - started
        assert done == set(tasks)
        errors = [t.exception() for t in tasks]
        gate.open(1)
        # The coalescer goes on after the expired ones: this call's own deadline is not under test, and a real
        # request on a loaded machine may take more than the 0.5 s above (it failed so beside two busy loops).
        after = await coalescer.infer(model.request(INPUT0=[5.0]), timeout_s=30, max_batch_size=64, send=gate)
        await coalescer.aclose()
    assert all(isinstance(e, RequestTimeout) for e in errors), errors
    assert all(e.model == MODEL for e in errors if isinstance(e, RequestTimeout))
    assert elapsed >= 0.45  # asyncio's timers may fire up to a clock tick early
    assert gate.sent == [1, 1]  # the held one, then the one after: none of the expired three
    assert after["OUTPUT0"].tolist() == [[10.0]]


async def test_a_merged_request_runs_under_the_earliest_deadline_of_its_callers(triton_server: LocalTriton) -> None:
    """b and c (same timeout, c called later) leave together; the merged call ends at b's deadline, before c's."""
    timeout = 2.0
    async with Client(triton_server.grpc_url) as plain:
        model = await plain.model(MODEL)
        gate = _Gate(model)
        coalescer = Coalescer(Coalescing(max_in_flight=1))
        loop = asyncio.get_running_loop()

        async def call(x: float) -> tuple[float, float, BaseException | InferResult]:
            start = loop.time()
            try:
                outcome: BaseException | InferResult = await coalescer.infer(
                    model.request(INPUT0=[x]), timeout_s=timeout, max_batch_size=64, send=gate
                )
            except RequestTimeout as err:
                outcome = err
            return start, loop.time(), outcome

        a = asyncio.create_task(call(1.0))
        b = asyncio.create_task(call(2.0))
        await asyncio.sleep(0.5)  # c's deadline is half a second after b's
        c = asyncio.create_task(call(3.0))
        await asyncio.sleep(0)  # c queued next to b
        gate.open(0)  # a is answered; b and c leave together, and the gate holds them
        async with asyncio.timeout(30):  # only a hang-guard for code that lets the gate hold them forever
            (_, _, ra), (b_start, b_end, rb), (_, _, rc) = await asyncio.gather(a, b, c)
        await coalescer.aclose()
    assert isinstance(ra, InferResult)
    assert gate.sent == [1, 2]
    assert isinstance(rb, RequestTimeout)
    assert isinstance(rc, RequestTimeout)
    assert "earliest of their deadlines" in rc.message
    assert b_end - b_start >= timeout - 0.05  # b got its whole timeout (timers fire at most a clock tick early)...
    # ...and the merged call was sent with what remained of b's, which ends at least 0.5 s before c's: b was queued
    # before the 0.5 s sleep, and the merged call left after c was called.
    merged_budget = gate.timeouts[1]
    assert merged_budget is not None
    assert merged_budget <= timeout - 0.45


async def test_each_caller_of_a_failed_merged_request_gets_its_own_exception(triton_server: LocalTriton) -> None:
    """A merged request that fails on the way (a transport error) fails each caller with its own copy of it."""
    async with Client(triton_server.grpc_url) as plain:
        model = await plain.model(MODEL)
        raised: list[ConnectError] = []

        async def send(merged: InferRequest, timeout_s: float | None) -> InferResult:
            raised.append(ConnectError("the connection broke", model=merged.model, status="UNAVAILABLE"))
            raise raised[-1]

        coalescer = Coalescer(Coalescing(max_in_flight=1))
        calls = [
            coalescer.infer(model.request(INPUT0=[float(i)]), timeout_s=None, max_batch_size=64, send=send)
            for i in range(4)
        ]  # 0 leaves alone, 1-3 queue behind it and leave together
        outcomes = await asyncio.gather(*calls, return_exceptions=True)
        await coalescer.aclose()
    assert all(isinstance(e, ConnectError) for e in outcomes), outcomes
    errors = [e for e in outcomes if isinstance(e, ConnectError)]
    assert len({id(e) for e in errors}) == 4  # one object per caller
    assert len(raised) == 2  # one request alone, one merged
    merged = errors[1:]
    original = raised[1]
    for err in merged:
        assert err.__cause__ is original
        assert type(err) is type(original)
        assert (err.message, err.model, err.status) == (original.message, original.model, original.status)
    merged[0].add_note("seen by one caller")
    merged[0].model = "changed by one caller"
    assert not hasattr(merged[1], "__notes__")
    assert merged[1].model == original.model == MODEL
    assert merged[0].__traceback__ is not merged[1].__traceback__


async def test_a_refused_merged_request_is_resent_caller_by_caller(triton_server: LocalTriton) -> None:
    """When the server refuses a merged request, each caller is re-sent alone: only the bad one gets an error."""
    async with Client(triton_server.grpc_url, coalescing=None) as plain:
        model = await plain.model(MODEL)
        sent: list[int] = []

        async def send(request: InferRequest, timeout_s: float | None) -> InferResult:
            # Stands in for a model that refuses a batch holding one bad row (a negative value here).
            sent.append(request.batch_size or 0)
            if (request.inputs[0].array < 0).any():
                raise InvalidArgumentError("negative input", model=request.model)
            return await model.infer_request(request)

        coalescer = Coalescer(Coalescing(max_in_flight=1))
        values = [1.0, 2.0, -3.0, 4.0]
        calls = [
            coalescer.infer(model.request(INPUT0=[v]), timeout_s=None, max_batch_size=64, send=send) for v in values
        ]
        outcomes = await asyncio.gather(*calls, return_exceptions=True)
        await coalescer.aclose()
    assert isinstance(outcomes[2], InvalidArgumentError)
    assert [o["OUTPUT0"].tolist() for i, o in enumerate(outcomes) if i != 2] == [[[2.0]], [[4.0]], [[8.0]]]
    assert sent == [1, 3, 1, 1, 1]  # alone; merged and refused; then each of the three alone


async def test_the_default_client_coalesces_only_dynamic_batching_models(triton_server: LocalTriton) -> None:
    """By default a client merges requests for models with dynamic_batching, and for no other model."""
    async with Client(triton_server.grpc_url) as client:
        dynamic = await client.model(MODEL)
        assert dynamic.spec.dynamic_batching
        coalescer = dynamic.caller.coalescer
        assert coalescer is not None
        request = dynamic.request(INPUT0=[1.0])
        assert coalescer.eligible(request, max_batch_size=64, dynamic_batching=True)
        assert not coalescer.eligible(request, max_batch_size=64, dynamic_batching=False)
        everything = Coalescer(Coalescing(models="batched"))
        assert everything.eligible(request, max_batch_size=64, dynamic_batching=False)
    async with Client(triton_server.grpc_url, coalescing=None) as off:
        assert (await off.model(MODEL)).caller.coalescer is None


async def test_cancelling_aclose_cancels_its_caller_and_the_coalescer_still_closes(triton_server: LocalTriton) -> None:
    """aclose waits for its merged requests to unwind; cancelled meanwhile, it ends cancelled, the coalescer closed."""
    async with Client(triton_server.grpc_url) as plain:
        model = await plain.model(MODEL)
        holding, unwinding, release = asyncio.Event(), asyncio.Event(), asyncio.Event()

        async def send(merged: InferRequest, timeout_s: float | None) -> InferResult:
            result = await model.infer_request(merged)
            try:
                holding.set()
                await asyncio.Event().wait()  # the answer is held back: the request is still out at aclose
            finally:
                unwinding.set()
                await release.wait()  # cancelled, it takes until the test says to unwind
            return result

        coalescer = Coalescer(Coalescing())
        caller = asyncio.create_task(
            coalescer.infer(model.request(INPUT0=[1.0]), timeout_s=None, max_batch_size=64, send=send)
        )
        await holding.wait()
        closer = asyncio.create_task(coalescer.aclose())
        await unwinding.wait()  # aclose cancelled the merged request and waits for it
        closer.cancel()
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await closer
        assert closer.cancelled()
        with pytest.raises(ClientClosedError):
            await caller
        with pytest.raises(ClientClosedError):
            await coalescer.infer(model.request(INPUT0=[2.0]), timeout_s=None, max_batch_size=64, send=send)


async def test_a_merged_request_is_sent_with_the_earliest_members_remaining_budget(triton_server: LocalTriton) -> None:
    """b waits 0.3 s behind a, then leaves with c (called just now): the merged call's timeout is what remains of
    b's 60 s, not c's and not a whole 60 s."""
    timeout = 60.0
    holding = _HoldingTransport(GrpcTransport(f"127.0.0.1:{triton_server.grpc_port}"))
    async with Client(
        triton_server.grpc_url, transport=holding, timeout_s=timeout, coalescing=Coalescing(max_in_flight=1)
    ) as client:
        model = await client.model(MODEL)
        loop = asyncio.get_running_loop()
        a = asyncio.create_task(model.infer(INPUT0=[1.0]))
        await holding.called.wait()  # a is out, held: b queues behind it
        b = asyncio.create_task(model.infer(INPUT0=[2.0]))
        await asyncio.sleep(0)
        b_queued = loop.time()
        await asyncio.sleep(0.3)  # b's budget shrinks while it waits for the slot (what this test is about)
        waited = loop.time() - b_queued
        c = asyncio.create_task(model.infer(INPUT0=[3.0]))
        await asyncio.sleep(0)
        holding.release.set()
        async with asyncio.timeout(30):  # only a hang-guard
            ra, rb, rc = await asyncio.gather(a, b, c)
    assert [r["OUTPUT0"].tolist() for r in (ra, rb, rc)] == [[[2.0]], [[4.0]], [[6.0]]]
    assert holding.rows == [1, 2]  # a alone, then b and c merged
    first, merged = holding.timeouts
    assert first is not None
    assert first <= timeout
    # b was queued at b_queued and sent after `waited` more seconds: at most timeout - waited remained of its budget.
    assert merged is not None
    assert merged <= timeout - waited


class _HoldingTransport:
    """The real transport; every inference call records its rows and timeout, then waits for :attr:`release`."""

    def __init__(self, inner: Transport) -> None:
        self.inner = inner
        self.rows: list[int] = []
        self.timeouts: list[float | None] = []
        self.called = asyncio.Event()
        self.release = asyncio.Event()

    def call(self, call: Call) -> Any:
        self.rows.append(call.request.batch_size or 0)
        self.timeouts.append(call.timeout_s)
        self.called.set()
        return _Held(self.inner.call(call), self.release)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class _Held:
    def __init__(self, responses: Any, release: asyncio.Event) -> None:
        self._responses = responses
        self._release = release

    async def single(self) -> InferResult:
        await self._release.wait()
        result: InferResult = await self._responses.single()
        return result


def test_one_default_for_coalescing() -> None:
    """Coalescing() is what a client uses when told nothing: dynamic_batching models only, as documented."""
    assert Coalescing().models == "dynamic_batching"
    assert Coalescing() == DEFAULT_COALESCING
    assert inspect.signature(Client).parameters["coalescing"].default == Coalescing()
    from triton_npu_client import ClientConfig

    assert ClientConfig(urls="grpc://127.0.0.1:1").coalescing == Coalescing()
