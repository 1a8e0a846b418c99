"""Client-side batching (``Client(coalescing=Coalescing())``) against the real server, plus merge/split."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from triton_npu_client import Client, ClientClosedError, Coalescing, InferResult, LocalTriton, Model
from triton_npu_client._call._coalesce import merge, split
from triton_npu_client._model import ModelSpec

MODEL = "scale_fp32"


def _url(server: LocalTriton, protocol: str) -> str:
    return server.grpc_url if protocol == "grpc" else server.http_url


async def _counts(client: Client) -> tuple[int, int]:
    """(requests the server answered, rows it inferred) for MODEL so far."""
    stats = await client.inference_statistics(MODEL)
    return sum(s.success_count for s in stats), sum(s.inference_count for s in stats)


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
        after = await _counts(client)
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
        after = await _counts(client)
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
    m = Model.__new__(Model)
    m._spec = spec  # builders only: no client needed
    one = m.request(T=["a", "b\x00"])
    two = m.batch_request(T=[["c", "d"], ["\u00e9", ""]])
    merged = merge([one, two])
    assert merged.batch_size == 3
    assert merged.inputs[0].shape == (3, 2)
    arr = merged.arrays()["T"]
    parts = split(InferResult(model="m", outputs={"T": arr}), [1, 2])
    assert parts[0]["T"].tolist() == [[b"a", b"b\x00"]]
    assert parts[1]["T"].tolist() == [[b"c", b"d"], ["\u00e9".encode(), b""]]
