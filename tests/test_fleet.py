"""A fleet of three real Triton servers on loopback behind one client.

The three servers listen on 127.0.0.1, 127.0.0.2 and 127.0.0.3 with the same ports, and the client finds them
through a ``dns+grpc://`` name whose resolver (injected) answers those three addresses: what a Kubernetes headless
Service looks like to a pod. One of them is killed (SIGKILL) in the middle of a run and started again.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import random
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import pytest

from triton_npu_client import (
    ChatMessage,
    ChatSession,
    Client,
    FleetOptions,
    LocalTriton,
    Model,
    SequenceLost,
    UsageError,
)
from triton_npu_client._fleet import rendezvous, sequence_key

HOSTS = ("127.0.0.1", "127.0.0.2", "127.0.0.3")
MODELS = ("scale_fp32", "seq_stats_oldest", "chat")
# The third server has no chat model: chats must be placed (and replayed) only where the model is READY.
WITHOUT_CHAT = 2
MODELS_OF = [MODELS, MODELS, ("scale_fp32", "seq_stats_oldest")]
NAME = "triton-fleet.test"  # never looked up: the resolver below answers it
SEQUENCES = int(os.environ.get("TNC_FLEET_SEQUENCES", "300"))
STEPS = 20
KILL_AFTER = 10  # steps every sequence has had answered when one replica is killed
CHATS = int(os.environ.get("TNC_FLEET_CHATS", "30"))
TURNS = 3
CHAT_TOKENS = 8


def _ports_free_on_every_host() -> tuple[int, int, int]:
    """Three ports free on all three loopback addresses (each server binds its own address)."""
    found: list[int] = []
    while len(found) < 3:
        with socket.socket() as s:
            s.bind((HOSTS[0], 0))
            port = int(s.getsockname()[1])
        ok = True
        for host in HOSTS[1:]:
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:
                    ok = False
        if ok and port not in found:
            found.append(port)
    return found[0], found[1], found[2]


class Fleet:
    """Three servers, one per loopback address, on the same ports; any of them can be killed and started again."""

    def __init__(self) -> None:
        self.http, self.grpc, self.metrics = _ports_free_on_every_host()
        self.servers: list[LocalTriton | None] = [None] * len(HOSTS)
        self.url = f"dns+grpc://{NAME}:{self.grpc}"
        self.urls = [f"grpc://{h}:{self.grpc}" for h in HOSTS]

    def make(self, i: int, models: Sequence[str] | None = None) -> LocalTriton:
        models = MODELS_OF[i] if models is None else models
        return LocalTriton(
            host=HOSTS[i], http_port=self.http, grpc_port=self.grpc, metrics_port=self.metrics,
            model_control_mode="explicit", load_models=list(models), stop_grace_s=0,
        )  # fmt: skip

    def start_all(self) -> None:
        with concurrent.futures.ThreadPoolExecutor(len(HOSTS)) as pool:
            self.servers = list(pool.map(lambda i: self.make(i).start(), range(len(HOSTS))))

    def kill(self, i: int) -> None:
        """SIGKILL the server and its stubs, as a node failure would."""
        server = self.servers[i]
        assert server is not None
        server.kill()
        assert server.processes() == []
        self.servers[i] = None

    def restart(self, i: int, models: Sequence[str]) -> None:
        """A new process on the same address and ports."""
        self.servers[i] = self.make(i, models).start()

    def stop_all(self) -> None:
        for server in self.servers:
            if server is not None:
                server.stop()
                assert server.processes() == [], "a tritonserver or stub outlived the fleet test"

    async def resolve(self, host: str, port: int) -> Sequence[str]:
        assert (host, port) == (NAME, self.grpc)
        return list(HOSTS)


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    fleet = Fleet()
    try:
        fleet.start_all()
        yield fleet
    finally:
        fleet.stop_all()


def _options(**changes: float) -> FleetOptions:
    # Health checks far apart: the kill must be found by the calls that meet it (and moved past), not by a
    # check that happened to run first. A replica that failed is probed again quickly.
    base = {"health_interval_s": 60.0, "probe_backoff_s": 0.05, "max_probe_backoff_s": 0.5}
    base.update(changes)
    return FleetOptions(**base)


# --- pinning ---------------------------------------------------------------------------------------------

_PLACEMENT_SCRIPT = """
import asyncio, json, sys
from triton_npu_client import Client

