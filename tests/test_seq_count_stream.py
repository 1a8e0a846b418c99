"""seq_count_stream through a real Triton: multi-response sequence steps, per-call cancellation, busy refusal.

Plain gRPC (tritonclient's protobufs on a grpc.aio channel), one ModelStreamInfer call per step, the
way a client that cancels one step alone must send it: cancelling that call cancels that request on
the server. Each request asks for the empty final response, so the end of a step is always visible.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from triton_npu_client import LocalTriton
from triton_npu_client.server import SEQUENCE_BUSY

MODEL = "seq_count_stream"
DEADLINE_S = 60.0  # a bound on waiting for an event, never a synchronisation delay
_ids = itertools.count(7_300_000_001)


@dataclass
class Piece:
    """One streamed response: its outputs (None on an empty final response), or its error."""

    value: int | None = None
    cancelled: int | None = None
    live: int | None = None
    final: bool = False
    error: str = ""


@dataclass
class StepResult:
    pieces: list[Piece] = field(default_factory=list)

    @property
    def values(self) -> list[int]:
        return [p.value for p in self.pieces if p.value is not None]

    @property
    def errors(self) -> list[str]:
        return [p.error for p in self.pieces if p.error]

    @property
    def ended_with_final(self) -> bool:
        return bool(self.pieces) and self.pieces[-1].final and all(not p.final for p in self.pieces[:-1])


def step_request(
    seq: int, n: int, *, start: bool = False, end: bool = False, delay_ms: int | None = None
) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name=MODEL)
    inputs = [("N", n)] + ([] if delay_ms is None else [("DELAY_MS", delay_ms)])
    for name, value in inputs:
        tensor = request.inputs.add()
        tensor.name = name
        tensor.datatype = "INT32"
        tensor.shape.extend([1, 1])
        request.raw_input_contents.append(np.array([[value]], dtype=np.int32).tobytes())
    request.parameters["sequence_id"].int64_param = seq
    request.parameters["sequence_start"].bool_param = start
    request.parameters["sequence_end"].bool_param = end
    request.parameters["triton_enable_empty_final_response"].bool_param = True
    return request


def parse(message: Any) -> Piece:
    if message.error_message:
        return Piece(error=message.error_message, final=True)
    response = message.infer_response
    piece = Piece(final=response.parameters["triton_final_response"].bool_param)
    for output, raw in zip(response.outputs, response.raw_output_contents, strict=True):
        assert output.datatype == "INT64"
        assert list(output.shape) == [1, 1]
        setattr(piece, output.name.lower(), int(np.frombuffer(raw, dtype=np.int64)[0]))
    return piece


def open_step(stub: Any, request: service_pb2.ModelInferRequest) -> Any:
    """One ModelStreamInfer call carrying one step; the client half-closes, the server streams to the end."""
    return stub.ModelStreamInfer(iter([request]))


async def read_piece(call: Any) -> Piece:
    message = await call.read()
    assert message is not grpc.aio.EOF, "the step's call ended before its final response"
    return parse(message)


async def run_step(stub: Any, request: service_pb2.ModelInferRequest) -> StepResult:
    """Every response of one step, until the server ends the call."""
    result = StepResult()
    async for message in open_step(stub, request):
        result.pieces.append(parse(message))
    return result


async def counter_value(stub: Any, seq: int, *, end: bool = False) -> int:
    """The sequence's counter after one more increment: a one-response step on a running sequence."""
    result = await run_step(stub, step_request(seq, 1, end=end))
    assert result.errors == []
    assert result.ended_with_final
    assert len(result.values) == 1
    return result.values[0]


async def cancelled_count(stub: Any) -> int:
    """The instance's CANCELLED counter, read by a fresh one-step sequence (START and END together)."""
    result = await run_step(stub, step_request(next(_ids), 1, start=True, end=True))
    assert result.errors == []
    cancelled = result.pieces[0].cancelled
    assert cancelled is not None
    return cancelled


