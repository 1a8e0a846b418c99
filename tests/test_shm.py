"""SharedMemoryPool against the real server: same results as the plain path, bounded slots, growth, cleanup, crashes."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest
import tritonclient.grpc as tgrpc
from tritonclient.grpc import _utils as tgrpc_utils
from tritonclient.grpc import service_pb2

from triton_npu_client import (
    BatchSizeError,
    Client,
    ClientClosedError,
    InputDtypeError,
    LocalTriton,
    MissingInputError,
    Model,
    SequenceSpec,
    SharedMemoryPool,
    UnknownInputError,
    UnknownOutputError,
    UsageError,
)
from triton_npu_client._client._shm import PREFIX
from triton_npu_client._transport import GrpcTransport
from triton_npu_client._wire import InferRequest, ShmPlace

ROOT = Path(__file__).resolve().parent.parent
DEV_SHM = Path("/dev/shm")


@pytest.fixture
async def client(triton_server: LocalTriton) -> AsyncIterator[Client]:
    async with Client(triton_server.grpc_url, timeout_s=60.0) as c:
        yield c


def _grpc(client: Client) -> GrpcTransport:
    transport = client.transport
    assert isinstance(transport, GrpcTransport)
    return transport


async def _on_server(client: Client) -> set[str]:
    return {str(r["name"]) for r in await _grpc(client).system_shared_memory_status(timeout_s=30)}


def _in_dev_shm(names: tuple[str, ...] | list[str]) -> set[str]:
    return {n for n in names if (DEV_SHM / n).exists()}


def _mine() -> set[str]:
    """This process's region files in /dev/shm."""
    return {p.name for p in DEV_SHM.iterdir() if p.name.startswith(f"{PREFIX}{os.getpid()}-")}


# -- the wire form -----------------------------------------------------------------------------------------------


def test_shm_request_bytes_parse_like_tritonclients_request() -> None:
    """Inputs in regions and outputs placed or not: the same ModelInferRequest tritonclient builds for it."""
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    request = InferRequest(model="m", version="2", outputs=("A", "B"))
    request = attrs.evolve(
        request,
        inputs=(
            *request.inputs,
            *_encoded([("X", "FP32", x), ("S", "BYTES", np.array([[b"ab"], [b"c"]], dtype=object))]),
        ),
    )
    ours = service_pb2.ModelInferRequest.FromString(
        request.grpc_shm_bytes(
            [ShmPlace("in", 24), ShmPlace("in", 11, 64)],
            [("A", ShmPlace("out", 24, 128)), ("B", None)],
            timeout_us=5_000,
        )
    )
    inputs = [tgrpc.InferInput("X", [2, 3], "FP32"), tgrpc.InferInput("S", [2, 1], "BYTES")]
    inputs[0].set_shared_memory("in", 24)
    inputs[1].set_shared_memory("in", 11, offset=64)
    outputs = [tgrpc.InferRequestedOutput("A"), tgrpc.InferRequestedOutput("B")]
    outputs[0].set_shared_memory("out", 24, offset=128)
    theirs = tgrpc_utils._get_inference_request(
        model_name="m", inputs=inputs, model_version="2", request_id="", outputs=outputs, sequence_id=0,
        sequence_start=False, sequence_end=False, priority=0, timeout=5_000, parameters=None,
    )  # fmt: skip
    assert ours == theirs
    assert len(ours.raw_input_contents) == 0
    # Without outputs given: those of the request, none placed.
    plain_out = service_pb2.ModelInferRequest.FromString(request.grpc_shm_bytes([ShmPlace("a", 1), ShmPlace("b", 2)]))
    assert [(o.name, dict(o.parameters)) for o in plain_out.outputs] == [("A", {}), ("B", {})]
    with pytest.raises(ValueError, match="2 inputs"):
        request.grpc_shm_bytes([ShmPlace("a", 1)])


def _encoded(items: list[tuple[str, str, np.ndarray[Any, Any]]]) -> list[Any]:
    from triton_npu_client._wire import EncodedInput, to_wire

    return [
        EncodedInput(name=n, dtype=d, shape=tuple(a.shape), data=to_wire(a, d), array=a) for n, d, a in items
    ]


# -- results ------------------------------------------------------------------------------------------------------

