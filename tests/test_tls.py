"""TLS, mutual TLS and API keys against the real Triton, with certificates this module makes (openssl CLI).

Two servers for the whole module, each with scale_fp32 and seq_stats_oldest only:

* ``tls_server``: ``grpcs://`` (server certificate only) and the restricted protocols (an API key for inference, over
  gRPC and HTTP); its clear-text HTTP port sits behind tools/tls_proxy.py for ``https://`` (Triton's HTTP endpoint
  has no TLS of its own), once plain and once requiring a client certificate;
* ``mtls_server``: ``grpcs://`` requiring a client certificate signed by the test CA (``--grpc-use-ssl-mutual``).

Every refusal is typed (:class:`TLSError`, :class:`PermissionDeniedError`), never retried, and shows no secret.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import socket
import threading
import traceback
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from _seams import CountingTransport
from _tls_certs import NAMED_SERVER, Certs, make_certs
from tritonclient.grpc import service_pb2, service_pb2_grpc

from tools.tls_proxy import TLSProxy
from triton_npu_client import (
    Client,
    ConnectError,
    LocalTriton,
    Model,
    ModelSpec,
    PermissionDeniedError,
    RetryPolicy,
    ServerUnavailable,
    TLSConfig,
    TLSError,
    TransportError,
    TritonError,
)
from triton_npu_client._call import is_retriable
from triton_npu_client._errors._classify import (
    CLIENT_CERT_REFUSED,
    CLOSED_AFTER_HANDSHAKE,
    SERVER_NOT_TRUSTED,
    map_error,
)

REPO = Path(__file__).resolve().parent.parent / "server_models"
KEY = "key-TLSTEST-7781"
WRONG_KEY = "key-WRONG-7782"
GRPC_KEY_HEADER = "triton-grpc-protocol-x-api-key"  # Triton prefixes the restricted-protocol header over gRPC
RETRY = RetryPolicy(max_attempts=3, initial_backoff_s=0.01)


# --- servers, proxies, certificates (once per module) -----------------------------------------------------------


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("repo")
    for name in ("scale_fp32", "seq_stats_oldest"):
        shutil.copytree(REPO / name, root / name, ignore=shutil.ignore_patterns("__pycache__"))
    return root


def _serve(repo: Path, args: list[str]) -> Iterator[LocalTriton]:
    # Copies of packaged models, whose configs are complete: no auto-complete pass (a stub per model, ~1 s each).
    server = LocalTriton(repo, extra_args=args, stop_grace_s=0, auto_complete_config=False)
    with server:
        yield server
    assert server.processes() == []


@pytest.fixture(scope="module")
def tls_server(repo: Path, certs: Certs) -> Iterator[LocalTriton]:
    yield from _serve(repo, [
        "--grpc-use-ssl=true", f"--grpc-server-cert={certs.server_cert}", f"--grpc-server-key={certs.server_key}",
        f"--grpc-restricted-protocol=inference:x-api-key={KEY}", f"--http-restricted-api=inference:x-api-key={KEY}",
    ])  # fmt: skip


@pytest.fixture(scope="module")
def mtls_server(repo: Path, certs: Certs) -> Iterator[LocalTriton]:
    yield from _serve(repo, [
        "--grpc-use-ssl=true", "--grpc-use-ssl-mutual=true", f"--grpc-root-cert={certs.ca}",
        f"--grpc-server-cert={certs.server_cert}", f"--grpc-server-key={certs.server_key}",
    ])  # fmt: skip


@pytest.fixture(scope="module")
def named_server(repo: Path, certs: Certs) -> Iterator[LocalTriton]:
    """gRPC TLS with a certificate that names only a DNS name, as a pod's certificate names its Service."""
    yield from _serve(repo, [
        "--grpc-use-ssl=true", f"--grpc-server-cert={certs.named_server_cert}",
        f"--grpc-server-key={certs.named_server_key}",
    ])  # fmt: skip