async def wait_for_cancelled(stub: Any, expected: int) -> float:
    """Poll CANCELLED until it reads ``expected``; returns when (monotonic) it did."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        seen = await cancelled_count(stub)
        if seen == expected:
            return time.monotonic()
        assert seen < expected, f"CANCELLED jumped to {seen}, expected {expected}"
        assert time.monotonic() < deadline, f"CANCELLED still {seen} after {DEADLINE_S} s, expected {expected}"
        await asyncio.sleep(0.01)  # pace the polling only; the loop exits on the observed value


@pytest.fixture
async def stub(triton_server: LocalTriton) -> AsyncIterator[Any]:
    channel = grpc.aio.insecure_channel(triton_server.grpc_url.removeprefix("grpc://"))
    try:
        yield service_pb2_grpc.GRPCInferenceServiceStub(channel)
    finally:
        await channel.close()


async def test_steps_stream_n_responses_keep_the_counter_and_end_frees_the_sequence(stub: Any) -> None:
    """N=5 streams VALUE 1..5 then FINAL; N=3 continues 6..8; N=0 sends FINAL alone; END frees the sequence."""
    seq = next(_ids)
    first = await run_step(stub, step_request(seq, 5, start=True))
    assert first.errors == []
    assert first.values == [1, 2, 3, 4, 5]
    assert first.ended_with_final
    live = first.pieces[0].live
    assert live is not None
    assert live >= 1
    assert {p.live for p in first.pieces if p.value is not None} == {live}

    second = await run_step(stub, step_request(seq, 3, delay_ms=1))
    assert second.values == [6, 7, 8]
    assert second.ended_with_final

    empty = await run_step(stub, step_request(seq, 0))
    assert empty.values == []
    assert len(empty.pieces) == 1
    assert empty.ended_with_final  # the empty final response: nothing else

    last = await run_step(stub, step_request(seq, 2, end=True))
    assert last.values == [9, 10]
    assert last.ended_with_final
    # Held while its END step streams, freed with its last response.
    assert [p.live for p in last.pieces] == [live, live - 1]

    after = await run_step(stub, step_request(seq, 1))
    assert after.values == []
    assert len(after.errors) == 1
    assert "START" in after.errors[0]  # the sequence is gone: a step needs START again

    restarted = await run_step(stub, step_request(seq, 2, start=True, end=True))
    assert restarted.values == [1, 2]  # START resets the counter


async def test_cancelling_a_steps_call_stops_its_work_on_the_server_and_spares_other_sequences(stub: Any) -> None:
    """Cancel one step's call after a few responses: CANCELLED rises by one, the counter stops, others finish.

    The proof comes from the server: its CANCELLED counter, a later step of the same sequence being
    accepted (a step still streaming would make it "busy") and reading the counter barely past what the
    client read, then exactly +1 per later step: nothing advances it in the background any more.
    """
    before = await cancelled_count(stub)
    seq, other_seq = next(_ids), next(_ids)
    t0 = time.monotonic()
    call = open_step(stub, step_request(seq, 10_000, start=True, delay_ms=10))
    read = [await read_piece(call) for _ in range(5)]
    assert [p.value for p in read] == [1, 2, 3, 4, 5]
    assert not any(p.final for p in read)

    # Started after the cancelled step had streamed, on its own call, paced the same: it is mid-stream
    # when the other call is cancelled, and must complete untouched.
    other_pieces: list[Piece] = []
    other_started = asyncio.Event()

    async def other() -> None:
        async for message in open_step(stub, step_request(other_seq, 100, start=True, delay_ms=10)):
            other_pieces.append(parse(message))
            other_started.set()

    other_task = asyncio.create_task(other())
    await asyncio.wait_for(other_started.wait(), DEADLINE_S)
    call.cancel()
    # The server says the other step still streams after the cancellation was sent: a step of its sequence
    # sent now is refused as busy (and, refused, never touches its counter).
    probe = await run_step(stub, step_request(other_seq, 1))
    assert probe.values == []
    assert len(probe.errors) == 1
    assert f"sequence {other_seq} is busy" in probe.errors[0]

    observed = await wait_for_cancelled(stub, before + 1)
    # The cancelled step has stopped: the same sequence takes a step again (not refused as busy), and
    # its counter moved only by what the server sent before it saw the cancellation.
    stopped_at = await counter_value(stub, seq) - 1
    assert stopped_at >= read[-1].value  # type: ignore[operator]
    # At most one response per 10 ms since the step began: the counter is consistent with a stream
    # that stopped before `observed`, i.e. far below the 10000 asked for.
    assert stopped_at <= (observed - t0) / 0.010 + 1
    assert stopped_at < 10_000
    assert await counter_value(stub, seq, end=True) == stopped_at + 2  # nothing else moves it now

    await asyncio.wait_for(other_task, DEADLINE_S)
    assert [p.value for p in other_pieces if p.value is not None] == list(range(1, 101))
    assert StepResult(other_pieces).ended_with_final
    assert all(p.error == "" for p in other_pieces)
    closing = await run_step(stub, step_request(other_seq, 0, end=True))
    assert closing.errors == []
    assert await cancelled_count(stub) == before + 1  # the other step was not counted as cancelled


async def test_a_second_concurrent_step_of_a_sequence_is_refused_while_the_first_streams(stub: Any) -> None:
    """A step sent while the sequence's previous step streams gets a "busy" error; the first goes on unharmed."""
    before = await cancelled_count(stub)
    seq = next(_ids)
    first = open_step(stub, step_request(seq, 10_000, start=True, delay_ms=10))
    pieces = [await read_piece(first)]

    refused = await run_step(stub, step_request(seq, 5))
    assert refused.values == []
    assert len(refused.errors) == 1
    assert SEQUENCE_BUSY in refused.errors[0]
    assert f"sequence {seq} is busy" in refused.errors[0]

    # The first step keeps streaming, uninterleaved: the refused step never touched the counter.
    pieces += [await read_piece(first) for _ in range(3)]
    assert [p.value for p in pieces] == [1, 2, 3, 4]
    assert not any(p.final or p.error for p in pieces)

    first.cancel()
    await wait_for_cancelled(stub, before + 1)
    # Free again once the first step stopped; END with N=0 closes the sequence.
    closing = await run_step(stub, step_request(seq, 0, end=True))
    assert closing.errors == []
    assert closing.ended_with_final


async def test_a_step_streaming_past_the_idle_timeout_keeps_its_state_from_the_sweep(stub: Any) -> None:
    """A sequence streaming one step for longer than idle timeout + grace (3.5 s) is not swept by a later START.

    The model sweeps sequences by their last request; one still streaming must keep its slot, else the
    next START would take that slot and the two counters would mix.
    """
    before = await cancelled_count(stub)
    long_seq = next(_ids)
    call = open_step(stub, step_request(long_seq, 1_000, start=True, delay_ms=10))
    pieces = [await read_piece(call)]
    # At most one response per 10 ms: VALUE 352 comes at least 3.51 s after the step was admitted.
    while pieces[-1].value is not None and pieces[-1].value < 352:
        pieces.append(await read_piece(call))

    fresh = await run_step(stub, step_request(next(_ids), 3, start=True, end=True))
    assert fresh.values == [1, 2, 3]
    pieces += [await read_piece(call) for _ in range(3)]
    call.cancel()
    assert [p.value for p in pieces] == list(range(1, len(pieces) + 1))
    await wait_for_cancelled(stub, before + 1)