ECHO: dict[str, np.ndarray[Any, Any]] = {
    "FP32": np.array([[-1.5, 3.25e-38, 2.0], [7.0, -0.0, np.inf]], np.float32),
    "INT64": np.array([[-(2**63), 0, 2**63 - 1]], np.int64),
    "FP16": np.array([[-65504.0, 0.5], [np.inf, 1.0], [2.0, 3.0]], np.float16),
    "BOOL": np.array([[True, False, True, True]]),
    "UINT8": np.array([[0, 1, 255], [3, 4, 5]], np.uint8),
    "BF16": np.array([[1.5, -2.0, 2.0**127]], np.float32),
    "BYTES": np.array([[b"a\x00b", "h\u00e9llo".encode(), b""], [b"\xff", b"xyz", b"1234567"]], dtype=object),
}


@pytest.mark.parametrize("dtype", list(ECHO))
async def test_results_equal_the_plain_path(client: Client, dtype: str) -> None:
    """dtypes_echo through a pool equals model.infer_batch, the first time (outputs learned) and after (in shm)."""
    model = await client.model("dtypes_echo")
    arrays = {f"IN_{dtype}": ECHO[dtype]}
    async with await SharedMemoryPool.open(model, slots=1) as pool:
        for _ in range(3):
            got = await pool.infer_batch(arrays)
            assert got == await model.infer_batch(arrays)
            assert list(got.outputs) == [f"OUT_{dtype}"]
            assert got[f"OUT_{dtype}"].shape == ECHO[dtype].shape
        stats = pool.stats()
    assert stats.requests == 3
    # BYTES outputs always travel in the response (their size depends on content); others land in the region.
    assert (stats.outputs_plain, stats.outputs_in_shm) == ((3, 0) if dtype == "BYTES" else (1, 2))


async def test_several_inputs_and_outputs_share_a_slot(client: Client) -> None:
    """Four inputs, four outputs: each lies at its own offset in the slot's regions and comes back as itself."""
    model = await client.model("dtypes_echo")
    arrays = {f"IN_{d}": np.repeat(ECHO[d][:1], 3, axis=0) for d in ("UINT8", "FP32", "BYTES", "INT64")}
    async with await SharedMemoryPool.open(model, slots=1) as pool:
        for _ in range(2):
            got = await pool.infer_batch(arrays)
            assert got == await model.infer_batch(arrays)
            assert set(got.outputs) == {f"OUT_{d}" for d in ("UINT8", "FP32", "BYTES", "INT64")}
        assert pool.stats().outputs_in_shm == 3


async def test_scale_fp32_values_and_named_outputs(client: Client) -> None:
    """OUTPUT0 = 2 * INPUT0 through the regions, with outputs asked for by name too."""
    model = await client.model("scale_fp32")
    x = np.random.default_rng(0).standard_normal((5, 300)).astype(np.float32)
    async with await SharedMemoryPool.open(model, slots=2) as pool:
        for outputs in (None, ["OUTPUT0"], None, ["OUTPUT0"]):
            got = await pool.infer_batch({"INPUT0": x}, outputs=outputs)
            np.testing.assert_array_equal(got["OUTPUT0"], 2 * x)
            assert got.model == "scale_fp32"
        assert pool.stats().outputs_in_shm == 2


# -- concurrency, growth --------------------------------------------------------------------------------------------


async def test_more_requests_than_slots_never_mix_rows(client: Client, seed: Callable[[int], int]) -> None:
    """32 concurrent requests on 3 slots: at most 3 in flight, every caller gets 2x its own rows."""
    model = await client.model("scale_fp32")
    rng = np.random.default_rng(seed(1))
    batches = [rng.standard_normal((1 + i % 7, 64 + 16 * (i % 5))).astype(np.float32) + 100 * i for i in range(32)]
    async with await SharedMemoryPool.open(model, slots=3) as pool:
        results = await asyncio.gather(*(pool.infer_batch({"INPUT0": b}) for b in batches))
        for batch, result in zip(batches, results, strict=True):
            np.testing.assert_array_equal(result["OUTPUT0"], 2 * batch)
        stats = pool.stats()
    assert stats.peak_in_use == 3
    assert stats.requests == 32
    assert stats.in_use == 0


