"""The client against the real server, the same tests over gRPC and HTTP: dtypes, batching, bad inputs, errors."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest
from _seams import CountingTransport

from triton_npu_client import (
    BatchSizeError,
    Client,
    ClientClosedError,
    ConnectError,
    DuplicateInputError,
    InputDtypeError,
    InputError,
    InputShapeError,
    LocalTriton,
    MissingInputError,
    Model,
    ModelNotFoundError,
    RequestTimeout,
    RetryPolicy,
    SequenceSpec,
    UnknownInputError,
    UnknownOutputError,
    UsageError,
)
from triton_npu_client._transport import GrpcTransport

REPO = Path(__file__).resolve().parent.parent / "server_models"




@pytest.fixture(params=["grpc", "http"])
async def client(request: pytest.FixtureRequest, triton_server: LocalTriton) -> AsyncIterator[Client]:
    url = triton_server.grpc_url if request.param == "grpc" else triton_server.http_url
    async with Client(url, timeout_s=30.0) as c:
        yield c


def _counting(client: Client) -> tuple[Client, CountingTransport]:
    counting = CountingTransport(client.transport)
    return Client(client.config.url, transport=counting), counting  # type: ignore[arg-type]


# --- dtypes ---------------------------------------------------------------------------------------

ROUNDTRIP: dict[str, Any] = {
    "BOOL": [True, False, True],
    "INT8": np.array([-128, 0, 127], np.int8),
    "INT16": np.array([-(2**15), 0, 2**15 - 1], np.int16),
    "INT32": np.array([-(2**31), 0, 2**31 - 1], np.int32),
    "INT64": np.array([-(2**63), 0, 2**63 - 1], np.int64),
    "UINT8": np.array([0, 1, 255], np.uint8),
    "UINT16": np.array([0, 1, 2**16 - 1], np.uint16),
    "UINT32": np.array([0, 1, 2**32 - 1], np.uint32),
    "UINT64": np.array([0, 1, 2**64 - 1], np.uint64),
    "FP16": np.array([-65504.0, 0.5, np.inf], np.float16),
    "FP32": np.array([-1.5, 3.25e-38, np.float32(3.4e38)], np.float32),
    "FP64": np.array([np.pi, -1e308, 5e-324], np.float64),
    "BF16": np.array([1.5, -2.0, 2.0**127, 2.0**-100, np.inf], np.float32),  # bf16-exact values
    "BYTES": [b"a\x00b", "h\u00e9llo \u4e16\u754c", b"\xff\xfe", b""],
}


@pytest.mark.parametrize("dtype", list(ROUNDTRIP))
async def test_every_dtype_roundtrips(client: Client, dtype: str) -> None:
    """Each Triton dtype goes through dtypes_echo and comes back equal (BYTES as UTF-8 bytes, BF16 as float32)."""
    model = await client.model("dtypes_echo")
    value = ROUNDTRIP[dtype]
    result = await model.infer({f"IN_{dtype}": value})
    out = result[f"OUT_{dtype}"]
    assert list(result) == [f"OUT_{dtype}"]
    if dtype == "BYTES":
        assert out.tolist() == [[v.encode() if isinstance(v, str) else v for v in value]]
        assert result.as_str("OUT_BYTES", errors="replace").tolist() == [["a\x00b", value[1], "\ufffd\ufffd", ""]]
    else:
        expected = np.asarray(value)[np.newaxis]
        assert out.dtype == (np.float32 if dtype == "BF16" else expected.dtype)
        np.testing.assert_array_equal(out, expected)


async def test_batch_and_sample_forms(client: Client) -> None:
    """Sample form adds a batch dim of 1; batch form keeps the caller's batch; outputs can be selected."""
    model = await client.model("dtypes_echo")
    sample = await model.infer(IN_INT32=[1, 2, 3])
    assert sample["OUT_INT32"].shape == (1, 3)
    rows = np.arange(8 * 2, dtype=np.int32).reshape(8, 2)
    batch = await model.infer_batch(IN_INT32=rows, IN_FP64=rows.astype(np.float64), outputs=["OUT_FP64"])
    assert list(batch) == ["OUT_FP64"]
    np.testing.assert_array_equal(batch["OUT_FP64"], rows.astype(np.float64))


async def test_reusable_request_and_model_without_batch_dim(client: Client) -> None:
    """A prebuilt request is sent twice unchanged; a max_batch_size-0 model takes values as they are."""
    model = await client.model("slow_echo")
    assert model.spec.max_batch_size == 0
    req = model.request(INPUT0=[1.0, 2.0, 3.0])
    first = await model.infer_request(req)
    second = await model.infer_request(req)
    np.testing.assert_array_equal(first["OUTPUT0"], np.array([1, 2, 3], np.float32))
    assert first == second


