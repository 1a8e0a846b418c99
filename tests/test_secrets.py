"""Secrets never show: header values are hidden in every repr and str, a URL with user info is refused without
quoting it, and neither log records (at DEBUG, every logger) nor error messages carry a header value or an API key."""

from __future__ import annotations

import logging
import traceback
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from triton_npu_client import (
    Call,
    Client,
    ClientConfig,
    LocalServerError,
    LocalTriton,
    ModelNotFoundError,
    RequestTimeout,
    RetryPolicy,
    TransportError,
    TritonError,
    UsageError,
)
from triton_npu_client._client._model import Model
from triton_npu_client._wire import InferRequest

# One distinct value per header: whatever its name says, no value may show.
HEADERS = {
    "Authorization": "Bearer tok-AUTHZ-0001",
    "x-api-key": "key-APIKEY-0002",
    "cookie": "session=COOKIE-0003",
    "x-request-tag": "plain-TAG-0004",
}
SECRETS = (*HEADERS.values(), "AUTHZ-0001", "APIKEY-0002", "COOKIE-0003", "TAG-0004")
PASSWORD = "pw-URL-0005"


def _leaks(text: str) -> list[str]:
    return [s for s in (*SECRETS, PASSWORD) if s in text]


def test_config_and_client_reprs_show_header_names_never_values(capsys: pytest.CaptureFixture[str]) -> None:
    """print(client.config), repr(config), repr(client) and a with_options() copy name the headers, hide every value."""
    config = ClientConfig(urls="grpc://127.0.0.1:1", headers=HEADERS)
    copy = ClientConfig(urls="http://127.0.0.1:2", headers=config.headers)
    print(config)
    print(copy)
    shown = capsys.readouterr().out + repr(config) + str(config) + repr(copy)
    assert _leaks(shown) == []
    for name in HEADERS:
        assert f"('{name}', '***')" in shown
    # The values are kept: every call sends them.
    assert dict(config.headers) == HEADERS


async def test_a_client_with_headers_shows_no_value() -> None:
    """A client (and its with_options copies) shows neither header values in its repr nor in its config's."""
    async with Client("grpc://127.0.0.1:1", headers=HEADERS) as client:
        copy = client.with_options(timeout_s=2)
        other = client.with_options(headers={"authorization": "Bearer tok-AUTHZ-0001"})
        try:
            texts = [repr(client), str(client), repr(client.config), repr(copy), repr(copy.config),
                     repr(other.config), repr(client.transport), repr(other.transport)]  # fmt: skip
        finally:
            await other.aclose()
    assert _leaks(" ".join(texts)) == []


@pytest.mark.parametrize(
    "url",
    [
        f"grpc://alice:{PASSWORD}@127.0.0.1:8001",
        f"http://alice:{PASSWORD}@localhost:8000",
        f"grpcs://{PASSWORD}@example.org",
        f"https://alice:{PASSWORD}@[::1]:443",
        f"http://127.0.0.1:8000/?token={PASSWORD}",
        f"grpc://127.0.0.1:8001#{PASSWORD}",
    ],
)
async def test_a_url_with_credentials_is_refused_without_quoting_them(url: str) -> None:
    """User info (or a query/fragment, where tokens hide) is refused with a UsageError that names the host, not the
    credentials; the same for a with_options() copy."""
    with pytest.raises(UsageError) as refused:
        Client(url)
    text = f"{refused.value} {refused.value!r} {''.join(traceback.format_exception(refused.value))}"
    assert _leaks(text) == []
    assert "alice" not in text
    assert "headers" in str(refused.value)  # says where credentials go
    async with Client("grpc://127.0.0.1:1") as client:
        with pytest.raises(UsageError) as again:
            client.with_options(url=url)
    assert _leaks(f"{again.value} {again.value!r}") == []


@pytest.fixture
def debug_logs(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """caplog with every logger at DEBUG while the test runs (read ``.records`` at the end)."""
    caplog.set_level(logging.DEBUG)  # the root logger: every logger propagates here
    named = ("triton_npu_client", "grpc", "aiohttp", "tritonclient", "asyncio")
    levels = {name: logging.getLogger(name).level for name in named}
    for name in named:
        logging.getLogger(name).setLevel(logging.DEBUG)
    yield caplog
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)


