"""The one place that translates tritonclient / gRPC / HTTP / asyncio errors into the SDK's error tree, and the
one place that judges what a failed sequence step means for its sequence (:func:`judge_step`).

Classification is by exception type and status code (gRPC ``StatusCode``, HTTP status). Message text is read for
the phrases in :data:`SIGNALS` alone, each matched whole: the server toolkit's markers (``_protocol/_markers.py``:
a fixed ``[triton-npu:...]`` tag at the start of each of its refusals, :data:`INVALID_INPUT` among them) and the
few phrases of Triton 2.51 that carry a meaning no status code carries (a sequence step without START or without
a correlation id, a dead Python stub, the restricted-protocol refusal that Triton sends as UNAVAILABLE, and an
unknown model). No other words of a message ("input", "shape", ...) ever decide its class: a model's own text may
say anything.

Per-request errors on a gRPC bidirectional stream carry no status at all, so :func:`map_stream_error` has only
those signals: a stream error with none of them is :class:`InternalServerError`, even when it is Triton's own
refusal of a request's inputs (those come with ``INVALID_ARGUMENT`` over unary gRPC and 400 over HTTP, where they
are :class:`InvalidArgumentError`). The toolkit's models mark every refusal of a request's own inputs with
:data:`INVALID_INPUT`, so theirs are :class:`InvalidArgumentError` on every path.

What Triton 2.51 answers (seen against the real server):

* unknown model: gRPC ``NOT_FOUND`` / HTTP 404 for infer, metadata and config; over the stream "Request for unknown
  model: 'm' is not found";
* a model that exists in the repository but is unloaded: the same ``NOT_FOUND`` / 404 ("... has no available
  versions"), so both become :class:`ModelNotFoundError`; statistics for either answer ``INVALID_ARGUMENT`` / 400;
* server stopped: gRPC ``UNAVAILABLE`` (the channel cannot connect), HTTP: aiohttp ``ClientConnectorError``;
* client deadline: gRPC ``DEADLINE_EXCEEDED``; a wrong input: ``INVALID_ARGUMENT`` / 400 (over the stream: text
  only, e.g. "unexpected shape for input 'X' ...", so :class:`InternalServerError`).

A refused TLS handshake is :class:`TLSError` (never retried; see :func:`_tls_failure` for what each side says).
Those are the TLS library's words, not a model's: "Tls handshake failed" / "Ssl handshake failed" from grpc core,
``ssl.SSLError`` / aiohttp's certificate errors over HTTPS, each with an OpenSSL reason code.
"""

from __future__ import annotations

import asyncio
import re
import ssl
from typing import Final

import attrs
import grpc

from .._protocol import INVALID_INPUT, SEQUENCE_BUSY, SEQUENCE_CAPACITY, SEQUENCE_UNKNOWN
from ._exceptions import (
    ConnectError,
    InternalServerError,
    InvalidArgumentError,
    ModelNotFoundError,
    ModelNotReadyError,
    PermissionDeniedError,
    RequestTimeout,
    SequenceBusyError,
    SequenceCapacityError,
    SequenceError,
    SequenceLost,
    ServerUnavailable,
    TLSError,
    TransportError,
    TritonError,
)

__all__ = ["SIGNALS", "StepVerdict", "judge_step", "map_error", "map_stream_error"]

# Phrases that carry a meaning no status code carries (Triton 2.51's own words, and the toolkit's markers).
MISSING_START: Final = "must specify the START flag"
NO_CORRELATION_ID: Final = "must specify a non-zero or non-empty correlation ID"
STUB_DEAD: Final = "Stub process is not healthy"
RESTRICTED: Final = "This protocol is restricted"
# What a missing-START refusal (typed SequenceLost) adds to Triton's words: what they mean for the caller.
NOT_HELD: Final = (
    "the server holds no such sequence (never started, or lost: idle timeout, restart, reload); start a new one"
)
# How Triton begins both "... is not found" and "... has no available versions" (an unloaded model).
UNKNOWN_MODEL: Final = "Request for unknown model: "
SIGNALS: Final = (MISSING_START, NO_CORRELATION_ID, STUB_DEAD, RESTRICTED, UNKNOWN_MODEL, SEQUENCE_UNKNOWN,
                  SEQUENCE_CAPACITY, SEQUENCE_BUSY, INVALID_INPUT)