async def test_a_region_grows_for_a_bigger_request(client: Client) -> None:
    """Rows of 1 MB outgrow the first regions: new bigger ones replace them, the old ones leave server and host."""
    model = await client.model("scale_fp32")
    async with await SharedMemoryPool.open(model, slots=1, initial_bytes=8192) as pool:
        small = np.ones((2, 16), np.float32)
        np.testing.assert_array_equal((await pool.infer_batch({"INPUT0": small}))["OUTPUT0"], 2 * small)
        first = pool.region_names()
        assert pool.stats().region_bytes == ((8192, 8192),)
        big = np.random.default_rng(2).standard_normal((3, 262_144)).astype(np.float32)
        for _ in range(2):  # the first learns the output size, the second puts the output in the region
            np.testing.assert_array_equal((await pool.infer_batch({"INPUT0": big}))["OUTPUT0"], 2 * big)
        stats = pool.stats()
        ((in_bytes, out_bytes),) = stats.region_bytes
        assert in_bytes >= big.nbytes
        assert out_bytes >= big.nbytes
        assert stats.regions_grown == 2
        assert stats.outputs_in_shm == 1
        assert _in_dev_shm(first) == set()
        assert set(first) & await _on_server(client) == set()
        assert set(pool.region_names()) <= await _on_server(client)


# -- errors -------------------------------------------------------------------------------------------------------

BAD: list[tuple[str, dict[str, Any], dict[str, Any], type[Exception]]] = [
    ("unknown input", {"INPUT0": np.ones((1, 2), np.float32), "NOPE": np.ones(1)}, {}, UnknownInputError),
    ("missing input", {}, {}, MissingInputError),
    ("lossy dtype", {"INPUT0": np.ones((1, 2), np.float64)}, {}, InputDtypeError),
    ("no batch dim", {"INPUT0": np.ones(2, np.float32)}, {}, BatchSizeError),
    ("batch too big", {"INPUT0": np.ones((65, 2), np.float32)}, {}, BatchSizeError),
    ("bad shape", {"INPUT0": np.ones((1, 2, 2), np.float32)}, {}, BatchSizeError),
    ("unknown output", {"INPUT0": np.ones((1, 2), np.float32)}, {"outputs": ["NOPE"]}, UnknownOutputError),
]


async def test_bad_input_refused_like_the_plain_path_and_the_pool_goes_on(client: Client) -> None:
    """Each bad input raises the class and message model.infer_batch raises, sends nothing, holds no slot."""
    model = await client.model("scale_fp32")
    before = (await client.inference_statistics("scale_fp32"))[0].inference_count
    async with await SharedMemoryPool.open(model, slots=1) as pool:
        for case, arrays, options, error in BAD:
            with pytest.raises(error) as plain:
                await model.infer_batch(arrays, **options)
            with pytest.raises(error) as ours:
                await pool.infer_batch(arrays, **options)
            assert type(ours.value) is type(plain.value), case
            assert str(ours.value) == str(plain.value), case
        assert (await client.inference_statistics("scale_fp32"))[0].inference_count == before
        assert pool.stats().in_use == 0
        x = np.ones((2, 3), np.float32)
        np.testing.assert_array_equal((await pool.infer_batch({"INPUT0": x}))["OUTPUT0"], 2 * x)


async def test_refused_at_open(triton_server: LocalTriton, client: Client) -> None:
    """HTTP clients, decoupled and stateful models and slots < 1 are refused before any region exists."""
    before = _mine()
    async with Client(triton_server.http_url) as http:
        with pytest.raises(UsageError, match=r"needs a gRPC client \(grpc://\); this client speaks http"):
            await SharedMemoryPool.open(await http.model("scale_fp32"), slots=2)
    model = await client.model("scale_fp32")
    decoupled = Model(model.caller, attrs.evolve(model.spec, decoupled=True))
    with pytest.raises(UsageError, match="decoupled"):
        await SharedMemoryPool.open(decoupled, slots=1)
    stateful = Model(model.caller, attrs.evolve(model.spec, sequence=SequenceSpec(strategy="oldest")))
    with pytest.raises(UsageError, match="stateful"):
        await SharedMemoryPool.open(stateful, slots=1)
    with pytest.raises(UsageError, match="slots must be >= 1"):
        await SharedMemoryPool.open(model, slots=0)
    assert _mine() == before


async def test_unregistering_no_name_is_refused(client: Client) -> None:
    """An empty region name means "every region" to Triton: the transport refuses it, and nothing is unregistered."""
    model = await client.model("scale_fp32")
    async with await SharedMemoryPool.open(model, slots=1) as pool:
        with pytest.raises(UsageError, match="needs a region name"):
            await _grpc(client).unregister_system_shared_memory("", timeout_s=30)
        assert set(pool.region_names()) <= await _on_server(client)