def _record_text(record: logging.LogRecord) -> str:
    text = record.getMessage()
    if record.exc_info:
        text += "".join(traceback.format_exception(*record.exc_info))
    return text


@pytest.mark.parametrize("protocol", ["grpc", "http"])
async def test_no_header_value_in_log_records_or_error_messages(
    triton_server: LocalTriton, debug_logs: pytest.LogCaptureFixture, protocol: str
) -> None:
    """Calls that succeed, fail, time out and retry, over gRPC (unary, the shared stream, an own stream) and HTTP,
    with credentials in headers: no log record at DEBUG and no error (message, repr, traceback) shows a value."""
    url = triton_server.grpc_url if protocol == "grpc" else triton_server.http_url
    errors: list[BaseException] = []
    async with Client(url, headers=HEADERS, retry=RetryPolicy(max_attempts=2, initial_backoff_s=0.01)) as client:
        scale = await client.model("scale_fp32")
        assert (await scale.infer(INPUT0=[1.0]))["OUTPUT0"].tolist() == [[2.0]]
        with pytest.raises(ModelNotFoundError) as missing:
            await client.model("no_such_model")
        errors.append(missing.value)
        slow = await client.model("slow_echo")
        with pytest.raises(RequestTimeout) as late:
            await slow.infer(INPUT0=np.ones(3, np.float32), DELAY_S=np.array([2.0], np.float32), timeout_s=0.05)
        errors.append(late.value)
        if protocol == "grpc":
            request = scale.request(INPUT0=[3.0])
            for route in ("shared", "own"):
                result = await client.transport.call(Call(request=request, timeout_s=30, route=route)).single()
                assert result["OUTPUT0"].tolist() == [[6.0]]
            bad = InferRequest(model="no_such_model", inputs=request.inputs, outputs=request.outputs, batch_size=1)
            with pytest.raises(ModelNotFoundError) as on_stream:
                await client.transport.call(Call(request=bad, timeout_s=30, route="shared")).single()
            errors.append(on_stream.value)
        spec = scale.spec
    # Nothing listens on port 1: refused, retried once (the retry logs at DEBUG), then raised.
    async with Client(f"{protocol}://127.0.0.1:1", headers=HEADERS,
                      retry=RetryPolicy(max_attempts=2, initial_backoff_s=0.01)) as nowhere:  # fmt: skip
        with pytest.raises(TransportError) as refused:
            await nowhere.is_server_live(timeout_s=5)
        errors.append(refused.value)
        # A handle on the same model through the unreachable client (its config cannot be fetched from there).
        unreachable = Model(nowhere._caller, spec, {})
        with pytest.raises(TransportError) as retried:
            await unreachable.infer(INPUT0=[1.0], timeout_s=5)
        errors.append(retried.value)
    records = debug_logs.records
    assert any(r.name == "triton_npu_client.retry" for r in records), "the retry was not logged"
    assert [r.name for r in records if _leaks(_record_text(r))] == []
    for err in errors:
        assert isinstance(err, TritonError)
        text = f"{err} {err!r} {''.join(traceback.format_exception(err))}"
        assert _leaks(text) == [], text


def test_the_launcher_logs_no_api_key(tmp_path: Path, debug_logs: pytest.LogCaptureFixture) -> None:
    """LocalTriton logs the command it starts at DEBUG: the API key of a restricted-protocol option reads ***.

    /bin/false stands in for the binary: only the launcher's own log and error are looked at, no server runs.
    """
    server = LocalTriton(
        tmp_path,
        tritonserver="/bin/false",
        extra_args=[
            "--grpc-restricted-protocol=inference:x-api-key=key-APIKEY-0002",
            "--http-restricted-api",
            "inference:x-api-key=key-APIKEY-0002",
        ],
        startup_timeout_s=30,
    )
    with pytest.raises(LocalServerError) as failed:
        server.start()
    started = [r.getMessage() for r in debug_logs.records if r.name == "triton_npu_client.local"]
    assert any("--grpc-restricted-protocol=inference:x-api-key=***" in m for m in started), started
    assert [r.name for r in debug_logs.records if _leaks(_record_text(r))] == []
    assert _leaks(f"{failed.value} {failed.value!r} {server!r}") == []