async def test_spec_reads_like_a_signature(client: Client) -> None:
    """The fetched spec of scale_fp32 has the documented repr, and is cached per client."""
    model = await client.model("scale_fp32")
    assert repr(model.spec) == "<ModelSpec scale_fp32(INPUT0: FP32[-1]) -> (OUTPUT0: FP32[-1]), max_batch_size=64>"
    assert (await client.model("scale_fp32")).spec is model.spec
    slow = await client.model("slow_echo")
    assert "DELAY_S?: FP32[1]" in repr(slow.spec)
    assert not slow.spec.is_stateful


# --- bad inputs: refused before the network -------------------------------------------------------

BAD_INPUTS: list[tuple[str, dict[str, Any], type[InputError] | type[UsageError], list[str]]] = [
    ("unknown", {"INPUT0": [1.0], "INPUT9": [1.0]}, UnknownInputError, ["INPUT9"]),
    ("missing", {"DELAY_S": [1.0]}, MissingInputError, ["INPUT0", "FP32"]),
    ("float64->FP32 array", {"INPUT0": np.array([1.0])}, InputDtypeError, ["INPUT0", "FP32", "float64"]),
    ("str->FP32", {"INPUT0": ["1.0"]}, InputDtypeError, ["INPUT0", "FP32"]),
    ("shape", {"INPUT0": [[1.0, 2.0]]}, InputShapeError, ["INPUT0", "[-1]", "[1,2]"]),
    ("fixed dim", {"INPUT0": [1.0], "DELAY_S": [0.0, 1.0]}, InputShapeError, ["DELAY_S", "[1]", "[2]"]),
]