async def main():
    urls, model, count = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    async with Client(urls) as client:
        ids = [*range(1, count + 1), *(f"conversation-{i}" for i in range(count))]
        print(json.dumps([await client.replica_for(model, i) for i in ids]))

asyncio.run(main())
"""


def test_two_processes_given_the_replicas_in_different_orders_pin_every_sequence_to_the_same_replica(
    fleet: Fleet,
) -> None:
    orders = [fleet.urls, [fleet.urls[2], fleet.urls[0], fleet.urls[1]]]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _PLACEMENT_SCRIPT, json.dumps(order), "seq_stats_oldest", "1000"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for order in orders
    ]
    answers = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        answers.append(json.loads(out))
    first, second = answers
    assert len(first) == 2000
    assert first == second
    shares = {url: first.count(url) for url in fleet.urls}
    # Rendezvous hashing spreads ids evenly: each replica's share of 2,000 is near a third (sd ~21).
    assert all(500 < n < 830 for n in shares.values()), shares


def test_a_replica_that_leaves_moves_only_its_own_sequences() -> None:
    replicas = [f"grpc://10.0.0.{i}:8001" for i in range(1, 6)]
    keys = [sequence_key("m", i) for i in range(5000)]
    before = [rendezvous(k, ((r, r) for r in replicas)) for k in keys]
    gone = replicas[2]
    after = [rendezvous(k, ((r, r) for r in replicas if r != gone)) for k in keys]
    moved = [(b, a) for b, a in zip(before, after, strict=True) if b != a]
    assert moved
    assert all(b == gone for b, _ in moved)
    assert len(moved) == before.count(gone)
    # And one that joins takes only what it now wins, from everyone else.
    joined = [*replicas, "grpc://10.0.0.9:8001"]
    grown = [rendezvous(k, ((r, r) for r in joined)) for k in keys]
    assert all(g == b or g == "grpc://10.0.0.9:8001" for b, g in zip(before, grown, strict=True))
    # The order the replicas are given in never matters, and ids of different types or models differ.
    assert before == [rendezvous(k, ((r, r) for r in reversed(replicas))) for k in keys]
    assert sequence_key("m", 7) != sequence_key("m", "7") != sequence_key("n", 7)


def test_mixed_protocols_and_bad_fleet_urls_are_refused_before_any_network_call() -> None:
    with pytest.raises(UsageError, match="all be gRPC"):
        Client(["grpc://127.0.0.1:1", "http://127.0.0.1:2"])
    with pytest.raises(UsageError, match="no server URL"):
        Client([])
    with pytest.raises(UsageError, match="unsupported URL scheme"):
        Client("dns+ftp://name:1")
    with pytest.raises(UsageError, match="user info"):
        Client(["grpc://127.0.0.1:1", "dns+grpc://user:pw@name:1"])
    with pytest.raises(ValueError, match="health_interval_s"):
        FleetOptions(health_interval_s=0)


# --- a replica dies mid-run ----------------------------------------------------------------------------


def _step_input(i: int, k: int) -> np.ndarray:
    return np.array([i, k, i * k % 7, 1.0], dtype=np.float32)


async def _sequence(
    model: Model, i: int, started: Callable[[], None], go: asyncio.Event, client: Client
) -> tuple[str | None, int, BaseException | None]:
    """20 steps of one sequence, each answer checked against the sequence's own inputs. Returns where it was
    pinned, how many steps were answered, and the error that ended it (None: all 20)."""
    seen: list[np.ndarray] = []
    replica: str | None = None
    async with model.sequence() as seq:
        try:
            for k in range(STEPS):
                if k == KILL_AFTER:
                    started()
                    await go.wait()
                x = _step_input(i, k)
                seen.append(x)
                out = await (seq.end(X=x) if k == STEPS - 1 else seq.infer(X=x))
                assert int(out["COUNT"].reshape(-1)[0]) == k + 1, (i, k, out["COUNT"])
                np.testing.assert_allclose(out["MEAN"].reshape(-1), np.mean(seen, axis=0), rtol=1e-5)
                if k == 0:
                    replica = await client.replica_for(model.name, seq.sequence_id)
        except SequenceLost as err:
            return replica, len(seen) - 1, err
    return replica, STEPS, None


async def _chat(
    client: Client, i: int, started: Callable[[], None], go: asyncio.Event
) -> tuple[str | None, ChatSession, list[Any]]:
    replies = []
    async with client.chat("chat", replay_on_loss=True, **_chat_options(i)) as chat:
        for turn in range(TURNS):
            if turn == 1:
                started()
                await go.wait()
            replies.append(await chat.ask(f"tell me about thing {i} and turn {turn}"))
            if turn == 0:
                replica = await client.replica_for("chat", chat.sequence_id)
    return replica, chat, replies


def _chat_options(i: int) -> dict[str, Any]:
    # Sampled with a seed of its own per conversation: the demo model's greedy replies hardly depend on the prompt,
    # and a check that every conversation passes with the same replies would not see one conversation's replies
    # land in another. A turn's generator is seeded when the turn starts, so a replayed turn samples the same.
    return {"max_tokens": CHAT_TOKENS, "temperature": 0.9, "seed": 1000 + i}


async def _uninterrupted(client: Client, i: int, users: Sequence[ChatMessage]) -> list[str]:
    """The replies conversation ``i`` gets when nothing interrupts it (a fresh chat with the same options)."""
    async with client.chat("chat", **_chat_options(i)) as chat:
        return [(await chat.ask(m.text)).text for m in users]


async def _stateless_traffic(model: Model, stop: asyncio.Event, rng: random.Random) -> tuple[int, list[str]]:
    """Requests one after another until ``stop``; every answer checked. Returns (answered, failures)."""
    answered, failures = 0, []
    while not stop.is_set():
        x = np.array([rng.uniform(-100, 100) for _ in range(3)], dtype=np.float32)
        try:
            out = await model.infer(INPUT0=x)
        except Exception as err:  # every failure is recorded, and the test fails on any
            failures.append(f"{type(err).__name__}: {err}")
            continue
        np.testing.assert_allclose(out["OUTPUT0"].reshape(-1), 2 * x)
        answered += 1
    return answered, failures


async def test_kill_one_replica_mid_run(fleet: Fleet, seed: Callable[[int], int]) -> None:
    rng = random.Random(seed(15))
    victim = 1
    victim_url = fleet.urls[victim]
    async with Client(fleet.url, resolver=fleet.resolve, fleet=_options()) as client:
        stats, scale = [await client.model(n) for n in ("seq_stats_oldest", "scale_fp32")]
        arrived = 0
        everyone_there = asyncio.Event()
        go = asyncio.Event()

        def started() -> None:
            nonlocal arrived
            arrived += 1
            if arrived == SEQUENCES + CHATS:
                everyone_there.set()

        stop = asyncio.Event()
        traffic = [asyncio.create_task(_stateless_traffic(scale, stop, random.Random(rng.random()))) for _ in range(4)]
        sequences = [asyncio.create_task(_sequence(stats, i, started, go, client)) for i in range(SEQUENCES)]
        chats = [asyncio.create_task(_chat(client, i, started, go)) for i in range(CHATS)]
        # Every task either reaches the kill point or fails (then the test fails with its error, not a hang).
        waiting = asyncio.create_task(everyone_there.wait())
        await asyncio.wait([waiting, *sequences, *chats, *traffic], return_when=asyncio.FIRST_COMPLETED)
        if not everyone_there.is_set():
            waiting.cancel()
            failed = [t for t in (*sequences, *chats, *traffic) if t.done()]
            stop.set()
            go.set()
            await failed[0]  # raises its error
            pytest.fail(f"a task ended before the kill point: {failed[0]}")
        before_kill = sum(s.requests for s in await client.replicas())
        # A second client whose health checks saw all three up, sending one request at a time without coalescing.
        witness = Client(fleet.urls, fleet=_options(), coalescing=None)
        witness_scale = await witness.model("scale_fp32")
        assert all(s.healthy for s in await witness.replicas())
        fleet.kill(victim)
        # Ties rotate over the replicas, so within three requests one goes to the killed replica: it must fail
        # there, take that replica out and be answered by another, all within its own deadline.
        for i in range(6):
            x = np.array([float(i)], np.float32)
            np.testing.assert_allclose((await witness_scale.infer(INPUT0=x))["OUTPUT0"].reshape(-1), 2 * x)
        seen_by_witness = {s.url: s for s in await witness.replicas()}
        await witness.aclose()
        assert seen_by_witness[victim_url].healthy is False
        assert (seen_by_witness[victim_url].requests, seen_by_witness[victim_url].errors) == (1, 1)
        assert sum(s.requests for s in seen_by_witness.values()) == 7
        go.set()
        seq_results = await asyncio.gather(*sequences)
        chat_results = await asyncio.gather(*chats)
        stop.set()
        answered = await asyncio.gather(*traffic)

        # Stateless traffic went on: nothing failed, and requests were answered after the kill.
        assert [f for _, fs in answered for f in fs] == []
        assert sum(s.requests for s in await client.replicas()) > before_kill
        status = {s.url: s for s in await client.replicas()}
        assert status[victim_url].healthy is False
        assert status[victim_url].epoch >= 1
        assert all(status[u].healthy for u in fleet.urls if u != victim_url)

        # Sequences: the victim's lost at their first step after the kill, everyone else's untouched and exact.
        on_victim = [r for r in seq_results if r[0] == victim_url]
        elsewhere = [r for r in seq_results if r[0] != victim_url]
        assert on_victim, "rendezvous put no sequence on the killed replica"
        assert elsewhere, "rendezvous put every sequence on the killed replica"
        assert all(r[0] in fleet.urls for r in seq_results)
        assert [(steps, type(err)) for _, steps, err in on_victim] == [(KILL_AFTER, SequenceLost)] * len(on_victim)
        assert {err.steps_acknowledged for _, _, err in on_victim if isinstance(err, SequenceLost)} == {KILL_AFTER}
        assert [(steps, err) for _, steps, err in elsewhere] == [(STEPS, None)] * len(elsewhere)

        # Chats: the victim's replayed on another replica, with exactly an uninterrupted conversation's replies.
        victims_chats = [c for c in chat_results if c[0] == victim_url]
        assert victims_chats, "no chat was pinned to the killed replica"
        assert all(c[0] != fleet.urls[WITHOUT_CHAT] for c in chat_results), "a chat went where no chat model is"
        # The same conversations once more, all at once, on the replicas still up, with nothing interrupting them.
        references = await asyncio.gather(
            *(_uninterrupted(client, i, chat.messages[0::2]) for i, (_, chat, _) in enumerate(chat_results))
        )
        for (replica, chat, replies), reference in zip(chat_results, references, strict=True):
            assert len(replies) == TURNS
            assert chat.replays == (1 if replica == victim_url else 0)
            assert [r.replayed for r in replies] == [False, replica == victim_url, False]
            if replica == victim_url:
                assert replies[1].time_to_first_token_s is not None
                assert await client.replica_for("chat", chat.sequence_id) == fleet.urls[0]  # the one chat replica left
            assert [r.text for r in replies] == reference, chat
        assert len({tuple(r) for r in references}) > CHATS // 2, "conversations got the same replies: a weak check"

        # The replica comes back (a new process on the same address) and takes new sequences again.
        # Only the model the new sequences need: the fleet routes by what each replica has READY.
        await asyncio.to_thread(fleet.restart, victim, ["seq_stats_oldest"])  # returns once it is ready
        back_status = {s.url: s for s in await client.replicas(refresh=True)}[victim_url]
        assert back_status.healthy is True, back_status
        placed = []
        for i in range(60):
            async with stats.sequence() as seq:
                for k in range(3):
                    out = await seq.infer(X=_step_input(i, k))
                    assert int(out["COUNT"].reshape(-1)[0]) == k + 1
                    if k == 0:
                        placed.append(await client.replica_for("seq_stats_oldest", seq.sequence_id))
        back = placed.count(victim_url)
        assert back > 0, placed
        metrics = await client.replica_metrics(port=fleet.metrics)
        assert sorted(metrics) == sorted(fleet.urls)
        assert all(isinstance(text, str) and "nv_inference_request_success" in text for text in metrics.values())
        counts = (await client.replica_statistics("seq_stats_oldest"))[victim_url]
        assert not isinstance(counts, Exception)
        assert counts[0].inference_count >= 3 * back  # the new process counts only what came after its start