@pytest.fixture(scope="module")
def https_proxy(tls_server: LocalTriton, certs: Certs) -> Iterator[TLSProxy]:
    proxy = TLSProxy(upstream=("127.0.0.1", tls_server.http_port), cert_file=str(certs.server_cert),
                     key_file=str(certs.server_key))  # fmt: skip
    with proxy:
        yield proxy


@pytest.fixture(scope="module")
def mtls_proxy(tls_server: LocalTriton, certs: Certs) -> Iterator[TLSProxy]:
    proxy = TLSProxy(upstream=("127.0.0.1", tls_server.http_port), cert_file=str(certs.server_cert),
                     key_file=str(certs.server_key), client_ca=str(certs.ca))  # fmt: skip
    with proxy:
        yield proxy


@pytest.fixture
def retry_log(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    """Every record at DEBUG: the retry loop logs each retry there (``triton_npu_client.retry``)."""
    caplog.set_level(logging.DEBUG)
    return caplog


def _retries(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "triton_npu_client.retry"]


def _grpcs(server: LocalTriton) -> str:
    return f"grpcs://127.0.0.1:{server.grpc_port}"


def _text(err: BaseException) -> str:
    return f"{err} {err!r} {''.join(traceback.format_exception(err))}"


def _key_material(certs: Certs) -> list[str]:
    """The base64 lines of every private key the module made: none may show in an error."""
    keys = (certs.server_key, certs.client_key, certs.wrong_client_key, certs.self_signed_key, certs.other_server_key)
    return [line for key in keys for line in key.read_text().splitlines() if line and not line.startswith("-----")]




@pytest.fixture(scope="module")
def scale_spec(mtls_server: LocalTriton, certs: Certs) -> ModelSpec:
    """scale_fp32's spec, for handles on clients that cannot fetch it (their inference is what is retried or not)."""

    async def fetch() -> ModelSpec:
        tls = TLSConfig(ca_file=certs.ca, cert_file=certs.client_cert, key_file=certs.client_key)
        async with Client(_grpcs(mtls_server), tls=tls) as client:
            return (await client.model("scale_fp32")).spec

    return asyncio.run(fetch())


async def _infer_once(
    url: str, tls: TLSConfig | None, spec: ModelSpec, headers: dict[str, str] | None = None
) -> tuple[TritonError, int]:
    """Infer through a client with RETRY: the error it raised and how many times the request was sent."""
    async with Client(url, tls=tls, headers=headers, retry=RETRY) as plain:
        counting = CountingTransport(plain.transport)
        counted = Client(url, transport=counting, retry=RETRY)  # type: ignore[arg-type]
        with pytest.raises(TritonError) as failed:
            await Model(counted._caller, spec, {}).infer(INPUT0=[1.0], timeout_s=30)
    return failed.value, counting.infer_calls


def _assert_tls_error(err: BaseException, *, url: str | None, reason: str, certs: Certs) -> None:
    assert isinstance(err, TLSError), repr(err)
    assert not isinstance(err, ConnectError | ServerUnavailable)
    assert not is_retriable(err)
    assert err.reason == reason
    assert err.url == url
    text = _text(err)
    if url is not None:
        assert url in str(err)
    assert reason in str(err)
    assert [line for line in _key_material(certs) if line in text] == []


# --- mutual TLS on Triton's own gRPC endpoint -------------------------------------------------------------------


async def test_mtls_the_right_client_certificate_infers_and_steps_a_sequence(
    mtls_server: LocalTriton, certs: Certs
) -> None:
    """A client certificate signed by the CA the server trusts: inference and a sequence's steps go through."""
    tls = TLSConfig(ca_file=certs.ca, cert_file=certs.client_cert, key_file=certs.client_key)
    async with Client(_grpcs(mtls_server), tls=tls, timeout_s=30) as client:
        scale = await client.model("scale_fp32")
        assert (await scale.infer(INPUT0=[2.5]))["OUTPUT0"].tolist() == [[5.0]]
        stats = await client.model("seq_stats_oldest")
        async with stats.sequence() as seq:
            first = await seq.infer(X=[1.0, 2.0, 3.0, 4.0])
            second = await seq.infer(X=[3.0, 4.0, 5.0, 6.0])
        assert first["COUNT"].tolist() == [[1]]
        assert second["COUNT"].tolist() == [[2]]
        assert second["MEAN"].tolist() == [[2.0, 3.0, 4.0, 5.0]]


async def test_mtls_a_server_certificate_from_another_ca_is_not_trusted(
    mtls_server: LocalTriton, certs: Certs, scale_spec: ModelSpec, retry_log: pytest.LogCaptureFixture
) -> None:
    """The client trusts another CA than the one that signed the server's certificate: TLSError naming the URL and
    the server's certificate, whatever the call; an inference is sent once (never retried)."""
    url = _grpcs(mtls_server)
    tls = TLSConfig(ca_file=certs.other_ca, cert_file=certs.client_cert, key_file=certs.client_key)
    async with Client(url, tls=tls, retry=RETRY, timeout_s=30) as client:
        with pytest.raises(TLSError) as live:
            await client.is_server_live()
        with pytest.raises(TLSError) as model:
            await client.model("scale_fp32")
    infer, sent = await _infer_once(url, tls, scale_spec)
    for err in (live.value, model.value, infer):
        _assert_tls_error(err, url=url, reason=SERVER_NOT_TRUSTED, certs=certs)
        assert "CERTIFICATE_VERIFY_FAILED" in str(err)
    assert sent == 1
    assert _retries(retry_log) == []


async def _raw_live(url: str, credentials: grpc.ChannelCredentials) -> grpc.aio.AioRpcError:
    """What grpc itself raises for ServerLive over ``credentials`` (no SDK code between the test and Triton)."""
    async with grpc.aio.secure_channel(url.removeprefix("grpcs://"), credentials) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await stub.ServerLive(service_pb2.ServerLiveRequest(), timeout=30)
    return failed.value


@pytest.mark.parametrize("client_cert", ["none", "signed by another CA", "self-signed"])
async def test_mtls_a_missing_or_wrong_client_certificate_is_refused(
    mtls_server: LocalTriton,
    certs: Certs,
    client_cert: str,
    retry_log: pytest.LogCaptureFixture,
    scale_spec: ModelSpec,
) -> None:
    """No client certificate, or one the server's CA did not sign: refused at once, typed, never retried.

    Triton sends no TLS alert: it closes the connection right after the handshake, and grpc reports only
    "Socket closed" (UNAVAILABLE), the words of any server that hangs up. Knowing that the connection was TLS
    (``tls_url``), the classifier calls it a refused client certificate.
    """
    url = _grpcs(mtls_server)
    pair = {"none": (None, None), "signed by another CA": (certs.wrong_client_cert, certs.wrong_client_key),
            "self-signed": (certs.self_signed_cert, certs.self_signed_key)}[client_cert]  # fmt: skip
    tls = TLSConfig(ca_file=certs.ca, cert_file=pair[0], key_file=pair[1])
    raw = await _raw_live(url, tls.grpc_credentials())  # type: ignore[arg-type]
    assert raw.code() == grpc.StatusCode.UNAVAILABLE
    assert str(raw.details()).endswith(": Socket closed")
    _assert_tls_error(map_error(raw, tls_url=url), url=url, reason=CLOSED_AFTER_HANDSHAKE, certs=certs)
    # Without the knowledge that the connection was TLS, the same words stay a retriable ConnectError-like failure.
    assert is_retriable(map_error(raw))

    async with Client(url, tls=tls, retry=RETRY, timeout_s=30) as client:
        with pytest.raises(TransportError) as refused:
            await client.model("scale_fp32")
    # The transport knows its channel is TLS: the client raises TLSError, and an inference is sent once.
    _assert_tls_error(refused.value, url=url, reason=CLOSED_AFTER_HANDSHAKE, certs=certs)
    infer, sent = await _infer_once(url, tls, scale_spec)
    _assert_tls_error(infer, url=url, reason=CLOSED_AFTER_HANDSHAKE, certs=certs)
    assert sent == 1
    assert _retries(retry_log) == []


# --- grpcs:// with a server certificate only, and API keys --------------------------------------------------------


async def test_grpcs_with_the_ca_file_and_the_api_key(tls_server: LocalTriton, certs: Certs) -> None:
    """grpcs:// trusting the test CA, with the API key: inference and a sequence go through (server cert only)."""
    async with Client(_grpcs(tls_server), tls=TLSConfig(ca_file=certs.ca), headers={GRPC_KEY_HEADER: KEY}) as client:
        scale = await client.model("scale_fp32")
        assert (await scale.infer(INPUT0=[2.0]))["OUTPUT0"].tolist() == [[4.0]]
        async with (await client.model("seq_stats_oldest")).sequence() as seq:
            assert (await seq.infer(X=[1.0, 1.0, 1.0, 1.0]))["COUNT"].tolist() == [[1]]


async def test_grpcs_a_wrong_ca_is_refused(
    tls_server: LocalTriton, certs: Certs, scale_spec: ModelSpec, retry_log: pytest.LogCaptureFixture
) -> None:
    """grpcs:// (server certificate only) trusting another CA: TLSError naming the URL, inference sent once."""
    url = _grpcs(tls_server)
    tls = TLSConfig(ca_file=certs.other_ca)
    async with Client(url, tls=tls, headers={GRPC_KEY_HEADER: KEY}) as client:
        with pytest.raises(TLSError) as refused:
            await client.is_server_ready()
    infer, sent = await _infer_once(url, tls, scale_spec, {GRPC_KEY_HEADER: KEY})
    for err in (refused.value, infer):
        _assert_tls_error(err, url=url, reason=SERVER_NOT_TRUSTED, certs=certs)
        assert _key_leaks(_text(err)) == []
    assert sent == 1
    assert _retries(retry_log) == []


def _key_leaks(text: str) -> list[str]:
    return [s for s in (KEY, WRONG_KEY, "TLSTEST-7781", "WRONG-7782") if s in text]


@pytest.mark.parametrize("protocol", ["grpc", "http"])
@pytest.mark.parametrize("key", ["missing", "wrong"])
async def test_a_missing_or_wrong_api_key_is_permission_denied_never_retried_never_shown(
    tls_server: LocalTriton, certs: Certs, protocol: str, key: str, retry_log: pytest.LogCaptureFixture
) -> None:
    """Restricted inference: a missing or wrong key is PermissionDeniedError (Triton says UNAVAILABLE over gRPC,
    403 over HTTP), sent once, and the key shows in no message, repr, traceback or log record at DEBUG."""
    if protocol == "grpc":
        url, tls, name = _grpcs(tls_server), TLSConfig(ca_file=certs.ca), GRPC_KEY_HEADER
    else:
        url, tls, name = tls_server.http_url, None, "x-api-key"
    headers = {name: WRONG_KEY} if key == "wrong" else {}
    named = ("triton_npu_client", "grpc", "aiohttp", "tritonclient")
    levels = {logger: logging.getLogger(logger).level for logger in named}
    for logger in named:
        logging.getLogger(logger).setLevel(logging.DEBUG)
    try:
        async with Client(url, tls=tls, headers=headers, retry=RETRY) as plain:
            counting = CountingTransport(plain.transport)
            counted = Client(url, transport=counting, retry=RETRY)  # type: ignore[arg-type]
            model = await counted.model("scale_fp32")  # model config is not a restricted API here
            with pytest.raises(PermissionDeniedError) as denied:
                await model.infer(INPUT0=[2.0])
            texts = [_text(denied.value), repr(plain), repr(plain.config), repr(plain.transport), repr(counted)]
    finally:
        for logger, level in levels.items():
            logging.getLogger(logger).setLevel(level)
    assert counting.infer_calls == 1
    assert _retries(retry_log) == []
    assert denied.value.status == ("UNAVAILABLE" if protocol == "grpc" else "403")
    assert not is_retriable(denied.value)
    records = [r.getMessage() + "".join(traceback.format_exception(*r.exc_info)) if r.exc_info else r.getMessage()
               for r in retry_log.records]  # fmt: skip
    assert _key_leaks(" ".join(texts + records)) == []


# --- https:// through a TLS-terminating proxy in front of Triton's HTTP endpoint -------------------------------


async def test_https_through_the_proxy(https_proxy: TLSProxy, certs: Certs) -> None:
    """https:// trusting the test CA, with the API key: inference goes through; the key reaches Triton in TLS."""
    async with Client(https_proxy.url, tls=TLSConfig(ca_file=certs.ca), headers={"x-api-key": KEY}) as client:
        scale = await client.model("scale_fp32")
        assert (await scale.infer(INPUT0=[1.5]))["OUTPUT0"].tolist() == [[3.0]]
    async with Client(https_proxy.url, tls=TLSConfig(ca_file=certs.ca), headers={"x-api-key": WRONG_KEY}) as client:
        scale = await client.model("scale_fp32")
        with pytest.raises(PermissionDeniedError) as denied:
            await scale.infer(INPUT0=[1.5])
    assert _key_leaks(_text(denied.value)) == []


async def test_https_a_wrong_ca_is_refused(
    https_proxy: TLSProxy, certs: Certs, scale_spec: ModelSpec, retry_log: pytest.LogCaptureFixture
) -> None:
    """The proxy's certificate is not signed by the CA the client trusts: TLSError naming the https URL, no retry."""
    tls = TLSConfig(ca_file=certs.other_ca)
    async with Client(https_proxy.url, tls=tls, retry=RETRY) as client:
        with pytest.raises(TLSError) as refused:
            await client.model("scale_fp32")
    infer, sent = await _infer_once(https_proxy.url, tls, scale_spec)
    for err in (refused.value, infer):
        _assert_tls_error(err, url=https_proxy.url, reason=SERVER_NOT_TRUSTED, certs=certs)
    assert sent == 1
    assert _retries(retry_log) == []


@pytest.mark.parametrize("client_cert", ["right", "none", "signed by another CA", "self-signed"])
async def test_https_with_a_client_certificate_required_at_the_proxy(
    mtls_proxy: TLSProxy, certs: Certs, scale_spec: ModelSpec, client_cert: str, retry_log: pytest.LogCaptureFixture
) -> None:
    """The proxy requires a client certificate signed by the test CA: the right one infers; none, or one from
    another CA, is TLSError (the proxy's TLS alert says why), and an inference is sent once."""
    pair = {"right": (certs.client_cert, certs.client_key), "none": (None, None),
            "signed by another CA": (certs.wrong_client_cert, certs.wrong_client_key),
            "self-signed": (certs.self_signed_cert, certs.self_signed_key)}[client_cert]  # fmt: skip
    tls = TLSConfig(ca_file=certs.ca, cert_file=pair[0], key_file=pair[1])
    async with Client(mtls_proxy.url, tls=tls, headers={"x-api-key": KEY}, retry=RETRY) as client:
        if client_cert == "right":
            scale = await client.model("scale_fp32")
            assert (await scale.infer(INPUT0=[4.0]))["OUTPUT0"].tolist() == [[8.0]]
            return
        with pytest.raises(TLSError) as refused:
            await client.model("scale_fp32")
    infer, sent = await _infer_once(mtls_proxy.url, tls, scale_spec, {"x-api-key": KEY})
    for err in (refused.value, infer):
        # aiohttp's error for an alert after the handshake carries no address: the transport names its own URL.
        _assert_tls_error(err, url=mtls_proxy.url, reason=CLIENT_CERT_REFUSED, certs=certs)
        assert f"TLS with {mtls_proxy.url} failed" in str(err)
        assert ("CERTIFICATE_REQUIRED" if client_cert == "none" else "UNKNOWN_CA") in str(err)
        assert _key_leaks(_text(err)) == []
    assert sent == 1
    assert _retries(retry_log) == []


def test_tls_error_is_in_the_tree_and_not_retriable() -> None:
    """TLSError is a TransportError that neither the retry loop nor the fleet takes for an unreachable server."""
    err = TLSError("TLS with grpcs://h:1 failed", url="grpcs://h:1", reason=SERVER_NOT_TRUSTED, status="UNAVAILABLE")
    assert isinstance(err, TransportError | TritonError)
    assert not isinstance(err, ConnectError | ServerUnavailable | ConnectionError)
    assert not is_retriable(err)


@pytest.fixture
def hang_up_port() -> Iterator[int]:
    """A loopback port that accepts each connection and closes it at once (a proxy with no backend)."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    port = int(listener.getsockname()[1])
    yield port
    stop.set()
    socket.create_connection(("127.0.0.1", port)).close()  # wakes accept(): closing the listener would not
    thread.join()
    listener.close()


async def test_a_connection_dropped_before_any_tls_stays_a_retriable_connect_error(
    hang_up_port: int, certs: Certs, scale_spec: ModelSpec
) -> None:
    """A listener that hangs up before the handshake is no TLS refusal, even on a TLS connection: ConnectError,
    retried (and the fleet fails over), as before. grpc says "Handshake read failed (...)" there."""
    url = f"grpcs://127.0.0.1:{hang_up_port}"
    raw = await _raw_live(url, TLSConfig(ca_file=certs.ca).grpc_credentials())  # type: ignore[arg-type]
    assert "Handshake read failed" in str(raw.details())
    assert not isinstance(map_error(raw, tls_url=url), TLSError)
    err, sent = await _infer_once(url, TLSConfig(ca_file=certs.ca), scale_spec)
    assert isinstance(err, ConnectError)
    assert sent == RETRY.max_attempts


async def test_https_with_the_upstream_down_stays_a_retriable_connect_error(
    hang_up_port: int, certs: Certs, scale_spec: ModelSpec
) -> None:
    """The proxy completes the handshake, then its upstream hangs up: the connection closes with no TLS alert,
    which is a server going away (ConnectError, retried), not a refused certificate."""
    with TLSProxy(upstream=("127.0.0.1", hang_up_port), cert_file=str(certs.server_cert),
                  key_file=str(certs.server_key)) as proxy:  # fmt: skip
        err, sent = await _infer_once(proxy.url, TLSConfig(ca_file=certs.ca), scale_spec)
    assert isinstance(err, ConnectError)
    assert not isinstance(err, TLSError)
    assert sent == RETRY.max_attempts


async def test_a_fleet_found_through_dns_checks_each_replica_against_the_name(
    named_server: LocalTriton, certs: Certs
) -> None:
    """``dns+grpcs://NAME`` connects to the addresses NAME resolves to, and checks each replica's certificate against
    NAME: a certificate that names only the Service's DNS name is accepted; reached by its address it is not."""
    port = named_server.grpc_port

    async def resolver(host: str, _port: int) -> list[str]:
        assert host == NAMED_SERVER
        return ["127.0.0.1"]

    tls = TLSConfig(ca_file=certs.ca)
    async with Client(f"dns+grpcs://{NAMED_SERVER}:{port}", tls=tls, resolver=resolver) as fleet:
        scale = await fleet.model("scale_fp32")
        assert (await scale.infer(INPUT0=[5.0]))["OUTPUT0"].tolist() == [[10.0]]
        assert [(s.url, s.healthy) for s in await fleet.replicas()] == [(f"grpcs://127.0.0.1:{port}", True)]
    async with Client(f"grpcs://127.0.0.1:{port}", tls=tls, retry=RETRY) as by_address:
        with pytest.raises(TLSError) as refused:
            await by_address.model("scale_fp32")
    assert refused.value.url == f"grpcs://127.0.0.1:{port}"