@pytest.mark.parametrize(("case", "inputs", "error", "words"), BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
async def test_bad_input_refused_without_network(
    client: Client, case: str, inputs: dict[str, Any], error: type[Exception], words: list[str]
) -> None:
    """Each bad input raises its own class naming input and dtypes/shapes, and no request reaches the server."""
    counted, counter = _counting(client)
    model = await counted.model("slow_echo")
    before = (await client.inference_statistics("slow_echo"))[0]
    with pytest.raises(error) as info:
        await model.infer(inputs)
    for word in words:
        assert word in str(info.value)
    assert counter.infer_calls == 0
    after = (await client.inference_statistics("slow_echo"))[0]
    assert (after.inference_count, after.fail_count) == (before.inference_count, before.fail_count)


async def test_batch_errors_and_duplicates(client: Client) -> None:
    """Batch form: too big, missing batch dim, mismatched sizes; duplicate and unknown outputs: all refused locally."""
    counted, counter = _counting(client)
    model = await counted.model("dtypes_echo")
    with pytest.raises(BatchSizeError, match=r"batch size 9 outside \[1, 8\]"):
        await model.infer_batch(IN_INT8=np.zeros((9, 2), np.int8))
    with pytest.raises(BatchSizeError, match=r"IN_INT8.*\[batch\]\+\[-1\], given \[2\]"):
        await model.infer_batch(IN_INT8=np.zeros(2, np.int8))
    with pytest.raises(BatchSizeError, match="disagree"):
        await model.infer_batch(IN_INT8=np.zeros((2, 2), np.int8), IN_INT16=np.zeros((3, 2), np.int16))
    with pytest.raises(DuplicateInputError, match="IN_INT8"):
        await model.infer([("IN_INT8", [1]), ("IN_INT8", [2])])
    with pytest.raises(UnknownOutputError, match="OUT_NOPE"):
        await model.infer(IN_INT8=[1], outputs=["OUT_NOPE"])
    with pytest.raises(InputDtypeError, match=r"IN_UINT8.*values outside \[0, 255\]"):
        await model.infer(IN_UINT8=[256])
    slow = await counted.model("slow_echo")
    with pytest.raises(BatchSizeError, match="no batch dimension"):
        await slow.infer_batch(INPUT0=[[1.0]])
    assert counter.infer_calls == 0


async def test_decoupled_and_stateful_refused_for_unary(client: Client) -> None:
    """A decoupled spec, or a stateful spec without a sequence id, is refused before any network call."""
    counted, counter = _counting(client)
    spec = (await counted.model("scale_fp32")).spec
    decoupled = Model(counted, attrs.evolve(spec, decoupled=True))
    with pytest.raises(UsageError, match="decoupled"):
        await decoupled.infer(INPUT0=[1.0])
    stateful = Model(counted, attrs.evolve(spec, sequence=SequenceSpec(strategy="oldest")))
    with pytest.raises(UsageError, match="sequence"):
        await stateful.infer(INPUT0=[1.0])
    assert counter.infer_calls == 0


async def test_model_sequence_opens_a_session(client: Client) -> None:
    """model.sequence() / client.sequence(name) open sessions: steps accumulate per sequence, ids differ."""
    model = await client.model("seq_stats_oldest")
    assert model.spec.is_stateful
    async with model.sequence() as seq:
        await seq.infer(X=[1.0, 2.0, 3.0, 4.0])
        second = await seq.infer(X=[3.0, 2.0, 1.0, 0.0])
    assert second["COUNT"].tolist() == [[2]]
    assert second["MEAN"].tolist() == [[2.0, 2.0, 2.0, 2.0]]
    async with client.sequence("seq_stats_oldest") as other:
        assert other.sequence_id != seq.sequence_id
        assert (await other.infer(X=[5.0, 5.0, 5.0, 5.0]))["COUNT"].tolist() == [[1]]


# --- errors from real failures ---------------------------------------------------------------------


async def test_unknown_model(client: Client) -> None:
    """An unknown model is ModelNotFoundError (a LookupError) carrying the model name and status."""
    with pytest.raises(ModelNotFoundError) as info:
        await client.model("no_such_model")
    assert isinstance(info.value, LookupError)
    assert info.value.model == "no_such_model"
    assert info.value.status in ("NOT_FOUND", "404")
    assert await client.is_model_ready("no_such_model") is False


async def test_unloaded_model(client: Client) -> None:
    """After unload, inference on a held handle fails with ModelNotFoundError; after load it works again."""
    model = await client.model("slow_echo")
    req = model.request(INPUT0=[1.0])
    try:
        await client.unload_model("slow_echo")
        assert await client.is_model_ready("slow_echo") is False
        with pytest.raises(ModelNotFoundError) as info:
            await model.infer_request(req)
        assert info.value.model == "slow_echo"
        index = {m.name: m.state for m in await client.repository_index()}
        assert index["slow_echo"] in ("UNLOADING", "UNAVAILABLE")
    finally:
        await client.load_model("slow_echo")
    await client.wait_for_model_ready("slow_echo", timeout_s=30)
    assert (await model.infer_request(req))["OUTPUT0"].tolist() == [1.0]


async def test_deadline(client: Client) -> None:
    """A per-call timeout shorter than the model's delay raises RequestTimeout (a TimeoutError) at the deadline."""
    model = await client.model("slow_echo")
    # Over gRPC the deadline cancels the call and the model stops waiting, so the delay can be far longer than
    # anything here waits: the RequestTimeout itself shows that the deadline, not the answer, ended the call.
    # HTTP does not tell the server, whose single instance runs the request to its end (the drain below waits
    # for it): the delay stays short, and the statistics show the request was not done yet when the error came.
    delay_s = 600.0 if client.config.scheme.startswith("grpc") else 1.5
    before = (await client.inference_statistics("slow_echo"))[0]
    with pytest.raises(RequestTimeout) as info:
        await model.infer(INPUT0=[1.0], DELAY_S=[delay_s], timeout_s=0.2)
    if delay_s < 600.0:
        raised = (await client.inference_statistics("slow_echo"))[0]
        assert (raised.inference_count, raised.success_count) == (before.inference_count, before.success_count)
    assert isinstance(info.value, TimeoutError)
    assert info.value.model == "slow_echo"
    # The same deadline from the client's default, through with_options (which shares the connection).
    quick = client.with_options(timeout_s=0.2)
    with pytest.raises(RequestTimeout):
        await (await quick.model("slow_echo")).infer(INPUT0=[1.0], DELAY_S=[delay_s])
    await quick.aclose()
    assert not client.is_closed
    # let the delayed requests drain so later tests find the single instance free
    await model.infer(INPUT0=[0.0], timeout_s=30)


async def test_grpc_cancellation_reaches_the_server(triton_server: LocalTriton) -> None:
    """Cancelling the awaiting task cancels the gRPC call: the model stops waiting, the next request is not delayed."""
    async with Client(triton_server.grpc_url) as client:
        model = await client.model("slow_echo")
        await model.infer(INPUT0=[0.0])
        task = asyncio.create_task(model.infer(INPUT0=[1.0], DELAY_S=[120.0]))
        # Give the request time to reach the single model instance; Triton shows no sign of a request running
        # (its statistics count a request once done), and the assertion below holds either way.
        await asyncio.sleep(0.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # Not delayed by the cancelled request: without the cancellation the instance would hold it for 120 s,
        # four times this call's own deadline.
        result = await model.infer(INPUT0=[2.0], timeout_s=30)
        assert result["OUTPUT0"].tolist() == [2.0]


async def test_server_stopped(tmp_path: Path) -> None:
    """A stopped server gives ConnectError over gRPC and HTTP; retries are bounded and counted."""
    repo = tmp_path / "repo"
    shutil.copytree(REPO / "scale_fp32", repo / "scale_fp32", ignore=shutil.ignore_patterns("__pycache__"))
    # Killed rather than stopped gracefully: with clients connected Triton waits out its exit timeout (10 s),
    # and how the server went away is not what this test is about.
    server = LocalTriton(repo, stop_grace_s=0)
    await server.astart()
    policy = RetryPolicy(max_attempts=3, initial_backoff_s=0.01)
    grpc_client = Client(server.grpc_url, retry=policy)
    counting = CountingTransport(grpc_client.transport)
    counted = Client(server.grpc_url, transport=counting, retry=policy)  # type: ignore[arg-type]
    http_client = Client(server.http_url, retry=policy)
    try:
        try:
            models = [await counted.model("scale_fp32"), await http_client.model("scale_fp32")]
            for m in models:
                assert (await m.infer(INPUT0=[1.0]))["OUTPUT0"].tolist() == [[2.0]]
        finally:
            await server.astop()
        counting.infer_calls = 0
        with pytest.raises(ConnectError) as info:
            await models[0].infer(INPUT0=[1.0])
        assert counting.infer_calls == 3
        assert info.value.model == "scale_fp32"
        with pytest.raises(ConnectError):
            await models[1].infer(INPUT0=[1.0])
    finally:
        for c in (grpc_client, http_client):
            await c.aclose()


# --- lifecycle, admin ------------------------------------------------------------------------------


async def test_closed_client(triton_server: LocalTriton) -> None:
    """aclose() is idempotent; any later call raises ClientClosedError (a RuntimeError)."""
    client = Client(triton_server.grpc_url)
    model = await client.model("scale_fp32")
    await client.aclose()
    await client.aclose()
    with pytest.raises(ClientClosedError):
        await client.is_server_ready()
    with pytest.raises(RuntimeError):
        await model.infer(INPUT0=[1.0])


async def test_health_metadata_and_statistics(client: Client) -> None:
    """Health, server metadata, wait_for_model_ready and statistics that count exactly our inferences."""
    assert await client.is_server_live()
    assert await client.is_server_ready()
    meta = await client.server_metadata()
    assert meta.name == "triton"
    assert meta.version.startswith("2.")
    await client.wait_for_model_ready("dtypes_echo", timeout_s=5)
    with pytest.raises(RequestTimeout):
        await client.wait_for_model_ready("no_such_model", timeout_s=0.3)
    model = await client.model("dtypes_echo")
    before = (await client.inference_statistics("dtypes_echo"))[0]
    for i in range(3):
        await model.infer(IN_INT64=[i])
    # Triton counts a request a moment after answering it (seen under load): read until the count has moved.
    for _ in range(500):
        after = (await client.inference_statistics("dtypes_echo"))[0]
        if after.success_count - before.success_count >= 3:
            break
    assert after.inference_count - before.inference_count == 3
    assert after.success_count - before.success_count == 3
    assert after.name == "dtypes_echo"
    assert after.version == "1"
    config = await client.model_config("scale_fp32")
    assert config["max_batch_size"] == 64
    metadata = await client.model_metadata("scale_fp32")
    assert metadata["inputs"][0]["name"] == "INPUT0"


async def test_channel_options_keep_message_size_defaults() -> None:
    """User channel options are merged over tritonclient's 2 GB message limits, not instead of them."""
    transport = GrpcTransport("127.0.0.1:1", channel_options={"grpc.keepalive_time_ms": 10_000})
    options = dict(transport.channel_options)
    await transport.aclose()
    assert options["grpc.keepalive_time_ms"] == 10_000
    assert options["grpc.max_receive_message_length"] == 2**31 - 1
    assert options["grpc.max_send_message_length"] == 2**31 - 1


async def test_url_schemes() -> None:
    """Only grpc/grpcs/http/https URLs are accepted; default ports fill in."""
    with pytest.raises(UsageError, match="scheme"):
        Client("ftp://x:1")
    for url, target in (("grpc://example.org", "example.org:8001"), ("http://example.org", "example.org:8000")):
        async with Client(url) as c:
            assert c.config.target() == target


async def test_with_options_keeps_headers_and_shares_the_connection() -> None:
    """with_options() on a client made with headers copies it (the frozen headers are pairs, not a dict)."""
    async with Client("grpc://127.0.0.1:1", headers={"x-api-key": "k"}) as client:
        copy = client.with_options(timeout_s=2)
        assert copy.config.headers == (("x-api-key", "k"),)
        assert copy.config.timeout_s == 2
        assert copy.transport is client.transport
        other = client.with_options(headers={"x-api-key": "other"})
        try:
            assert other.transport is not client.transport
            assert other.config.headers == (("x-api-key", "other"),)
        finally:
            await other.aclose()
