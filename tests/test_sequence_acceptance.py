"""Issue 4's acceptance tests for sessions, against real servers (slow: tens of seconds in all)."""

from __future__ import annotations

import asyncio
import shutil
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from triton_npu_client import LocalTriton, SequenceIdleWarning, SequenceLost, default_model_repository
from triton_npu_client._client import Client, Model
from triton_npu_client._sessions import open_sequence

pytestmark = pytest.mark.slow

MODEL = "seq_stats_oldest"
# Its twins with a 600 s idle timeout: the tests of many sessions check that no step is lost or mixed up, and
# on a busy machine the steps of one sequence can arrive more than seq_stats_oldest's 3 s apart. The idle
# timeout has its own test (test_idle_past_timeout_is_lost_and_freed, on MODEL).
LONG = "seq_stats_long"
STREAM_LONG = "seq_stats_stream_long"


async def live_sequences(model: Model) -> int:
    """The model's live-sequence count, read with a one-request sequence (START and END together)."""
    async with open_sequence(model) as probe:
        result = await probe.end(X=np.zeros(4, np.float32))
    return int(result["LIVE"][0, 0])


async def wait_for_live(model: Model, expected: int, *, bound_s: float) -> None:
    """Poll the live count until it reads ``expected``; ``bound_s`` bounds the wait, it never paces the test."""
    deadline = time.monotonic() + bound_s
    while (live := await live_sequences(model)) != expected:
        assert time.monotonic() < deadline, f"LIVE still {live} after {bound_s} s, expected {expected}"
        await asyncio.sleep(0.05)


# Unary gRPC and HTTP on the non-decoupled model; the stream on its decoupled twin (the form that Triton 2.51
# survives under streamed load; open_sequence picks the stream for a decoupled model by itself).
PATHS = {"grpc": LONG, "http": LONG, "stream": STREAM_LONG}


@pytest.mark.parametrize("path", list(PATHS))
async def test_500_sessions_x_20_steps_each_get_their_own_results(
    triton_server: LocalTriton, path: str, seed: Callable[[int], int]
) -> None:
    """500 concurrent sessions x 20 random-paced steps: each gets the running stats of its own inputs; 0 left live."""
    url = triton_server.http_url if path == "http" else triton_server.grpc_url
    async with Client(url) as client:
        model = await client.model(PATHS[path])
        assert (model.spec.decoupled, model.spec.sequence is not None) == (path == "stream", True)
        before = await live_sequences(model)
        rng = np.random.default_rng(seed(500))
        inputs = rng.standard_normal((500, 20, 4)).astype(np.float32)
        # Random interleaving: each session yields to the loop a random number of times between steps.
        pauses = rng.integers(0, 4, size=(500, 20))

        async def session(k: int) -> list[tuple[Any, Any]]:
            got = []
            async with open_sequence(model) as seq:
                for step in range(20):
                    for _ in range(int(pauses[k, step])):
                        await asyncio.sleep(0)
                    result = await seq.infer(X=inputs[k, step])
                    got.append((result["MEAN"][0], result["COUNT"][0, 0]))
            return got

        # A TaskGroup, so that one failing session cancels (and thereby ends) the others before the next test.
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(session(k)) for k in range(500)]
        results = [t.result() for t in tasks]
        for k, got in enumerate(results):
            cumulative = np.cumsum(inputs[k].astype(np.float64), axis=0) / np.arange(1, 21)[:, None]
            np.testing.assert_allclose(np.stack([m for m, _ in got]), cumulative, rtol=1e-4, atol=1e-5)
            assert [int(c) for _, c in got] == list(range(1, 21))
        assert await live_sequences(model) == before == 0


async def test_batching_is_real(triton_server: LocalTriton) -> None:
    """Under 64 concurrent sessions the model runs far fewer executions than inferences (statistics)."""
    async with Client(triton_server.grpc_url) as client:
        model = await client.model(LONG)
        (first,) = await client.inference_statistics(LONG)

        async def session() -> None:
            async with open_sequence(model) as seq:
                for _ in range(10):
                    await seq.infer(X=np.ones(4, np.float32))

        await asyncio.gather(*(session() for _ in range(64)))
        (after,) = await client.inference_statistics(LONG)
    inferences = after.inference_count - first.inference_count
    executions = after.execution_count - first.execution_count
    assert inferences >= 64 * 10
    assert executions < inferences / 4, (executions, inferences)