async def test_regions_the_server_forgot_are_registered_again(client: Client) -> None:
    """After the server drops the pool's registrations (as a restarted server has none), requests still succeed."""
    model = await client.model("scale_fp32")
    async with await SharedMemoryPool.open(model, slots=1) as pool:
        for name in pool.region_names():
            await _grpc(client).unregister_system_shared_memory(name, timeout_s=30)
        x = np.full((2, 5), 3.0, np.float32)
        np.testing.assert_array_equal((await pool.infer_batch({"INPUT0": x}))["OUTPUT0"], 2 * x)
        assert pool.stats().reregistered == 2
        assert set(pool.region_names()) <= await _on_server(client)


async def test_a_learned_output_size_that_no_longer_fits_falls_back_to_the_response(client: Client) -> None:
    """An output bigger than learned (value-dependent shapes) is refused by the server; the pool resends plainly."""
    model = await client.model("scale_fp32")
    x = np.ones((2, 100), np.float32)
    async with await SharedMemoryPool.open(model, slots=1) as pool:
        await pool.infer_batch({"INPUT0": x})
        # What a model whose output shape depends on values looks like to the pool: a size learned too small.
        ((signature, learned),) = pool._learned.items()
        pool._learned[signature] = tuple((name, dtype, 8) for name, dtype, _ in learned)
        np.testing.assert_array_equal((await pool.infer_batch({"INPUT0": x}))["OUTPUT0"], 2 * x)
        np.testing.assert_array_equal((await pool.infer_batch({"INPUT0": x}))["OUTPUT0"], 2 * x)
        assert pool._learned[signature] == learned
        stats = pool.stats()
    assert (stats.outputs_plain, stats.outputs_in_shm) == (2, 1)


# -- cleanup ------------------------------------------------------------------------------------------------------


async def test_aclose_leaves_nothing_also_on_an_exception(client: Client) -> None:
    """After aclose (here through ``async with`` left by an exception) no region is on the host or the server."""
    model = await client.model("scale_fp32")
    pool = await SharedMemoryPool.open(model, slots=2)
    names = pool.region_names()
    assert len(names) == 4
    assert _in_dev_shm(names) == set(names)
    assert set(names) <= await _on_server(client)

    async def use_then_fail() -> None:
        async with pool:
            await pool.infer_batch({"INPUT0": np.ones((1, 4), np.float32)})
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        await use_then_fail()
    assert pool.is_closed
    assert _in_dev_shm(names) == set()
    assert set(names) & await _on_server(client) == set()
    await pool.aclose()  # idempotent
    with pytest.raises(ClientClosedError):
        await pool.infer_batch({"INPUT0": np.ones((1, 4), np.float32)})


async def test_aclose_waits_for_requests_in_flight(client: Client) -> None:
    """aclose while requests run: they finish with their results, and the regions go after them."""
    model = await client.model("scale_fp32")
    pool = await SharedMemoryPool.open(model, slots=2)
    batches = [np.full((4, 50_000), i, np.float32) for i in range(6)]
    tasks = [asyncio.create_task(pool.infer_batch({"INPUT0": b})) for b in batches]
    await asyncio.sleep(0)  # let the first two take their slots
    assert pool.stats().in_use == 2
    await pool.aclose()
    outcomes = await asyncio.gather(*tasks, return_exceptions=True)
    done = [(b, r) for b, r in zip(batches, outcomes, strict=True) if not isinstance(r, BaseException)]
    refused = [r for r in outcomes if isinstance(r, BaseException)]
    assert len(done) == 2
    for batch, result in done:
        np.testing.assert_array_equal(result["OUTPUT0"], 2 * batch)
    assert all(isinstance(r, ClientClosedError) for r in refused), [repr(r) for r in refused]
    assert _mine() == set()


async def test_aclose_fails_every_waiter_when_two_slots_come_back_at_once(client: Client) -> None:
    """Two slots released in one loop pass while aclose waits first in line: every waiter still gets
    ClientClosedError at once (it used to keep one woken waiter, and those behind it, until their deadline).

    The slots are held through the pool's own _acquire, so that both come back in one synchronous step, as two
    responses that arrive together on a busy machine do.
    """
    model = await client.model("scale_fp32")
    pool = await SharedMemoryPool.open(model, slots=2)
    held = [await pool._acquire(None), await pool._acquire(None)]
    waiters = [asyncio.create_task(pool.infer_batch({"INPUT0": np.ones((1, 4), np.float32)}, timeout_s=30))]
    waiters += [asyncio.create_task(pool.infer_batch({"INPUT0": np.ones((1, 4), np.float32)}, timeout_s=30))]
    closing = asyncio.create_task(pool.aclose())
    while len(pool._free._getters) < 1 + len(waiters):  # type: ignore[attr-defined]
        await asyncio.sleep(0)  # until aclose and both waiters wait for a slot, aclose first in line
    for slot in held:
        pool._in_use -= 1
        pool._free.put_nowait(slot)
    outcomes = await asyncio.wait_for(asyncio.gather(*waiters, return_exceptions=True), 10)
    await closing
    assert [type(o) for o in outcomes] == [ClientClosedError, ClientClosedError], outcomes
    assert _mine() == set()