_GRPC: Final[dict[str, type[TritonError]]] = {
    "DEADLINE_EXCEEDED": RequestTimeout,
    "UNAVAILABLE": ServerUnavailable,
    "RESOURCE_EXHAUSTED": ServerUnavailable,
    "NOT_FOUND": ModelNotFoundError,
    "INVALID_ARGUMENT": InvalidArgumentError,
    "OUT_OF_RANGE": InvalidArgumentError,
    "FAILED_PRECONDITION": ModelNotReadyError,
    "UNAUTHENTICATED": PermissionDeniedError,
    "PERMISSION_DENIED": PermissionDeniedError,
    "ALREADY_EXISTS": InvalidArgumentError,
    "UNIMPLEMENTED": InvalidArgumentError,
    "INTERNAL": InternalServerError,
    "UNKNOWN": InternalServerError,
    "DATA_LOSS": InternalServerError,
    "ABORTED": ServerUnavailable,
}

_HTTP: Final[dict[int, type[TritonError]]] = {
    400: InvalidArgumentError,
    401: PermissionDeniedError,
    403: PermissionDeniedError,
    404: ModelNotFoundError,
    408: RequestTimeout,
    429: ServerUnavailable,
    499: RequestTimeout,
    500: InternalServerError,
    502: ServerUnavailable,
    503: ServerUnavailable,
    504: RequestTimeout,
}


def _status_name(status: object) -> str | None:
    """``grpc.StatusCode.NOT_FOUND`` / ``"StatusCode.NOT_FOUND"`` / ``"404"`` -> ``"NOT_FOUND"`` / ``"404"``."""
    if status is None:
        return None
    if isinstance(status, grpc.StatusCode):
        return str(status.name)
    text = str(status)
    return text.removeprefix("StatusCode.")


def _class_for(status: str | None) -> type[TritonError]:
    if status is None:
        return InternalServerError
    if status.isdigit():
        code = int(status)
        if code in _HTTP:
            return _HTTP[code]
        return InternalServerError if code >= 500 else InvalidArgumentError
    return _GRPC.get(status, InternalServerError)


def _http_connect_errors() -> tuple[type[BaseException], ...]:
    try:
        import aiohttp
    except ImportError:  # pragma: no cover - aiohttp comes with tritonclient[http]
        return ()
    return (aiohttp.ClientConnectionError,)


def _http_timeout_errors() -> tuple[type[BaseException], ...]:
    try:
        import aiohttp
    except ImportError:  # pragma: no cover
        return ()
    return (aiohttp.ServerTimeoutError, aiohttp.ConnectionTimeoutError)


# --- TLS ------------------------------------------------------------------------------------------------------
# grpc core's words for a failed handshake (older releases said "Ssl", 1.6x on say "Tls"). Not "Handshake read
# failed (...)": that is the TCP connection dropping before any TLS was spoken (a proxy with no backend), retriable.
# grpc's words for a refused handshake; "Hostname Verification Check failed" is a certificate that does not name
# the host connected to (e.g. reached by its address while it names only a DNS name).
_GRPC_HANDSHAKE: Final = ("Tls handshake failed", "Ssl handshake failed", "Hostname Verification Check failed")
# The OpenSSL / BoringSSL reason codes, as both libraries spell them in their messages.
_SERVER_NOT_TRUSTED_CODES: Final = (
    "CERTIFICATE_VERIFY_FAILED", "is not in peer certificate", "Hostname Verification Check failed"
)  # fmt: skip
_CLIENT_REFUSED_CODES: Final = (
    "ALERT_CERTIFICATE_REQUIRED",
    "ALERT_UNKNOWN_CA",
    "ALERT_BAD_CERTIFICATE",
    "ALERT_CERTIFICATE_UNKNOWN",
    "ALERT_CERTIFICATE_EXPIRED",
    "ALERT_CERTIFICATE_REVOKED",
    "ALERT_UNSUPPORTED_CERTIFICATE",
    "ALERT_ACCESS_DENIED",
    "ALERT_HANDSHAKE_FAILURE",
    "PEER_DID_NOT_RETURN_A_CERTIFICATE",
)
_NOT_TLS_CODES: Final = ("WRONG_VERSION_NUMBER", "HTTP_REQUEST", "PACKET_LENGTH_TOO_LONG", "RECORD_LAYER_FAILURE")

SERVER_NOT_TRUSTED: Final = (
    "the server's certificate is not trusted (not signed by the CA in TLSConfig.ca_file, or the system roots when "
    "none is given, or not issued for this host name)"
)
CLIENT_CERT_REFUSED: Final = (
    "the server refused the client certificate (none was given, or it is not signed by a CA the server trusts)"
)
CLOSED_AFTER_HANDSHAKE: Final = (
    "the server closed the connection right after the TLS handshake, which a mutual-TLS server does when it refuses "
    "the client certificate (none was given, or it is not signed by a CA the server trusts)"
)
NOT_TLS: Final = "the two sides do not both speak TLS on this port (check the URL's scheme and port)"
TLS_FAILED: Final = "the TLS handshake failed"

