"""The seq_stats_* models through a real Triton, with raw tritonclient grpc.aio (not the SDK client).

Each model keeps running mean / population variance / count per sequence and reports LIVE, the
sequences its instance holds after the execute. Other tests share the session server and may leave
sequences for the sweep to collect, so "back to zero" is asserted as "back to the baseline or below".
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import tritonclient.grpc as grpc_sync
import tritonclient.grpc.aio as grpcclient
from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2
from tritonclient.utils import InferenceServerException

from tools.perf_analyzer import ensure_perf_analyzer, run_perf_analyzer
from triton_npu_client import LocalTriton, default_model_repository
from triton_npu_client._protocol import SEQUENCE_CAPACITY, SEQUENCE_UNKNOWN

MODELS = ["seq_stats_oldest", "seq_stats_direct", "seq_stats_string"]
DIM = 4


class Step:
    """One response: the sequence's statistics so far and the instance's live-sequence count."""

    def __init__(self, result: grpcclient.InferResult) -> None:
        self.mean = result.as_numpy("MEAN")[0]
        self.var = result.as_numpy("VAR")[0]
        self.count = int(result.as_numpy("COUNT")[0, 0])
        self.live = int(result.as_numpy("LIVE")[0, 0])


def seq_id(model: str, n: int) -> int | str:
    return f"s-{n}-é" if model == "seq_stats_string" else 1_000_000 + n


async def infer_step(
    client: grpcclient.InferenceServerClient, model: str, sid: int | str, x: npt.NDArray[Any], *, start: bool, end: bool
) -> Step:
    inp = grpcclient.InferInput("X", [1, DIM], "FP32")
    inp.set_data_from_numpy(np.asarray(x, np.float32).reshape(1, DIM))
    return Step(await client.infer(model, [inp], sequence_id=sid, sequence_start=start, sequence_end=end))


async def live_now(client: grpcclient.InferenceServerClient, model: str, sid: int | str) -> int:
    """Live sequences besides a one-request probe sequence (its own END is already counted out)."""
    return (await infer_step(client, model, sid, np.zeros(DIM), start=True, end=True)).live


@pytest.fixture
async def client(triton_server: LocalTriton) -> AsyncIterator[grpcclient.InferenceServerClient]:
    c = grpcclient.InferenceServerClient(f"127.0.0.1:{triton_server.grpc_port}")
    try:
        yield c
    finally:
        await c.close()


@pytest.mark.parametrize("model", MODELS)
async def test_interleaved_sequences_get_their_own_statistics(
    client: grpcclient.InferenceServerClient, model: str, seed: Callable[[int], int]
) -> None:
    """Interleaved sequences of different lengths each get numpy's mean/var/count of their own inputs."""
    rng = np.random.default_rng(seed(4))
    baseline = await live_now(client, model, seq_id(model, 999))
    lengths = [3, 7, 1, 5, 7, 2, 6, 4]
    data = {seq_id(model, n): rng.normal(size=(length, DIM)) * 5 for n, length in enumerate(lengths)}
    last: dict[int | str, Step] = {}

    async def run(sid: int | str, xs: npt.NDArray[Any]) -> None:
        for k, x in enumerate(xs):
            last[sid] = await infer_step(client, model, sid, x, start=k == 0, end=k == len(xs) - 1)
            assert last[sid].count == k + 1
            await asyncio.sleep(0)  # let the other sequences' steps interleave with ours

    await asyncio.gather(*(run(sid, xs) for sid, xs in data.items()))
    for sid, xs in data.items():
        np.testing.assert_allclose(last[sid].mean, xs.mean(axis=0), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(last[sid].var, xs.var(axis=0), rtol=1e-4, atol=1e-4)
    assert await live_now(client, model, seq_id(model, 998)) <= baseline


@pytest.mark.parametrize("model", MODELS)
async def test_one_request_sequence(client: grpcclient.InferenceServerClient, model: str) -> None:
    """START and END in one request: count 1, mean = the input, variance 0, and the slot is freed."""
    x = np.array([1.5, -2.0, 3.25, 0.0])
    before = await live_now(client, model, seq_id(model, 501))
    one = await infer_step(client, model, seq_id(model, 500), x, start=True, end=True)
    assert one.count == 1
    np.testing.assert_array_equal(one.mean, x.astype(np.float32))
    np.testing.assert_array_equal(one.var, np.zeros(DIM, np.float32))
    assert one.live <= before


@pytest.mark.parametrize("model", MODELS)
async def test_live_count_rises_and_returns(client: grpcclient.InferenceServerClient, model: str) -> None:
    """LIVE counts open sequences (+5 while open) and drops back once they all END."""
    baseline = await live_now(client, model, seq_id(model, 600))
    ids = [seq_id(model, 610 + n) for n in range(5)]
    for sid in ids:
        await infer_step(client, model, sid, np.ones(DIM), start=True, end=False)
    assert await live_now(client, model, seq_id(model, 601)) >= baseline + 5
    for sid in ids:
        await infer_step(client, model, sid, np.ones(DIM), start=False, end=True)
    assert await live_now(client, model, seq_id(model, 602)) <= baseline


async def test_oldest_strategy_really_batches(client: grpcclient.InferenceServerClient) -> None:
    """Under 32 concurrent sequences the server runs far fewer executions than inferences."""
    model = "seq_stats_oldest"

    async def counts() -> tuple[int, int]:
        stats = (await client.get_inference_statistics(model)).model_stats[0]
        return int(stats.inference_count), int(stats.execution_count)

    inf0, exe0 = await counts()

    async def run(sid: int) -> None:
        for k in range(6):
            await infer_step(client, model, sid, np.full(DIM, k), start=k == 0, end=k == 5)

    await asyncio.gather(*(run(2_000_000 + n) for n in range(32)))
    # Triton counts a request once its response has gone out, so the last ones may not be counted yet when the
    # client has them: read until all are (the event itself), never longer than the deadline.
    deadline = time.monotonic() + 30
    while (inf1 := (await counts())[0]) - inf0 < 32 * 6 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    inf1, exe1 = await counts()
    assert inf1 - inf0 == 32 * 6
    assert exe1 - exe0 <= (inf1 - inf0) // 3, f"{exe1 - exe0} executions for {inf1 - inf0} inferences"


async def test_direct_dummy_slots_leave_state_alone(
    client: grpcclient.InferenceServerClient, seed: Callable[[int], int]
) -> None:
    """Direct strategy: after neighbours end (their slots then padded with dummies), a sequence's state is exact."""
    model = "seq_stats_direct"
    rng = np.random.default_rng(seed(7))
    ids = [3_000_000 + n for n in range(4)]
    long_xs = rng.normal(size=(12, DIM))
    # Four sequences take slots 0..3; the first three end after two steps, the last keeps going alone.
    for k in range(2):
        await asyncio.gather(
            *(
                infer_step(client, model, sid, long_xs[k] if sid == ids[-1] else np.ones(DIM), start=k == 0, end=False)
                for sid in ids
            )
        )
    await asyncio.gather(*(infer_step(client, model, sid, np.ones(DIM), start=False, end=True) for sid in ids[:-1]))
    step = None
    for k in range(2, 12):
        step = await infer_step(client, model, ids[-1], long_xs[k], start=False, end=k == 11)
    assert step is not None
    assert step.count == 12
    np.testing.assert_allclose(step.mean, long_xs.mean(axis=0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(step.var, long_xs.var(axis=0), rtol=1e-4, atol=1e-4)


async def test_string_model_keeps_string_and_integer_ids_apart(client: grpcclient.InferenceServerClient) -> None:
    """On the string-id model, the ids "77" and 77 are two sequences with their own state."""
    model = "seq_stats_string"
    await infer_step(client, model, "77", np.full(DIM, 1.0), start=True, end=False)
    await infer_step(client, model, 77, np.full(DIM, 5.0), start=True, end=False)
    as_str = await infer_step(client, model, "77", np.full(DIM, 3.0), start=False, end=True)
    as_int = await infer_step(client, model, 77, np.full(DIM, 7.0), start=False, end=True)
    np.testing.assert_array_equal(as_str.mean, np.full(DIM, 2.0, np.float32))
    np.testing.assert_array_equal(as_int.mean, np.full(DIM, 6.0, np.float32))


@pytest.mark.parametrize("model", MODELS)
def test_perf_analyzer_sequences_without_errors(triton_server: LocalTriton, model: str) -> None:
    """perf_analyzer in sequence mode (length 20, 8 concurrent sequences) runs each stateful model with 0 errors."""
    pa = ensure_perf_analyzer()
    result = run_perf_analyzer(
        pa,
        [
            "-m",
            model,
            "-u",
            f"127.0.0.1:{triton_server.grpc_port}",
            "-i",
            "grpc",
            "--sequence-length",
            "20",
            "--sequence-id-range",
            "100000:200000",
            "--concurrency-range",
            "8",
            "--measurement-mode",
            "count_windows",
            "--measurement-request-count",
            "200",
            # A shared 2-core machine is noisy: accept any three windows rather than fail on stability.
            "--stability-percentage",
            "1000",
        ],
        timeout_s=120,
    )
    # perf_analyzer's own lines for each failed request (what the server answered), should any fail.
    assert result.errors == 0, [line for line in result.output.splitlines() if "error" in line.lower()]
    assert result.throughput_infer_s > 0
    assert result.server_inference_count > 0


# --- a small twin of seq_stats_oldest for what needs a small cap and a short idle timeout --------------------

# Loaded on the session server with Triton's load-with-override (config and model.py sent in the load request):
# a second server for it would cost a start and a stop, seconds each. The name is not in server_models/, so
# the repository index never lists it, and the module unloads it when it is done.
SMALL = "seq_stats_small"


def small_config() -> str:
    """seq_stats_oldest's config.pbtxt with max_sequences 3 and a 1 s idle timeout (0.2 s sweep grace), as JSON."""
    config = (default_model_repository() / "seq_stats_oldest" / "config.pbtxt").read_text()
    for old, new in [
        ('name: "seq_stats_oldest"', f'name: "{SMALL}"'),
        ("max_sequence_idle_microseconds: 3000000", "max_sequence_idle_microseconds: 1000000"),
        ('key: "max_sequences" value: { string_value: "4096" }', 'key: "max_sequences" value: { string_value: "3" }'),
        (
            'key: "sweep_grace_us" value: { string_value: "500000" }',
            'key: "sweep_grace_us" value: { string_value: "200000" }',
        ),
    ]:
        assert old in config, old
        config = config.replace(old, new)
    return json_format.MessageToJson(text_format.Parse(config, model_config_pb2.ModelConfig()))


@pytest.fixture(scope="module")
def small_server(triton_server: LocalTriton) -> Iterator[LocalTriton]:
    """The session server with SMALL loaded for this module."""
    model_py = (default_model_repository() / "seq_stats_oldest" / "1" / "model.py").read_bytes()
    admin = grpc_sync.InferenceServerClient(f"127.0.0.1:{triton_server.grpc_port}")
    try:
        admin.load_model(SMALL, config=small_config(), files={"file:1/model.py": model_py})
        yield triton_server
    finally:
        admin.unload_model(SMALL)
        admin.close()


@pytest.fixture
async def small_client(small_server: LocalTriton) -> AsyncIterator[grpcclient.InferenceServerClient]:
    c = grpcclient.InferenceServerClient(f"127.0.0.1:{small_server.grpc_port}")
    try:
        yield c
    finally:
        await c.close()


async def test_cap_refuses_start_clearly_and_others_go_on(small_client: grpcclient.InferenceServerClient) -> None:
    """A 4th START over a cap of 3 gets UNAVAILABLE naming the cap; the 3 go on; after an END a new one fits."""
    model = SMALL
    for sid in (11, 12, 13):
        await infer_step(small_client, model, sid, np.ones(DIM), start=True, end=False)
    results = await asyncio.gather(
        infer_step(small_client, model, 14, np.ones(DIM), start=True, end=False),
        *(infer_step(small_client, model, sid, np.full(DIM, 3.0), start=False, end=False) for sid in (11, 12, 13)),
        return_exceptions=True,
    )
    refused, *others = results
    assert isinstance(refused, InferenceServerException)
    assert "cap of 3" in str(refused.message())
    assert refused.status() == "StatusCode.UNAVAILABLE"
    for other in others:
        assert isinstance(other, Step)
        assert (other.count, other.live) == (2, 3)
        np.testing.assert_array_equal(other.mean, np.full(DIM, 2.0, np.float32))
    await infer_step(small_client, model, 11, np.ones(DIM), start=False, end=True)
    fresh = await infer_step(small_client, model, 15, np.ones(DIM), start=True, end=False)
    assert (fresh.count, fresh.live) == (1, 3)
    for sid in (12, 13, 14, 15):
        # 14's START was refused by the model but Triton saw it: END it so the batcher lets it go too.
        await asyncio.gather(
            infer_step(small_client, model, sid, np.ones(DIM), start=False, end=True), return_exceptions=True
        )
    assert await live_now(small_client, model, 16) == 0


async def test_idle_sequence_is_swept(small_client: grpcclient.InferenceServerClient) -> None:
    """A sequence left idle past the 1 s timeout (+0.2 s grace) is freed: LIVE drops and its next step fails."""
    model = SMALL
    assert await live_now(small_client, model, 20) == 0
    await infer_step(small_client, model, 21, np.ones(DIM), start=True, end=False)
    assert await live_now(small_client, model, 22) == 1
    # The real timeout is the only clock the server has (short here by construction): wait for the sweep it
    # causes, seen in LIVE (each probe is a one-request sequence, and a model's execute is when it sweeps).
    deadline = time.monotonic() + 60.0
    while (live := await live_now(small_client, model, 23)) != 0:
        assert time.monotonic() < deadline, f"LIVE still {live} 60 s after the 1 s idle timeout"
        await asyncio.sleep(0.05)
    with pytest.raises(InferenceServerException, match="START"):
        await infer_step(small_client, model, 21, np.ones(DIM), start=False, end=True)


# --- refusal markers over unary gRPC ----------------------------------------------------------------


async def test_refusals_carry_stable_markers(small_client: grpcclient.InferenceServerClient) -> None:
    """Over unary gRPC the cap refusal starts with the capacity marker (UNAVAILABLE), the unknown one with its own."""
    model = SMALL
    assert await live_now(small_client, model, 30) == 0
    for sid in (31, 32, 33):
        await infer_step(small_client, model, sid, np.ones(DIM), start=True, end=False)
    with pytest.raises(InferenceServerException) as capacity:
        await infer_step(small_client, model, 34, np.ones(DIM), start=True, end=False)
    assert str(capacity.value.message()).startswith(SEQUENCE_CAPACITY)
    assert "34" in str(capacity.value.message())
    assert capacity.value.status() == "StatusCode.UNAVAILABLE"
    # Triton saw 34's START, the model refused it: Triton lets the next step through, the model holds no 34.
    with pytest.raises(InferenceServerException) as unknown:
        await infer_step(small_client, model, 34, np.ones(DIM), start=False, end=True)
    assert str(unknown.value.message()).startswith(SEQUENCE_UNKNOWN)
    assert "34" in str(unknown.value.message())
    assert "START" in str(unknown.value.message())
    assert unknown.value.status() == "StatusCode.INVALID_ARGUMENT"
    for sid in (31, 32, 33):
        await infer_step(small_client, model, sid, np.ones(DIM), start=False, end=True)
    assert await live_now(small_client, model, 35) == 0


# --- END-only requests: close a sequence without a step -----------------------------------------------


async def end_only(
    client: grpcclient.InferenceServerClient, model: str, sid: int | str, *, start: bool = False
) -> Step:
    """END (and maybe START) with no inputs at all."""
    return Step(await client.infer(model, [], sequence_id=sid, sequence_start=start, sequence_end=True))


@pytest.mark.parametrize("model", MODELS)
async def test_end_only_request_frees_without_a_step(client: grpcclient.InferenceServerClient, model: str) -> None:
    """Two steps, then END with no X: COUNT stays 2, MEAN/VAR unchanged, LIVE drops and the sequence is gone."""
    xs = np.array([[1.0, 2.0, 3.0, 4.0], [3.0, 0.0, -1.0, 8.0]])
    sid = seq_id(model, 700)
    baseline = await live_now(client, model, seq_id(model, 701))
    await infer_step(client, model, sid, xs[0], start=True, end=False)
    second = await infer_step(client, model, sid, xs[1], start=False, end=False)
    assert second.live >= baseline + 1
    closed = await end_only(client, model, sid)
    assert closed.count == 2
    np.testing.assert_array_equal(closed.mean, second.mean)
    np.testing.assert_array_equal(closed.var, second.var)
    np.testing.assert_allclose(closed.mean, xs.mean(axis=0), rtol=1e-6)
    assert closed.live <= baseline
    assert await live_now(client, model, seq_id(model, 702)) <= baseline
    with pytest.raises(InferenceServerException, match="START"):
        await infer_step(client, model, sid, xs[0], start=False, end=False)


@pytest.mark.parametrize("model", MODELS)
async def test_start_end_without_x_is_an_empty_sequence(client: grpcclient.InferenceServerClient, model: str) -> None:
    """START and END with no X: COUNT 0, zero MEAN/VAR of the right shapes, nothing held afterwards."""
    baseline = await live_now(client, model, seq_id(model, 711))
    empty = await end_only(client, model, seq_id(model, 710), start=True)
    assert empty.count == 0
    np.testing.assert_array_equal(empty.mean, np.zeros(DIM, np.float32))
    np.testing.assert_array_equal(empty.var, np.zeros(DIM, np.float32))
    assert empty.live <= baseline


@pytest.mark.parametrize("model", MODELS)
async def test_missing_x_without_end_is_refused(client: grpcclient.InferenceServerClient, model: str) -> None:
    """A step with no X and no END is refused naming X; the sequence goes on as if it had not been sent."""
    sid = seq_id(model, 720)
    await infer_step(client, model, sid, np.full(DIM, 2.0), start=True, end=False)
    with pytest.raises(InferenceServerException, match="input 'X' is missing") as refused:
        await client.infer(model, [], sequence_id=sid)
    assert refused.value.status() == "StatusCode.INVALID_ARGUMENT"
    after = await infer_step(client, model, sid, np.full(DIM, 4.0), start=False, end=False)
    assert after.count == 2
    np.testing.assert_array_equal(after.mean, np.full(DIM, 3.0, np.float32))
    assert (await end_only(client, model, sid)).count == 2


async def test_direct_end_only_next_to_stepping_neighbours(
    client: grpcclient.InferenceServerClient, seed: Callable[[int], int]
) -> None:
    """Direct strategy: END-only requests batched with other sequences' steps and dummy slots leave those exact."""
    model = "seq_stats_direct"
    ids = [3_100_000 + n for n in range(4)]
    rng = np.random.default_rng(seed(11))
    xs = rng.normal(size=(len(ids), 3, DIM))
    for k in range(2):
        await asyncio.gather(
            *(infer_step(client, model, sid, xs[i, k], start=k == 0, end=False) for i, sid in enumerate(ids))
        )
    closes = [end_only(client, model, sid) for sid in ids[:2]]
    steps = [infer_step(client, model, sid, xs[i + 2, 2], start=False, end=True) for i, sid in enumerate(ids[2:])]
    closed, stepped = (await asyncio.gather(*closes)), (await asyncio.gather(*steps))
    for i, answer in enumerate(closed):
        assert answer.count == 2
        np.testing.assert_allclose(answer.mean, xs[i, :2].mean(axis=0), rtol=1e-5, atol=1e-6)
    for i, answer in enumerate(stepped):
        assert answer.count == 3
        np.testing.assert_allclose(answer.mean, xs[i + 2].mean(axis=0), rtol=1e-5, atol=1e-6)


async def stream_session(
    client: grpcclient.InferenceServerClient,
    model: str,
    sid: int,
    steps: list[tuple[npt.NDArray[Any] | None, bool, bool]],
) -> list[Step | InferenceServerException]:
    """Steps of one sequence over one gRPC stream, each sent once the previous one is answered."""
    answered: asyncio.Queue[None] = asyncio.Queue()
    out: list[Step | InferenceServerException] = []

    async def requests() -> AsyncIterator[dict[str, Any]]:
        for x, start, end in steps:
            inputs = []
            if x is not None:
                inputs.append(grpcclient.InferInput("X", [1, DIM], "FP32"))
                inputs[0].set_data_from_numpy(np.asarray(x, np.float32).reshape(1, DIM))
            yield {
                "model_name": model,
                "inputs": inputs,
                "sequence_id": sid,
                "sequence_start": start,
                "sequence_end": end,
            }
            await answered.get()

    async for result, error in client.stream_infer(requests()):
        out.append(Step(result) if error is None else error)
        answered.put_nowait(None)
    return out


async def test_stream_model_end_only_answers_through_the_sender(client: grpcclient.InferenceServerClient) -> None:
    """seq_stats_stream (decoupled): END with no X answers once, COUNT unchanged, LIVE dropped; no X, no END refused."""
    model = "seq_stats_stream"
    probe = await stream_session(client, model, 4_000_001, [(np.zeros(DIM), True, True)])
    baseline = probe[0].live if isinstance(probe[0], Step) else -1
    answers = await stream_session(
        client,
        model,
        4_000_000,
        [
            (np.full(DIM, 1.0), True, False),
            (np.full(DIM, 3.0), False, False),
            (None, False, False),
            (None, False, True),
        ],
    )
    assert len(answers) == 4
    first, second, refused, closed = answers
    assert isinstance(first, Step)
    assert first.count == 1
    assert isinstance(second, Step)
    assert isinstance(refused, InferenceServerException)
    assert "input 'X' is missing" in str(refused.message())
    assert isinstance(closed, Step)
    assert (second.count, closed.count) == (2, 2)
    np.testing.assert_array_equal(closed.mean, np.full(DIM, 2.0, np.float32))
    assert second.live >= baseline + 1
    assert closed.live <= baseline
