"""Fleet behaviour that one real server can show: several URLs that reach it, dead replicas, DNS that changes.

``grpc://127.0.0.1:P`` and ``grpc://localhost:P`` are two replica keys for the session's one server: enough to see
routing, health and discovery at work without starting more servers (tests/test_fleet.py starts three).
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Sequence

import numpy as np
import pytest

from triton_npu_client import (
    Client,
    FleetOptions,
    LocalTriton,
    SequenceLost,
    SequenceUsageError,
    ServerUnavailable,
    SharedMemoryPool,
    UsageError,
)

FAST = FleetOptions(health_interval_s=60.0, probe_backoff_s=0.05, max_probe_backoff_s=0.2, resolve_interval_s=60.0)


def _dead_port() -> int:
    """A loopback port nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_a_dead_replica_is_out_from_the_first_check_and_never_sent_to(triton_server: LocalTriton) -> None:
    dead = f"grpc://127.0.0.1:{_dead_port()}"
    async with Client([triton_server.grpc_url, dead], fleet=FAST, coalescing=None) as client:
        scale = await client.model("scale_fp32")
        for i in range(10):
            x = np.array([float(i)], np.float32)
            assert (await scale.infer(INPUT0=x))["OUTPUT0"].tolist() == [[2.0 * i]]
        status = {s.url: s for s in await client.replicas()}
        assert status[dead].healthy is False
        assert status[dead].requests == 0
        assert status[dead].last_error is not None
        assert "ConnectError" in status[dead].last_error or "ServerUnavailable" in status[dead].last_error
        assert status[triton_server.grpc_url].healthy is True
        assert status[triton_server.grpc_url].requests == 10
        assert "scale_fp32" in status[triton_server.grpc_url].models
        assert status[triton_server.grpc_url].latency_p50_ms is not None
        # New sequences only go where they can live.
        stats = await client.model("seq_stats_oldest")
        for _ in range(10):
            async with stats.sequence() as seq:
                await seq.infer(X=np.ones(4, np.float32))
                assert await client.replica_for("seq_stats_oldest", seq.sequence_id) == triton_server.grpc_url


async def test_no_healthy_replica_is_a_clear_unavailable_error_naming_each() -> None:
    urls = [f"grpc://127.0.0.1:{_dead_port()}", f"grpc://127.0.0.1:{_dead_port()}"]
    async with Client(urls, fleet=FAST, retry=None, timeout_s=5) as client:
        with pytest.raises(ServerUnavailable) as err:
            await client.model("scale_fp32")
        for url in urls:
            assert url in str(err.value)
        assert await client.replica_for("seq_stats_oldest", 7) is None
        assert not await client.is_server_ready()


async def test_http_fleet_routes_stateless_requests_and_pins_sequences(triton_server: LocalTriton) -> None:
    port = triton_server.http_port
    urls = [f"http://127.0.0.1:{port}", f"http://localhost:{port}"]
    async with Client(urls, fleet=FAST, coalescing=None) as client:
        scale = await client.model("scale_fp32")
        for i in range(8):
            assert (await scale.infer(INPUT0=[float(i)]))["OUTPUT0"].tolist() == [[2.0 * i]]
        status = {s.url: s for s in await client.replicas()}
        # Least outstanding, ties rotating: one request at a time alternates between the two.
        assert [status[u].requests for u in urls] == [4, 4]
        stats = await client.model("seq_stats_oldest")
        async with stats.sequence() as seq:
            pinned = await client.replica_for("seq_stats_oldest", seq.sequence_id)
            for k in range(6):
                out = await seq.infer(X=np.full(4, k, np.float32))
                assert int(out["COUNT"][0][0]) == k + 1
            assert await client.replica_for("seq_stats_oldest", seq.sequence_id) == pinned
        with pytest.raises(SequenceUsageError, match="gRPC"):
            async with client.chat("chat"):
                pass


async def test_a_replica_that_leaves_dns_loses_its_sequences_and_one_that_joins_takes_new_ones(
    triton_server: LocalTriton,
) -> None:
    answers: list[Sequence[str]] = [["127.0.0.1"]]

    async def resolver(host: str, port: int) -> Sequence[str]:
        assert host == "triton.test"
        return answers[-1]

    url = f"grpc://127.0.0.1:{triton_server.grpc_port}"
    async with Client(f"dns+grpc://triton.test:{triton_server.grpc_port}", resolver=resolver, fleet=FAST) as client:
        assert [s.url for s in await client.replicas()] == [url]
        stats = await client.model("seq_stats_oldest")
        scale = await client.model("scale_fp32")
        async with stats.sequence() as seq:
            await seq.infer(X=np.ones(4, np.float32))
            answers.append([])  # the pod went away
            gone = await client.replicas(refresh=True)
            assert gone == ()
            with pytest.raises(SequenceLost, match="failed or left"):
                await seq.infer(X=np.ones(4, np.float32))
            with pytest.raises(ServerUnavailable, match="has no address records"):
                await scale.infer(INPUT0=[1.0])
        answers.append(["127.0.0.1"])  # and came back
        back = await client.replicas(refresh=True)
        assert [(s.url, s.healthy) for s in back] == [(url, True)]
        async with stats.sequence() as seq:
            out = await seq.infer(X=np.ones(4, np.float32))
            assert int(out["COUNT"][0][0]) == 1


