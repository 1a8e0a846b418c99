"""Sequence sessions against the real server's stateful models (running mean / variance per sequence)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from triton_npu_client import (
    Call,
    LocalTriton,
    ModelNotFoundError,
    SequenceClosedError,
    SequenceSession,
    SequenceUsageError,
)
from triton_npu_client._client import Client, Model
from triton_npu_client._sessions._sequence import MAX_INT_ID, new_sequence_id, open_sequence, validate_sequence_id

# (client protocol, stream): the three ways a step can travel.
WAYS = [("grpc", True), ("grpc", False), ("http", False)]
WAY_IDS = ["stream", "unary-grpc", "http"]


@pytest.fixture
async def grpc_client(triton_server: LocalTriton) -> AsyncIterator[Client]:
    async with Client(triton_server.grpc_url) as client:
        yield client


async def client_for(server: LocalTriton, protocol: str) -> Client:
    return Client(server.grpc_url if protocol == "grpc" else server.http_url)


async def model_on(server: LocalTriton, client: Client, name: str) -> Model:
    """``client.model(name)`` (the spec is read over the client's own protocol)."""
    return await client.model(name)


async def live_sequences(model: Model) -> int:
    """The model's live-sequence count, read with a one-request sequence (START and END together)."""
    async with open_sequence(model) as probe:
        result = await probe.end(X=np.zeros(4, np.float32))
    return int(result["LIVE"][0, 0])


def expected_stats(xs: list[np.ndarray[Any, Any]]) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    stacked = np.stack(xs).astype(np.float64)
    return stacked.mean(axis=0), stacked.var(axis=0)


async def test_generated_ids_are_nonzero_63_bit_ints_or_uuid_strings() -> None:
    """new_sequence_id never gives 0 / "" and stays within int64; string ids are distinct UUIDs."""
    ints = {new_sequence_id(string=False) for _ in range(1000)}
    assert all(isinstance(i, int) and 0 < i <= MAX_INT_ID for i in ints)
    assert len(ints) == 1000
    strs = {new_sequence_id(string=True) for _ in range(100)}
    assert all(isinstance(s, str) and 0 < len(s) <= 128 for s in strs)
    assert len(strs) == 100


@pytest.mark.parametrize("bad", [0, -1, 2**63, True, "", "x" * 129, 1.5])
async def test_invalid_caller_ids_are_refused_before_any_call(grpc_client: Client, bad: object) -> None:
    """0, negative, >= 2**63, bool, "", over-long and non-int/str ids raise SequenceUsageError (a ValueError)."""
    model = await grpc_client.model("seq_stats_oldest")
    with pytest.raises(SequenceUsageError) as info:
        validate_sequence_id(bad, model.spec)
    assert isinstance(info.value, ValueError)


async def test_a_stateless_model_has_no_sequences(grpc_client: Client) -> None:
    """Opening a session on a model without sequence_batching is a usage error."""
    model = await grpc_client.model("scale_fp32")
    with pytest.raises(SequenceUsageError, match="not stateful"):
        open_sequence(model)


async def test_stream_needs_grpc(triton_server: LocalTriton) -> None:
    """stream=True over an HTTP client is refused."""
    async with Client(triton_server.http_url) as client:
        model = await model_on(triton_server, client, "seq_stats_oldest")
        with pytest.raises(SequenceUsageError, match="gRPC"):
            open_sequence(model, stream=True)


async def test_decoupled_model_goes_over_the_stream(triton_server: LocalTriton) -> None:
    """A decoupled stateful model: the default path is the stream; unary or HTTP is refused before any call."""
    async with Client(triton_server.grpc_url) as client:
        model = await client.model("seq_stats_stream")
        with pytest.raises(SequenceUsageError, match="decoupled"):
            open_sequence(model, stream=False)
        async with open_sequence(model) as seq:
            first = await seq.infer(X=np.array([1, 2, 3, 4], np.float32))
            second = await seq.end(X=np.array([3, 4, 5, 6], np.float32))
        assert seq.via == "stream"
        assert int(first["COUNT"][0, 0]) == 1
        np.testing.assert_allclose(second["MEAN"][0], [2, 3, 4, 5])
    async with Client(triton_server.http_url) as client:
        model = await client.model("seq_stats_stream")
        with pytest.raises(SequenceUsageError, match="gRPC"):
            open_sequence(model)


@pytest.mark.parametrize(("protocol", "stream"), WAYS, ids=WAY_IDS)
async def test_steps_build_state_and_end_frees_it(
    triton_server: LocalTriton, protocol: str, stream: bool, seed: Callable[[int], int]
) -> None:
    """Each step answers the running mean/variance of the session's own inputs; after end() the step is refused."""
    rng = np.random.default_rng(seed(7))
    async with await client_for(triton_server, protocol) as client:
        model = await model_on(triton_server, client, "seq_stats_oldest")
        xs = [rng.standard_normal(4).astype(np.float32) for _ in range(5)]
        async with open_sequence(model, stream=stream) as seq:
            for i, x in enumerate(xs[:-1]):
                result = await seq.infer(X=x)
                mean, var = expected_stats(xs[: i + 1])
                np.testing.assert_allclose(result["MEAN"][0], mean, rtol=1e-5, atol=1e-6)
                np.testing.assert_allclose(result["VAR"][0], var, rtol=1e-4, atol=1e-6)
                assert int(result["COUNT"][0, 0]) == i + 1
            last = await seq.end(X=xs[-1])
            assert int(last["COUNT"][0, 0]) == len(xs)
            assert seq.steps_acknowledged == len(xs)
            with pytest.raises(SequenceClosedError):
                await seq.infer(X=xs[0])


@pytest.mark.parametrize(("protocol", "stream"), WAYS, ids=WAY_IDS)
async def test_concurrent_calls_on_one_session_run_in_call_order(
    triton_server: LocalTriton, protocol: str, stream: bool
) -> None:
    """Twenty steps started at once on one session are applied one by one, in the order they were called."""
    async with await client_for(triton_server, protocol) as client:
        model = await model_on(triton_server, client, "seq_stats_oldest")
        xs = [np.full(4, float(i), np.float32) for i in range(20)]
        async with open_sequence(model, stream=stream) as seq:
            results = await asyncio.gather(*(seq.infer(X=x) for x in xs))
        for i, result in enumerate(results):
            assert int(result["COUNT"][0, 0]) == i + 1
            np.testing.assert_allclose(result["MEAN"][0], np.full(4, i / 2), rtol=1e-6)


@pytest.mark.parametrize(("protocol", "stream"), WAYS, ids=WAY_IDS)
async def test_leaving_the_block_sends_end(triton_server: LocalTriton, protocol: str, stream: bool) -> None:
    """Without end(), leaving the block (normally or by an exception) ends the sequence on the server."""
    async with await client_for(triton_server, protocol) as client:
        model = await model_on(triton_server, client, "seq_stats_oldest")
        before = await live_sequences(model)
        async with open_sequence(model, stream=stream) as seq:
            await seq.infer(X=np.ones(4, np.float32))
            assert await live_sequences(model) == before + 1
        assert await live_sequences(model) == before

        async def fail_inside() -> None:
            async with open_sequence(model, stream=stream) as seq:
                await seq.infer(X=np.ones(4, np.float32))
                raise KeyError("boom")

        with pytest.raises(KeyError):
            await fail_inside()
        assert await live_sequences(model) == before
        with pytest.raises(SequenceClosedError):
            await seq.infer(X=np.ones(4, np.float32))  # the first session, ended on exit


async def test_string_ids_on_the_string_model(grpc_client: Client) -> None:
    """A caller-given UUID string id works on the string-id model, over the stream and unary."""
    model = await grpc_client.model("seq_stats_string")
    for stream in (True, False):
        sid = str(new_sequence_id(string=True))
        async with open_sequence(model, sequence_id=sid, stream=stream) as seq:
            assert seq.sequence_id == sid
            await seq.infer(X=np.ones(4, np.float32))
            result = await seq.end(X=np.full(4, 3.0, np.float32))
        np.testing.assert_allclose(result["MEAN"][0], np.full(4, 2.0))
        assert int(result["COUNT"][0, 0]) == 2


async def test_direct_strategy_model(grpc_client: Client) -> None:
    """The direct-strategy model keeps each session's state apart under concurrency (dummy slots untouched)."""
    model = await grpc_client.model("seq_stats_direct")

    async def one(k: int) -> list[int]:
        async with open_sequence(model) as seq:
            counts = []
            for _ in range(k % 4 + 2):
                counts.append(int((await seq.infer(X=np.full(4, float(k), np.float32)))["COUNT"][0, 0]))
            return counts

    got = await asyncio.gather(*(one(k) for k in range(24)))
    assert got == [list(range(1, k % 4 + 3)) for k in range(24)]


def test_example_concurrent_sessions_runs() -> None:
    """examples/concurrent_sessions.py starts its own server and reports every session correct, none left live."""
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run(
        [sys.executable, str(root / "examples" / "concurrent_sessions.py"), "--sessions", "100", "--steps", "5"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    assert "100/100 sessions got exactly their own results" in proc.stdout
    assert "live after: 0" in proc.stdout


class RecordingTransport:
    """The real transport, recording what each inference call carried (a seam: every call reaches the server)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls: list[tuple[tuple[str, ...], bool]] = []

    def call(self, call: Call) -> Any:
        self.calls.append((tuple(i.name for i in call.request.inputs), call.sequence_end))
        return self.inner.call(call)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.mark.parametrize(("protocol", "stream"), WAYS, ids=WAY_IDS)
async def test_closing_sends_end_without_recomputing_the_last_step(
    triton_server: LocalTriton, protocol: str, stream: bool
) -> None:
    """Leaving the block sends END with no inputs (the toolkit frees the state without a step), on every path."""
    async with await client_for(triton_server, protocol) as plain:
        recording = RecordingTransport(plain.transport)
        client = Client(plain.config.url, transport=recording)  # type: ignore[arg-type]
        model = await client.model("seq_stats_oldest")
        before = await live_sequences(model)
        async with open_sequence(model, stream=stream) as seq:
            await seq.infer(X=np.ones(4, np.float32))
            await seq.infer(X=np.full(4, 3.0, np.float32))
            recording.calls.clear()
        assert recording.calls == [((), True)]  # one closing request: END, no inputs
        assert await live_sequences(model) == before


async def test_a_step_queued_for_a_connection_past_the_idle_timeout_is_warned_when_it_leaves(
    triton_server: LocalTriton,
) -> None:
    """HTTP with one connection: a step that waits behind a slow request warns when it leaves, then is lost."""
    from triton_npu_client import SequenceIdleWarning, SequenceLost

    async with Client(triton_server.http_url, http_connections=1, timeout_s=60) as client:
        model = await client.model("seq_stats_oldest")
        slow = await client.model("slow_echo")
        idle_s = model.spec.sequence.idle_timeout_us / 1e6 if model.spec.sequence else 0.0
        async with open_sequence(model) as seq:
            await seq.infer(X=np.ones(4, np.float32))
            holding = asyncio.Event()
            request = slow.request(INPUT0=np.ones(1, np.float32), DELAY_S=np.array([idle_s + 2.0], np.float32))
            hog = asyncio.create_task(
                client.transport.call(Call(request=request, timeout_s=60, on_send=holding.set)).single()
            )
            await holding.wait()  # the only connection is taken from here on
            with pytest.warns(SequenceIdleWarning, match="leaves"), pytest.raises(SequenceLost):
                await seq.infer(X=np.ones(4, np.float32))
            await hog


async def test_client_sequence_is_the_session_model_sequence_gives(grpc_client: Client) -> None:
    """client.sequence(name) is a SequenceSession, as model.sequence() is, made without I/O: the model is reached
    when the session is entered or sends its first step, and the session is used the same way either way."""
    unknown = grpc_client.sequence("no_such_model")  # nothing sent yet: no error here
    assert isinstance(unknown, SequenceSession)
    assert unknown.model == "no_such_model"
    with pytest.raises(SequenceUsageError, match="enter it"):
        unknown.sequence_id  # noqa: B018
    with pytest.raises(ModelNotFoundError):
        await unknown.infer(X=np.zeros(4, np.float32))
    with pytest.raises(ModelNotFoundError):
        async with grpc_client.sequence("no_such_model"):
            pass
    with pytest.raises(TypeError, match="no_such_option"):
        grpc_client.sequence("seq_stats_oldest", no_such_option=1)  # type: ignore[call-arg]

    model = await model_on(grpc_client, grpc_client, "seq_stats_oldest")
    live = await live_sequences(model)
    x = np.array([1, 2, 3, 4], np.float32)
    for seq in (grpc_client.sequence("seq_stats_oldest"), model.sequence()):
        assert isinstance(seq, SequenceSession)
        await seq.infer(X=x)  # used without entering it: the first step reaches the model
        assert (await seq.infer(X=x))["COUNT"].tolist() == [[2]]
        assert isinstance(seq.sequence_id, int)
        assert seq.spec.name == "seq_stats_oldest"
        assert await live_sequences(model) == live + 1
        await seq.aclose()  # END: the server frees it
        assert await live_sequences(model) == live
        with pytest.raises(SequenceClosedError):
            await seq.infer(X=x)
    for seq in (grpc_client.sequence("seq_stats_oldest"), model.sequence()):
        async with seq as entered:
            assert entered is seq
            assert isinstance(seq.sequence_id, int)  # known once entered
            assert (await seq.end(X=x))["COUNT"].tolist() == [[1]]
    closed = grpc_client.sequence("seq_stats_oldest")
    await closed.aclose()  # closed before it reached the model: nothing to end, and no step afterwards
    with pytest.raises(SequenceClosedError, match="closed before its first step"):
        await closed.infer(X=x)
    assert await live_sequences(model) == live
