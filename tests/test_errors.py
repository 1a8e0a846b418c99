"""Error mapping: pure classification by status code, plus the text-based stream classifier."""

from __future__ import annotations

import grpc
import pytest
from tritonclient.utils import InferenceServerException

from triton_npu_client import (
    ConnectError,
    InternalServerError,
    InvalidArgumentError,
    ModelNotFoundError,
    PermissionDeniedError,
    RequestTimeout,
    SequenceError,
    SequenceLost,
    ServerUnavailable,
)
from triton_npu_client._errors._classify import map_error, map_stream_error, sequence_error


@pytest.mark.parametrize(
    ("status", "cls"),
    [
        ("StatusCode.NOT_FOUND", ModelNotFoundError),
        ("StatusCode.UNAVAILABLE", ServerUnavailable),
        ("StatusCode.RESOURCE_EXHAUSTED", ServerUnavailable),
        ("StatusCode.INVALID_ARGUMENT", InvalidArgumentError),
        ("StatusCode.DEADLINE_EXCEEDED", RequestTimeout),
        ("StatusCode.UNAUTHENTICATED", PermissionDeniedError),
        ("StatusCode.PERMISSION_DENIED", PermissionDeniedError),
        ("StatusCode.INTERNAL", InternalServerError),
        ("StatusCode.UNKNOWN", InternalServerError),
        ("400", InvalidArgumentError),
        ("401", PermissionDeniedError),
        ("403", PermissionDeniedError),
        ("404", ModelNotFoundError),
        ("500", InternalServerError),
        ("503", ServerUnavailable),
    ],
)
def test_tritonclient_status_codes(status: str, cls: type[Exception]) -> None:
    """InferenceServerException maps by its status code alone, keeping model and status as attributes."""
    # The message deliberately says something misleading: classification must ignore it.
    err = map_error(InferenceServerException("model is not found; deadline", status=status), model="m", version="2")
    assert type(err) is cls
    assert err.model == "m"
    assert err.version == "2"
    assert err.status == status.removeprefix("StatusCode.")


def test_timeouts_and_connect_errors() -> None:
    """asyncio timeouts become RequestTimeout (a TimeoutError); refused connections ConnectError."""
    err = map_error(TimeoutError(), model="m", request_id="r1")
    assert isinstance(err, RequestTimeout)
    assert isinstance(err, TimeoutError)
    assert err.request_id == "r1"
    assert isinstance(map_error(ConnectionRefusedError()), ConnectError)


def test_grpc_rpc_error_by_code() -> None:
    """A raw grpc.RpcError maps by its code()."""

    class _Rpc(grpc.RpcError):
        def code(self) -> grpc.StatusCode:
            return grpc.StatusCode.RESOURCE_EXHAUSTED

        def details(self) -> str:
            return "busy"

    err = map_error(_Rpc())
    assert isinstance(err, ServerUnavailable)
    assert err.status == "RESOURCE_EXHAUSTED"


@pytest.mark.parametrize(
    ("message", "seq", "cls"),
    [
        (
            "inference request for sequence 7 to model 'm' must specify the START flag on the first request",
            7,
            SequenceLost,
        ),
        ("Failed to process the request(s) for model 'm', message: Stub process is not healthy.", "abc", SequenceLost),
        ("inference request to model 'm' must specify a non-zero or non-empty correlation ID", 0, SequenceError),
        ("unexpected shape for input 'INPUT0' for model 'm'", 5, InvalidArgumentError),
        ("Stub process is not healthy.", None, InternalServerError),
        ("something else", 5, InternalServerError),
    ],
)
def test_stream_errors_by_text(message: str, seq: int | str | None, cls: type[Exception]) -> None:
    """Stream error strings classify by Triton's own phrases; SequenceLost carries id and steps."""
    err = map_stream_error(message, model="m", request_id="r", sequence_id=seq, steps_acknowledged=3)
    assert type(err) is cls
    assert err.model == "m"
    if isinstance(err, SequenceLost):
        assert err.sequence_id == seq
        assert err.steps_acknowledged == 3


def test_sequence_error_upgrades_server_loss_but_not_timeouts() -> None:
    """A non-START step's INVALID_ARGUMENT / NOT_FOUND / UNAVAILABLE becomes SequenceLost; a timeout stays."""
    for status in ("StatusCode.INVALID_ARGUMENT", "StatusCode.NOT_FOUND", "StatusCode.UNAVAILABLE"):
        base = map_error(InferenceServerException("x", status=status), model="m")
        up = sequence_error(base, sequence_id=9, steps_acknowledged=4)
        assert isinstance(up, SequenceLost)
        assert (up.sequence_id, up.steps_acknowledged, up.model) == (9, 4, "m")
        assert up.__cause__ is base
    timeout = map_error(TimeoutError())
    assert sequence_error(timeout, sequence_id=9, steps_acknowledged=4) is timeout