async def test_idle_past_timeout_is_lost_and_freed(triton_server: LocalTriton) -> None:
    """A session idle past the model's timeout warns, raises SequenceLost on its next step, and is freed."""
    async with Client(triton_server.grpc_url) as client:
        model = await client.model(MODEL)
        assert model.spec.sequence is not None
        timeout_s = model.spec.sequence.idle_timeout_us / 1e6
        before = await live_sequences(model)
        async with open_sequence(model) as seq:
            await seq.infer(X=np.ones(4, np.float32))
            await seq.infer(X=np.ones(4, np.float32))
            # The idle timeout is the behaviour under test: wait until the model has swept the session (Triton
            # released it before, at timeout_s), seen in LIVE; the probes that read LIVE are one-request sequences.
            await wait_for_live(model, before, bound_s=timeout_s + 60.0)
            with pytest.warns(SequenceIdleWarning), pytest.raises(SequenceLost) as info:
                await seq.infer(X=np.ones(4, np.float32))
            assert info.value.sequence_id == seq.sequence_id
            assert info.value.steps_acknowledged == 2
            with pytest.raises(SequenceLost):
                await seq.infer(X=np.ones(4, np.float32))
        assert await live_sequences(model) == before


async def test_server_restart_loses_open_sessions_and_new_ones_work(tmp_path: Path) -> None:
    """Killing and restarting the server (same gRPC port): open sessions raise SequenceLost; new sessions work."""
    shutil.copytree(default_model_repository() / MODEL, tmp_path / MODEL)
    server = LocalTriton(tmp_path, stop_grace_s=0)
    async with server:
        grpc_port = server.grpc_port
        async with Client(server.grpc_url, timeout_s=10) as client:
            model = await client.model(MODEL)
            sessions = [open_sequence(model) for _ in range(8)]
            for seq in sessions:
                await seq.infer(X=np.ones(4, np.float32))
            await server.astop()
            async with LocalTriton(tmp_path, grpc_port=grpc_port, stop_grace_s=0):
                for seq in sessions:
                    # The restart may take longer than the idle timeout; that warning is not under test here.
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore", SequenceIdleWarning)
                        with pytest.raises(SequenceLost) as info:
                            await seq.infer(X=np.ones(4, np.float32))
                    assert info.value.steps_acknowledged == 1
                    await seq.aclose()
                async with open_sequence(model) as fresh:
                    await fresh.infer(X=np.ones(4, np.float32))
                    result = await fresh.end(X=np.full(4, 3.0, np.float32))
                np.testing.assert_allclose(result["MEAN"][0], np.full(4, 2.0))
                assert await live_sequences(model) == 0


def _rss_kib(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except FileNotFoundError:
            continue
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1])
    return total


async def test_10000_abandoned_sessions_free_their_state(triton_server: LocalTriton) -> None:
    """10,000 sessions cancelled mid-sequence: the live count returns to 0 and server RSS stays bounded."""
    async with Client(triton_server.grpc_url) as client:
        model = await client.model(LONG)
        assert await live_sequences(model) == 0
        rss_before = _rss_kib(triton_server.processes())
        cancelled = 0
        for _ in range(20):  # 20 waves of 500 keep the in-flight count realistic for 2 cores
            started = asyncio.Event()
            counter = {"n": 0}

            async def session(started: asyncio.Event, counter: dict[str, int]) -> None:
                async with open_sequence(model) as seq:
                    await seq.infer(X=np.ones(4, np.float32))
                    counter["n"] += 1
                    if counter["n"] == 500:
                        started.set()
                    await asyncio.Event().wait()  # abandoned: never ends on its own

            tasks = [asyncio.create_task(session(started, counter)) for _ in range(500)]
            await started.wait()
            for task in tasks:
                task.cancel()
            outcomes = await asyncio.gather(*tasks, return_exceptions=True)
            cancelled += sum(isinstance(o, asyncio.CancelledError) for o in outcomes)
        assert cancelled == 10_000
        assert await live_sequences(model) == 0
        rss_after = _rss_kib(triton_server.processes())
    # Bounded: the 10,000 sequences' state is gone; allow allocator slack, not growth per sequence.
    assert rss_after < rss_before + 64 * 1024, (rss_before, rss_after)