_CHILD = """
import asyncio, json, sys
import numpy as np
from triton_npu_client import Client, SharedMemoryPool

KEEP = []

async def main(url, mode):
    async with Client(url) as client:
        pool = await SharedMemoryPool.open(await client.model("scale_fp32"), slots=2)
        x = np.ones((2, 8), np.float32)
        assert (await pool.infer_batch({"INPUT0": x}))["OUTPUT0"].tolist() == (2 * x).tolist()
        print(json.dumps(pool.region_names()), flush=True)
        if mode == "hold":
            await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        KEEP.append(pool)  # mode "forget": never closed, alive until the interpreter exits

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


def _child(url: str, mode: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", _CHILD, url, mode], cwd=ROOT, text=True,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip


async def test_regions_of_a_sigkilled_process_are_swept_by_the_next_open(
    triton_server: LocalTriton, client: Client
) -> None:
    """SIGKILL to a process holding a pool (and its whole group: no helper survives to tidy up); the next open()
    removes its regions from /dev/shm and from the server."""
    proc = _child(triton_server.grpc_url, "hold")
    try:
        assert proc.stdout is not None
        line = await asyncio.to_thread(proc.stdout.readline)
        assert line, proc.stderr.read() if proc.stderr else ""
        names = json.loads(line)
        assert len(names) == 4
        assert all(n.startswith(f"{PREFIX}{proc.pid}-") for n in names)
        assert _in_dev_shm(names) == set(names)
        assert set(names) <= await _on_server(client)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        await asyncio.to_thread(proc.communicate, timeout=60)
    assert proc.returncode == -signal.SIGKILL
    # Nothing cleaned up after the kill: what the sweep finds is all there.
    assert _in_dev_shm(names) == set(names)
    assert set(names) <= await _on_server(client)
    pool = await SharedMemoryPool.open(await client.model("scale_fp32"), slots=1)
    try:
        assert _in_dev_shm(names) == set()
        assert set(names) & await _on_server(client) == set()
        assert pool.stats().swept >= len(names)
        # The sweep spares the living: this pool's own regions stay.
        assert set(pool.region_names()) <= await _on_server(client)
        assert _in_dev_shm(pool.region_names()) == set(pool.region_names())
    finally:
        await pool.aclose()


async def test_a_forgotten_pool_is_cleaned_up_at_exit(triton_server: LocalTriton, client: Client) -> None:
    """A process that never calls aclose() still leaves no region on the host or the server when it exits."""
    proc = _child(triton_server.grpc_url, "forget")
    out, err = await asyncio.to_thread(proc.communicate, timeout=120)
    assert proc.returncode == 0, err[-3000:]
    names = json.loads(out)
    assert len(names) == 4
    assert _in_dev_shm(names) == set()
    assert set(names) & await _on_server(client) == set()
    assert "leaked shared_memory" not in err


# -- the benchmark script ------------------------------------------------------------------------------------------


def test_bench_quick(triton_server: LocalTriton, tmp_path: Path) -> None:
    """bench/shm.py --quick checks both paths' answers, measures both, and prints a row per batch size."""
    out = tmp_path / "rows.json"
    url = f"127.0.0.1:{triton_server.grpc_port}"
    proc = subprocess.run(
        [sys.executable, "bench/shm.py", "--quick", "--url", url, "--batch-sizes", "1", "3", "--floats", "65536",
         "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["batch"] for r in rows] == [1, 3]
    assert all(r["plain_rows_s"] > 0 and r["shm_rows_s"] > 0 for r in rows)
    assert all(r["ratio"] == pytest.approx(r["shm_rows_s"] / r["plain_rows_s"]) for r in rows)
    assert proc.stdout.startswith("python bench/shm.py --quick")
    assert [line.split("|")[1].strip() for line in proc.stdout.splitlines() if line.startswith("|")][2:] == ["1", "3"]
