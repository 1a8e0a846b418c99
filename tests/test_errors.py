"""Error mapping: pure classification by status code, plus the stream classifier (Triton's few phrases and the
toolkit's markers, never other words)."""

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
    SequenceBusyError,
    SequenceCapacityError,
    SequenceError,
    SequenceLost,
    ServerUnavailable,
    TritonError,
)
from triton_npu_client._errors._classify import SIGNALS, judge_step, map_error, map_stream_error
from triton_npu_client._protocol import INVALID_INPUT, MARKERS


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


UNKNOWN = "[triton-npu:sequence-unknown] sequence 7 is not held by this instance"
CAPACITY = "[triton-npu:capacity] model m holds 4096 live sequences"
BUSY = "[triton-npu:sequence-busy] sequence 9 is busy: its previous step is still streaming"
INVALID = "[triton-npu:invalid-input] temperature must be finite, got nan"


@pytest.mark.parametrize(
    ("message", "cls"),
    [
        ("inference request for sequence 7 to model 'm' must specify the START flag on the first", SequenceLost),
        ("Failed to process the request(s) for model 'm', message: Stub process is not healthy.", InternalServerError),
        ("inference request to model 'm' must specify a non-zero or non-empty correlation ID", SequenceError),
        # Triton's own refusal of an input: over the stream it has no status, and no marker, so no class of its own.
        ("[request id: 3] unexpected shape for input 'INPUT0' for model 'm'", InternalServerError),
        (UNKNOWN, SequenceError),
        (CAPACITY, SequenceCapacityError),
        (BUSY, SequenceBusyError),
        (INVALID, InvalidArgumentError),
        ("Request for unknown model: 'm' is not found", ModelNotFoundError),
        ("Request for unknown model: 'm' has no available versions", ModelNotFoundError),
        ("something else", InternalServerError),
    ],
)
def test_stream_errors_by_text(message: str, cls: type[Exception]) -> None:
    """Stream error strings (no status code) classify by Triton's phrases and the toolkit's markers."""
    err = map_stream_error(message, model="m", request_id="r", sequence_id=5)
    assert type(err) is cls
    assert (err.model, err.sequence_id) == ("m", 5)


@pytest.mark.parametrize(
    "message",
    [
        "Failed to process the request(s) for model 'm', message: ValueError: the input shape is wrong",
        "Failed to process the request(s) for model 'm', message: bad data-type, datatype or byte size",
        "Failed to process the request(s) for model 'm', message: batch size 3 is not allowed",
        "Failed to process the request(s) for model 'm', message: FileNotFoundError: vocab.json is not found",
        "Failed to process the request(s) for model 'm', message: the model has no available versions of its weights",
    ],
)
def test_words_never_decide_a_class(message: str) -> None:
    """A model's own text ("input", "shape", "is not found", ...) never classifies it: only status codes, the
    toolkit's markers and Triton's few documented phrases do. Without a status (the stream) such an error is
    InternalServerError, on unary gRPC and HTTP the status decides; and the step is not lost."""
    assert type(map_stream_error(message, model="m")) is InternalServerError
    assert type(map_error(InferenceServerException(message, status="StatusCode.INTERNAL"), model="m")) is (
        InternalServerError
    )
    assert type(map_error(InferenceServerException(message, status="400"), model="m")) is InvalidArgumentError
    verdict = judge_step(map_stream_error(message, model="m"), sequence_id=9, start=False, acknowledged=3)
    assert (verdict.lost, verdict.send_end) == (False, True)


def test_every_marker_is_a_signal() -> None:
    """Every marker the toolkit defines is read by the classifier (a new marker must be placed on purpose)."""
    assert set(MARKERS) <= set(SIGNALS)


def _over(path: str, message: str, status: str) -> TritonError:
    """The error one failure gives over each path: the stream (text only), unary gRPC and HTTP (text + status)."""
    if path == "stream":
        return map_stream_error(message, model="m", sequence_id=9)
    return map_error(InferenceServerException(message, status=status), model="m", sequence_id=9)


PATHS = [("stream", ""), ("grpc", "StatusCode.INVALID_ARGUMENT"), ("http", "400")]


@pytest.mark.parametrize(("path", "status"), PATHS)
@pytest.mark.parametrize(
    ("message", "lost", "send_end"),
    [
        ("inference request for sequence 9 to model 'm' must specify the START flag on the first request", True, False),
        (UNKNOWN, True, True),
        ("Failed to process the request(s) for model 'm', message: Stub process is not healthy.", True, False),
        ("Failed to process the request(s) for model 'm', message: ZeroDivisionError: division by zero", False, True),
        ("unexpected shape for input 'X' for model 'm'", False, True),
        (INVALID, False, True),
    ],
)
def test_step_judged_the_same_on_every_path(path: str, status: str, message: str, lost: bool, send_end: bool) -> None:
    """One judge: the same failure of step 2+ means the same over the stream, unary gRPC and HTTP."""
    if "Stub" in message or "ZeroDivision" in message:
        status = {"grpc": "StatusCode.INTERNAL", "http": "500"}.get(path, status)
    verdict = judge_step(_over(path, message, status), sequence_id=9, start=False, acknowledged=4)
    assert (verdict.lost, verdict.send_end) == (lost, send_end)
    assert isinstance(verdict.error, SequenceLost) == lost
    if lost:
        assert isinstance(verdict.error, SequenceLost)
        assert (verdict.error.sequence_id, verdict.error.steps_acknowledged) == (9, 4)