async def test_a_failing_resolver_keeps_the_replicas_it_had(triton_server: LocalTriton) -> None:
    calls = 0

    async def resolver(host: str, port: int) -> Sequence[str]:
        nonlocal calls
        calls += 1
        if calls > 1:
            raise OSError("DNS server unreachable")
        return ["127.0.0.1"]

    async with Client(f"dns+grpc://triton.test:{triton_server.grpc_port}", resolver=resolver, fleet=FAST) as client:
        scale = await client.model("scale_fp32")
        assert (await scale.infer(INPUT0=[1.0]))["OUTPUT0"].tolist() == [[2.0]]
        after = await client.replicas(refresh=True)
        assert calls == 2
        assert [s.healthy for s in after] == [True]
        assert (await scale.infer(INPUT0=[2.0]))["OUTPUT0"].tolist() == [[4.0]]


async def test_statistics_are_summed_over_replicas_and_given_per_replica(triton_server: LocalTriton) -> None:
    port = triton_server.grpc_port
    urls = [f"grpc://127.0.0.1:{port}", f"grpc://localhost:{port}"]
    async with Client(urls, fleet=FAST, coalescing=None) as client:
        echo = await client.model("dtypes_echo")
        for i in range(4):
            await echo.infer(IN_INT64=[i])
        # Triton counts a request a moment after answering it: read until both replicas (one server) agree.
        for _ in range(100):
            per = await client.replica_statistics("dtypes_echo")
            counts = {u: s[0].inference_count for u, s in per.items() if not isinstance(s, Exception)}
            if len(set(counts.values())) == 1 and min(counts.values()) >= 4:
                break
        assert sorted(counts) == sorted(urls)
        summed = await client.inference_statistics("dtypes_echo")
        # Both keys reach the same server, so the fleet's sum is exactly twice that server's figures.
        assert summed[0].inference_count == 2 * counts[urls[0]]
        assert summed[0].name == "dtypes_echo"


async def test_shared_memory_needs_one_server(triton_server: LocalTriton) -> None:
    port = triton_server.grpc_port
    async with Client([f"grpc://127.0.0.1:{port}", f"grpc://localhost:{port}"], fleet=FAST) as client:
        model = await client.model("scale_fp32")
        with pytest.raises(UsageError, match="one server"):
            await SharedMemoryPool.open(model, slots=1)


async def test_names_are_resolved_again_on_their_own_and_replicas_join_and_leave(triton_server: LocalTriton) -> None:
    """With no refresh asked for, the watch resolves the name every ``resolve_interval_s``."""
    port = triton_server.grpc_port
    answers = [["127.0.0.1"], ["127.0.0.1", "::1"], ["::1"]]
    calls = 0
    asked = [asyncio.Event() for _ in range(4)]
    release = asyncio.Event()

    async def resolver(host: str, port: int) -> Sequence[str]:
        nonlocal calls
        calls += 1
        asked[min(calls, 4) - 1].set()
        if calls == 3:
            await release.wait()  # hold the third lookup until the test has seen what the second one did
        return answers[min(calls, len(answers)) - 1]

    def seen(client: Client) -> dict[str, bool | None]:
        return {s.url: s.healthy for s in client.transport.replica_status()}  # type: ignore[attr-defined]

    here, there = f"grpc://127.0.0.1:{port}", f"grpc://[::1]:{port}"
    options = FleetOptions(health_interval_s=60.0, probe_backoff_s=0.05, resolve_interval_s=0.05)
    async with Client(f"dns+grpc://triton.test:{port}", resolver=resolver, fleet=options) as client:
        assert [s.url for s in await client.replicas()] == [here]
        # The third lookup starts only after the round of the second (which added ::1 and checked it) is over.
        await asked[2].wait()
        # Nothing listens on ::1 (the server binds 127.0.0.1): the newcomer was checked before any use, and is out.
        assert seen(client) == {here: True, there: False}
        release.set()
        await asked[3].wait()  # the fourth lookup starts after the third's answer was applied
        assert seen(client) == {there: False}


def test_probe_backoff_doubles_up_to_its_cap() -> None:
    options = FleetOptions(probe_backoff_s=0.1, max_probe_backoff_s=1.0)
    assert [options.backoff_s(n) for n in range(1, 7)] == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    assert options.backoff_s(10_000) == 1.0