# grpc names the address it tried: "ipv4:127.0.0.1:8001", "ipv6:[::1]:8001".
_GRPC_PEER: Final = re.compile(r"\bipv[46]:(\[[0-9A-Fa-f:.%]+\]|[0-9.]+):(\d+)")
# A grpc connection attempt that the server ended after our TLS handshake had completed (no TLS words at all).
# "Handshake read failed (Socket closed)" is the other case (no TLS spoken yet): the ": " before the words tells.
_GRPC_CLOSED: Final = re.compile(
    r"failed to connect to all addresses; .*: (Socket closed|recvmsg:Connection reset by peer \(\d+\))$"
)


def _reason_of(text: str) -> str:
    if any(code in text for code in _SERVER_NOT_TRUSTED_CODES):
        return SERVER_NOT_TRUSTED
    if any(code in text for code in _CLIENT_REFUSED_CODES):
        return CLIENT_CERT_REFUSED
    if any(code in text for code in _NOT_TLS_CODES):
        return NOT_TLS
    return TLS_FAILED


def _chain(err: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    cur: BaseException | None = err
    while cur is not None and cur not in seen and len(seen) < 8:
        seen.append(cur)
        cur = cur.__cause__ or cur.__context__
    return seen


def _tls_failure(err: BaseException, message: str, tls_url: str | None) -> tuple[str, str | None] | None:
    """``(reason, url)`` when ``err`` is a refused TLS handshake, else None.

    What each side reports (seen with grpcio 1.85 against Triton 2.51, and aiohttp 3.x / OpenSSL 3):

    * server certificate not trusted: grpc "Tls handshake failed (TSI_PROTOCOL_FAILURE): ... CERTIFICATE_VERIFY_FAILED";
      aiohttp ``ClientConnectorCertificateError``;
    * client certificate refused, by a server that sends the TLS alert (envoy, HAProxy, tools/tls_proxy.py): over
      TLS 1.3 the alert arrives on the first read after the handshake, as ``ssl.SSLError``
      "TLSV13_ALERT_CERTIFICATE_REQUIRED" / "TLSV1_ALERT_UNKNOWN_CA" (aiohttp ``ClientOSError``);
    * client certificate refused by Triton's gRPC endpoint: Triton sends no alert, it closes the connection after the
      handshake, and grpc says only "failed to connect to all addresses; ... Socket closed", as for a server that
      closes for any other reason. Only a caller that knows the connection was TLS (``tls_url``) can tell.
    """
    from tritonclient.utils import InferenceServerException

    if isinstance(err, grpc.RpcError | InferenceServerException):
        peer = _GRPC_PEER.search(message)
        url = tls_url or (f"grpcs://{peer.group(1)}:{peer.group(2)}" if peer else None)
        if any(words in message for words in _GRPC_HANDSHAKE):
            return _reason_of(message), url
        if tls_url is not None and _GRPC_CLOSED.search(message):
            return CLOSED_AFTER_HANDSHAKE, url
        return None
    chain = _chain(err)
    if not any(isinstance(e, ssl.SSLError) for e in chain) and not _is_aiohttp_ssl(err):
        return None
    if any(isinstance(e, ssl.SSLEOFError | ssl.SSLZeroReturnError) for e in chain):
        return None  # the connection dropped mid-way: nothing says which side refused what, retriable
    host, port = getattr(err, "host", None), getattr(err, "port", None)
    url = tls_url
    if url is None and isinstance(host, str) and isinstance(port, int):
        url = f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"
    if any(isinstance(e, ssl.SSLCertVerificationError | ssl.CertificateError) for e in chain):
        return SERVER_NOT_TRUSTED, url
    reason = _reason_of(" ".join(str(e) for e in chain))
    if reason == TLS_FAILED and not _is_aiohttp_ssl(err):
        # An SSL error after the handshake with no reason code of ours (a bad record, data after close_notify):
        # the connection broke, as before.
        return None
    return reason, url


def _is_aiohttp_ssl(err: BaseException) -> bool:
    try:
        import aiohttp
    except ImportError:  # pragma: no cover
        return False
    return isinstance(err, aiohttp.ClientSSLError)


def map_error(
    err: BaseException,
    *,
    model: str | None = None,
    version: str | None = None,
    request_id: str | None = None,
    sequence_id: int | str | None = None,
    tls_url: str | None = None,
) -> TritonError:
    """Translate ``err`` into the SDK's error tree (the caller raises the result ``from err``).

    An error that already is a :class:`TritonError` is returned with missing context filled in.
    ``tls_url``: the transport's ``scheme://host:port`` when its connection is TLS. It names the server in a
    :class:`TLSError`, and it is what lets a gRPC connection that the server closed right after the handshake read as
    a refused client certificate (Triton sends no TLS alert: see :func:`_tls_failure`).
    """
    ctx: dict[str, object] = {
        "model": model,
        "version": version,
        "request_id": request_id or None,
        "sequence_id": sequence_id,
    }
    if isinstance(err, TritonError):
        for key, val in ctx.items():
            if getattr(err, key, None) is None and val is not None:
                setattr(err, key, val)
        return err

    status: str | None
    message: str
    from tritonclient.utils import InferenceServerException

    tls = _tls_error(err, model=model, version=version, request_id=request_id, sequence_id=sequence_id,
                     tls_url=tls_url)  # fmt: skip
    if tls is not None:
        return tls

    if isinstance(err, InferenceServerException):
        status = _status_name(err.status())
        message = err.message() or str(err)
        if status == "CANCELLED":
            # tritonclient reports a cancelled call as an exception; the SDK lets CancelledError through
            # instead, so this only happens when the server side cancelled: treat it as unavailability.
            cls: type[TritonError] = ServerUnavailable
        else:
            cls = _class_for(status)
    elif isinstance(err, grpc.RpcError):
        code = err.code() if callable(getattr(err, "code", None)) else None
        status = _status_name(code)
        details = err.details() if callable(getattr(err, "details", None)) else None
        message = str(details) if details else f"gRPC call failed with {status}"
        cls = ServerUnavailable if status == "CANCELLED" else _class_for(status)
    elif isinstance(err, (TimeoutError, asyncio.TimeoutError, *_http_timeout_errors())):
        status = "DEADLINE_EXCEEDED"
        message = "the call ran past its deadline"
        cls = RequestTimeout
    elif isinstance(err, (*_http_connect_errors(), ConnectionError, OSError)):
        status = None
        message = f"cannot connect to the server: {err}"
        cls = ConnectError
    else:
        status = None
        message = f"{type(err).__name__}: {err}"
        cls = InternalServerError

    cls = _by_signal(message) or cls
    where = f"model {model!r}: " if model else ""
    return cls(
        f"{where}{_explained(cls, message)}",
        model=model,
        version=version,
        request_id=request_id or None,
        status=status,
        sequence_id=sequence_id,
    )


def _error_text(err: BaseException) -> tuple[str | None, str]:
    """``(status, message)`` of a gRPC or tritonclient error; ``(None, str(err))`` for anything else."""
    from tritonclient.utils import InferenceServerException

    if isinstance(err, InferenceServerException):
        return _status_name(err.status()), err.message() or str(err)
    if isinstance(err, grpc.RpcError):
        code = err.code() if callable(getattr(err, "code", None)) else None
        details = err.details() if callable(getattr(err, "details", None)) else None
        return _status_name(code), str(details) if details else ""
    return None, str(err)


def _tls_error(
    err: BaseException,
    *,
    model: str | None,
    version: str | None,
    request_id: str | None,
    sequence_id: int | str | None,
    tls_url: str | None,
) -> TLSError | None:
    status, text = _error_text(err)
    found = _tls_failure(err, text, tls_url)
    if found is None:
        return None
    reason, url = found
    where = f"model {model!r}: " if model else ""
    # The library's own words end the message: its reason code is what a search finds. They name certificates'
    # problems, never their content, and no key material ever reaches an error.
    return TLSError(
        f"{where}TLS with {url or 'the server'} failed: {reason} [{text}]",
        url=url,
        reason=reason,
        model=model,
        version=version,
        request_id=request_id or None,
        status=status,
        sequence_id=sequence_id,
    )


def _by_signal(message: str) -> type[TritonError] | None:
    """The class a message's signal phrase calls for, whatever status came with it (None: no signal)."""
    if RESTRICTED in message:
        # Triton answers a missing or wrong API key with UNAVAILABLE over gRPC: a refusal that will not change.
        return PermissionDeniedError
    if SEQUENCE_CAPACITY in message:
        return SequenceCapacityError
    if SEQUENCE_BUSY in message:
        return SequenceBusyError
    if MISSING_START in message:
        # Triton's refusal of a step for a sequence it holds no slot for (never started, or its state is gone: the
        # idle timeout, a restart, a reload). Typed here, once, so no caller (the session's judge, the fleet's pins)
        # ever reads the words.
        return SequenceLost
    if NO_CORRELATION_ID in message or SEQUENCE_UNKNOWN in message:
        return SequenceError
    if STUB_DEAD in message:
        return InternalServerError
    if INVALID_INPUT in message:
        return InvalidArgumentError
    return None


def map_stream_error(
    message: str,
    *,
    model: str | None = None,
    request_id: str | None = None,
    sequence_id: int | str | None = None,
) -> TritonError:
    """Classify a per-request error of a gRPC bidirectional stream (``ModelStreamInferResponse.error_message``).

    The stream carries these errors as bare strings with no status code, so the phrases of :data:`SIGNALS` are all
    there is; a message with none of them is :class:`InternalServerError` (see the module docstring).
    """
    where = f"model {model!r}: " if model else ""
    cls = _by_signal(message)
    if cls is None:
        cls = ModelNotFoundError if UNKNOWN_MODEL in message else InternalServerError
    text = _explained(cls, message)
    return cls(f"{where}{text}", model=model, request_id=request_id or None, sequence_id=sequence_id)


def _explained(cls: type[TritonError], message: str) -> str:
    """``message``, with what it means when Triton's own words do not say it (a missing START is a lost sequence)."""
    return f"{message} ({NOT_HELD})" if cls is SequenceLost else message


@attrs.frozen(kw_only=True)
class StepVerdict:
    """What a failed sequence step means: the error to raise, whether the sequence is gone or its state can no
    longer be trusted (``lost``), and whether closing the session must still send END (``send_end``)."""

    error: TritonError
    lost: bool
    send_end: bool


def judge_step(err: TritonError, *, sequence_id: int | str, start: bool, acknowledged: int) -> StepVerdict:
    """Judge a failed step of a sequence, the same way whatever path it took (unary gRPC, HTTP, the stream).

    Lost, only on a signal that the server dropped the sequence or that the step's outcome is unknown:

    - a :class:`SequenceLost` from below (Triton's missing-START refusal after an acknowledged step: its idle
      timeout, a restart, a reload; the fleet's, when the sequence's replica failed), a model that is gone
      (unloaded or reloaded), a dead stub: the state is gone and there is nothing to END. A SequenceLost gets the
      step count and the sequence id here;
    - the toolkit's "unknown sequence" marker: the model lost the state, but Triton may still hold the slot,
      so END is still sent;
    - a transport failure or a timeout: the step may or may not have run; END is still sent.

    Anything else (a model exception, an input the server refused, a capacity refusal) is that step's own
    error: the sequence goes on and END is sent at the close. When unsure, send END.
    """
    text = err.message
    if isinstance(err, SequenceLost):
        # Triton's missing-START refusal (typed so by the classifier) or the fleet's refusal of a step whose replica
        # failed: the slot is gone, nothing to END. Neither knew how many steps were acknowledged; the caller does.
        err.steps_acknowledged = acknowledged
        if err.sequence_id is None:
            err.sequence_id = sequence_id
        return StepVerdict(error=err, lost=True, send_end=False)
    if isinstance(err, RequestTimeout):
        # This step's error is the timeout; later steps cannot trust the state.
        return StepVerdict(error=err, lost=True, send_end=True)
    if isinstance(err, TransportError):
        lost = _lost(err, sequence_id, acknowledged, f"the outcome of a step is unknown ({err.message})")
        return StepVerdict(error=err if start else lost, lost=True, send_end=True)
    if start:
        # Nothing was built before the first acknowledged step: a refused START is just this step's error.
        return StepVerdict(error=err, lost=False, send_end=not isinstance(err, SequenceCapacityError))
    gone = STUB_DEAD in text or isinstance(err, ModelNotFoundError)
    if gone or SEQUENCE_UNKNOWN in text:
        return StepVerdict(error=_lost(err, sequence_id, acknowledged, text), lost=True, send_end=not gone)
    return StepVerdict(error=err, lost=False, send_end=True)


def _lost(err: TritonError, sequence_id: int | str, steps: int, why: str) -> SequenceLost:
    lost = SequenceLost(
        f"sequence {sequence_id!r} lost after {steps} acknowledged step(s): {why}",
        sequence_id=sequence_id,
        steps_acknowledged=steps,
        model=err.model,
        version=err.version,
        request_id=err.request_id,
        status=err.status,
    )
    lost.__cause__ = err
    return lost