@pytest.mark.parametrize(("path", "status"), PATHS)
def test_a_missing_start_is_a_lost_sequence_by_type_on_every_path(path: str, status: str) -> None:
    """Triton's refusal of a step for a sequence it holds no slot for is SequenceLost as classified, before any
    judge: what the fleet unpins a sequence by (never by its words); the message says what it means."""
    message = "inference request for sequence 9 to model 'm' must specify the START flag on the first request"
    err = _over(path, message, status)
    assert type(err) is SequenceLost
    assert err.sequence_id == 9
    assert "start a new one" in err.message
    assert type(_over(path, "sequence 9 is over: must specify START", status)) is not SequenceLost  # other words


def test_model_exception_is_not_a_loss() -> None:
    """An INTERNAL from a model exception on step 2+ is that step's error: not lost, END still sent."""
    err = map_error(InferenceServerException("model raised: boom", status="StatusCode.INTERNAL"), model="m")
    verdict = judge_step(err, sequence_id=3, start=False, acknowledged=2)
    assert verdict.error is err
    assert not verdict.lost
    assert verdict.send_end


def test_capacity_refusal_same_type_everywhere_and_not_a_loss() -> None:
    """The toolkit's capacity refusal is one type over every path; a START refused that way needs no END."""
    for path, status in [("stream", ""), ("grpc", "StatusCode.UNAVAILABLE"), ("http", "503")]:
        err = _over(path, CAPACITY, status)
        assert type(err) is SequenceCapacityError
        verdict = judge_step(err, sequence_id=3, start=True, acknowledged=0)
        assert (verdict.lost, verdict.send_end, verdict.error) == (False, False, err)


def test_busy_refusal_same_type_everywhere_and_not_a_loss() -> None:
    """A step refused because the previous one still streams is one type on every path; the sequence goes on."""
    for path, status in [("stream", ""), ("grpc", "StatusCode.UNAVAILABLE"), ("http", "503")]:
        err = _over(path, BUSY, status)
        assert type(err) is SequenceBusyError
        for start, acked in ((True, 0), (False, 3)):
            verdict = judge_step(err, sequence_id=9, start=start, acknowledged=acked)
            assert (verdict.lost, verdict.send_end, verdict.error) == (False, True, err)


def test_invalid_input_refusal_same_type_everywhere_and_not_a_loss() -> None:
    """A request the toolkit refuses for its own inputs is InvalidArgumentError on every path, status or none."""
    for path, status in [("stream", ""), ("grpc", "StatusCode.INVALID_ARGUMENT"), ("http", "400")]:
        err = _over(path, INVALID, status)
        assert type(err) is InvalidArgumentError
        assert INVALID_INPUT in err.message
        for start, acked in ((True, 0), (False, 3)):
            verdict = judge_step(err, sequence_id=9, start=start, acknowledged=acked)
            assert (verdict.lost, verdict.send_end, verdict.error) == (False, True, err)


def test_loss_signals_but_not_timeouts_become_sequence_lost() -> None:
    """Model gone (NOT_FOUND) and connection failures on step 2+ are losses; a timeout stays the step's error."""
    for status in ("StatusCode.NOT_FOUND", "StatusCode.UNAVAILABLE"):
        base = map_error(InferenceServerException("x", status=status), model="m")
        verdict = judge_step(base, sequence_id=9, start=False, acknowledged=4)
        assert isinstance(verdict.error, SequenceLost)
        assert (verdict.error.sequence_id, verdict.error.steps_acknowledged, verdict.error.model) == (9, 4, "m")
        assert verdict.error.__cause__ is base
    timeout = map_error(TimeoutError())
    verdict = judge_step(timeout, sequence_id=9, start=False, acknowledged=4)
    assert verdict.error is timeout
    assert verdict.lost
    assert verdict.send_end


# --- the one tree --------------------------------------------------------------------------------


def test_every_public_exception_is_defined_in_the_one_tree() -> None:
    """Every exception (or warning) class the package exports is defined in ``_errors/_exceptions.py``, exported
    by ``_errors`` under the same name, and drawn in that module's tree (its docstring)."""
    import triton_npu_client
    from triton_npu_client import _errors
    from triton_npu_client._errors import _exceptions

    public = {
        name: value
        for name in triton_npu_client.__all__
        if isinstance(value := getattr(triton_npu_client, name), type) and issubclass(value, BaseException)
    }
    assert {"ChatOptionError", "ChatBusyError", "ChatMessageError", "ChatHistoryMismatch", "JobPathError"} <= set(
        public
    )
    here = _exceptions.__name__
    outside = sorted(f"{name} ({cls.__module__})" for name, cls in public.items() if cls.__module__ != here)
    assert outside == []
    assert all(getattr(_errors, name) is cls for name, cls in public.items())
    drawn = set((_exceptions.__doc__ or "").split())
    assert [name for name in public if name not in drawn] == []
    # And nothing defined there is left out of the public namespace.
    defined = {n for n, v in vars(_exceptions).items() if isinstance(v, type) and v.__module__ == _exceptions.__name__}
    assert defined == set(public)


def test_the_classifier_loads_on_first_use() -> None:
    """``_errors`` exports the classifier's names, but importing the package loads neither it nor grpc (the server
    toolkit inside Triton's stub imports the package); the first use of one of its names does."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import triton_npu_client._errors as errors\n"
        "before = ('triton_npu_client._errors._classify' in sys.modules, 'grpc' in sys.modules)\n"
        "from triton_npu_client._errors import judge_step\n"
        "from triton_npu_client._errors._classify import judge_step as original\n"
        "print(before, judge_step is original, 'judge_step' in errors.__all__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "(False, False) True True"
