"""Resuming a chat from its saved state (``ChatSession.state``, ``detach()``, ``resume=``), on the real `chat` model.

What a gateway in front of the SDK does across its restarts: a conversation detached in one client (the server keeps
it) goes on in another from the state alone, sending only the new message; a state whose conversation the server no
longer holds, or holds with another history, is a :class:`SequenceLost` (``replay_on_loss`` replays it), never a
mix of two histories. Replies are compared with a twin conversation on the same server that never left (greedy).
"""

from __future__ import annotations

import functools
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np
import pytest

from triton_npu_client import (
    ChatMessage,
    ChatMessageError,
    ChatOptionError,
    ChatSession,
    ChatState,
    Client,
    LocalTriton,
    SequenceClosedError,
    SequenceLost,
    SequenceUsageError,
    UsageError,
)
from triton_npu_client._protocol import EMPTY, history_digest

MODEL = "chat"
SYSTEM = "You are a helpful assistant."
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 8}
QUESTIONS = ("Good morning.", "Where do you live?", "Do you like to dance?", "What is your favourite book?")


def a_state(**changes: Any) -> ChatState:
    messages = (
        ChatMessage("system", SYSTEM),
        ChatMessage("user", "Good morning."),
        ChatMessage("assistant", "Bonjour, ça va ? 🌞"),
    )
    fields: dict[str, Any] = {
        "model": MODEL,
        "sequence_id": 2**63 - 1,
        "messages": messages,
        "pinned": 1,
        "digest": history_digest(EMPTY, [(m.role, m.text) for m in messages[:2]], messages[2].text),
        "turns": 1,
        "context_tokens": 42,
    }
    fields.update(changes)
    return ChatState(**fields)


# --- pure: the state's dict form -------------------------------------------------------------------


def test_a_state_round_trips_through_json() -> None:
    """to_dict() is plain JSON (every key, messages as role/text dicts); from_dict() of it gives the equal state."""
    for state in (a_state(), a_state(sequence_id="conversation-7", digest=EMPTY, turns=0, context_tokens=0)):
        data = state.to_dict()
        assert list(data) == ["model", "sequence_id", "messages", "pinned", "digest", "turns", "context_tokens"]
        assert data["messages"][2] == {"role": "assistant", "text": "Bonjour, ça va ? 🌞"}
        again = ChatState.from_dict(json.loads(json.dumps(data)))
        assert again == state
        assert isinstance(again.messages, tuple)
        assert type(again.sequence_id) is type(state.sequence_id)


def _without(key: str) -> dict[str, Any]:
    data = a_state().to_dict()
    del data[key]
    return data


def _with(**changes: Any) -> dict[str, Any]:
    return {**a_state().to_dict(), **changes}


@pytest.mark.parametrize(
    ("data", "error", "match"),
    [
        (_without("digest"), SequenceUsageError, r"missing key\(s\) 'digest'"),
        (_without("model"), SequenceUsageError, r"missing key\(s\) 'model'"),
        (_with(extra=1), SequenceUsageError, r"unknown key\(s\) 'extra'"),
        ([("model", MODEL)], SequenceUsageError, "a chat state is a mapping"),
        (_with(model=""), SequenceUsageError, "'model'"),
        (_with(sequence_id=0), SequenceUsageError, "'sequence_id'"),
        (_with(sequence_id=True), SequenceUsageError, "'sequence_id'"),
        (_with(sequence_id=2**63), SequenceUsageError, "'sequence_id'"),
        (_with(sequence_id=""), SequenceUsageError, "'sequence_id'"),
        (_with(sequence_id=1.5), SequenceUsageError, "'sequence_id'"),
        (_with(turns=-1), SequenceUsageError, "'turns'"),
        (_with(turns="1"), SequenceUsageError, "'turns'"),
        (_with(context_tokens=None), SequenceUsageError, "'context_tokens'"),
        (_with(pinned=2), SequenceUsageError, "'pinned'"),  # the second message is a user message
        (_with(pinned=4), SequenceUsageError, "'pinned'"),
        (_with(digest="not hex"), SequenceUsageError, "'digest'"),
        (_with(digest=7), SequenceUsageError, "'digest'"),
        (_with(messages="hello"), ChatMessageError, "'messages'"),
        (_with(messages=[["user", "hello"]]), ChatMessageError, r"'messages'\[0\]"),
        (_with(messages=[{"role": "user"}]), ChatMessageError, r"'messages'\[0\]"),
        (_with(messages=[{"role": "robot", "text": "x"}]), ChatMessageError, r"'messages'\[0\].*role"),
        (_with(messages=[{"role": "user", "text": 5}]), ChatMessageError, r"'messages'\[0\].*text"),
    ],
)
def test_a_malformed_state_dict_is_refused_naming_the_key(data: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match) as info:
        ChatState.from_dict(data)
    assert isinstance(info.value, UsageError)
    assert isinstance(info.value, ValueError)


# --- against the server ----------------------------------------------------------------------------


@pytest.fixture
async def client(triton_server: LocalTriton) -> AsyncIterator[Client]:
    async with Client(triton_server.grpc_url, timeout_s=120) as c:
        yield c


async def live(client: Client) -> int:
    """Conversations the chat model holds, counting the probe that asks (a one-token turn of its own)."""
    model = await client.model(MODEL)
    async with model.sequence() as probe:
        inputs = {"ROLE": np.array(["user"], object), "TEXT": np.array([b"hi"], object), "MAX_TOKENS": [1]}
        results = [r async for r in probe.stream(inputs)]
    return int(results[-1]["LIVE"].reshape(-1)[0])


async def both_ask(chat: ChatSession, twin: ChatSession, question: str) -> str:
    """The same question to a chat and its twin: the replies must be the same (greedy, the same history)."""
    reply = await chat.ask(question)
    expected = await twin.ask(question)
    assert (reply.text, reply.tokens, reply.context_tokens) == (expected.text, expected.tokens, expected.context_tokens)
    assert chat.messages == twin.messages
    return reply.text


async def test_resume_refuses_what_the_state_already_says(client: Client) -> None:
    """The state holds the conversation and its id: system=, history= and sequence_id= beside resume= are refused,
    naming them, as is a state of another model or a value that is not a state; all before anything is sent."""
    state = a_state()
    model = await client.model(MODEL)
    by_name: Callable[..., ChatSession] = functools.partial(client.chat, MODEL)
    for open_chat in (by_name, model.chat):
        with pytest.raises(SequenceUsageError, match=r"system= cannot be given"):
            open_chat(resume=state, system=SYSTEM)
        with pytest.raises(SequenceUsageError, match=r"system=, history=, sequence_id= cannot be given"):
            open_chat(resume=state, system=SYSTEM, history=[], sequence_id=5)
        with pytest.raises(ChatOptionError, match="'resume'"):
            open_chat(resume=state.to_dict())  # type: ignore[arg-type]  # a dict, not a state
    with pytest.raises(SequenceUsageError, match="a chat on model 'chat', not 'chat_small'"):
        client.chat("chat_small", resume=state)
    with pytest.raises(SequenceUsageError, match="a chat on model 'chat', not 'chat_small'"):
        (await client.model("chat_small")).chat(resume=state)


async def test_a_detached_chat_goes_on_in_another_client_sending_only_the_new_message(
    triton_server: LocalTriton, client: Client
) -> None:
    """A chat detached in one client (no END: the server keeps it) is resumed in a second client from its state,
    through JSON: same id, no replay, the turn prefills only what it adds (the new message, not the history), and
    every reply is the twin's. Closing the resumed chat frees the conversation."""
    baseline = await live(client)
    async with client.chat(MODEL, system=SYSTEM, **GREEDY) as twin:
        async with Client(triton_server.grpc_url, timeout_s=120) as first:
            chat = first.chat(MODEL, system=SYSTEM, **GREEDY)
            for question in QUESTIONS[:2]:
                await both_ask(chat, twin, question)
            state = await chat.detach()
            assert state == chat.state
            assert (state.model, state.sequence_id, state.messages) == (MODEL, chat.sequence_id, twin.messages)
            assert (state.turns, state.context_tokens, state.pinned) == (2, twin.context_tokens, 1)
            assert state.digest == twin.state.digest != EMPTY
            with pytest.raises(SequenceClosedError):
                await chat.ask("Are you there?")
            await chat.aclose()  # after detach: sends nothing
            assert await chat.detach() == state
        saved = json.dumps(state.to_dict())
        assert await live(client) == baseline + 2  # the twin and the detached conversation

        resumed = client.chat(MODEL, resume=ChatState.from_dict(json.loads(saved)), **GREEDY)
        assert resumed.state == state  # before it reached the model: the state it was resumed from
        reply = await resumed.ask(QUESTIONS[2])
        expected = await twin.ask(QUESTIONS[2])
        assert (reply.text, reply.tokens) == (expected.text, expected.tokens)
        assert reply.context_tokens == expected.context_tokens
        # Nothing of the history was prefilled again: at most what this turn added to the conversation's cache.
        assert 0 < reply.prompt_tokens <= reply.context_tokens - state.context_tokens
        assert not reply.replayed
        assert (resumed.sequence_id, resumed.replays, resumed.turns) == (state.sequence_id, 0, 3)
        assert resumed.messages == twin.messages
        assert await live(client) == baseline + 2  # the same conversation, not a new one
        await both_ask(resumed, twin, QUESTIONS[3])
        await resumed.aclose()
        assert await live(client) == baseline + 1
    assert await live(client) == baseline


async def test_a_replay_of_the_same_state_would_prefill_the_history(client: Client) -> None:
    """The yardstick of the test above: the same conversation replayed into a fresh chat (history=state.messages)
    prefills the whole history, several times what a resumed turn prefills."""
    async with client.chat(MODEL, system=SYSTEM, **GREEDY) as chat:
        for question in QUESTIONS[:2]:
            await chat.ask(question)
        state = await chat.detach()
    resumed = client.chat(MODEL, resume=state, **GREEDY)
    resumed_turn = await resumed.ask(QUESTIONS[2])
    await resumed.aclose()
    # A different system message keeps the replay off the prefix blocks the resumed conversation shares.
    messages = (ChatMessage("system", SYSTEM + " Always."), *state.messages[1:])
    async with client.chat(MODEL, history=messages, **GREEDY) as replayed:
        replay_turn = await replayed.ask(QUESTIONS[2])
    assert replay_turn.prompt_tokens > 3 * resumed_turn.prompt_tokens


async def test_resuming_a_conversation_the_server_ended_raises_sequence_lost_or_replays(client: Client) -> None:
    """The state's conversation was ended on the server (its chat closed, END): a resumed turn raises SequenceLost
    and the chat is lost; with replay_on_loss (here through model.chat) the turn replays the state's messages into a
    fresh sequence, once, and answers as the twin does."""
    baseline = await live(client)
    async with client.chat(MODEL, system=SYSTEM, **GREEDY) as twin:
        async with client.chat(MODEL, system=SYSTEM, **GREEDY) as chat:
            for question in QUESTIONS[:2]:
                await both_ask(chat, twin, question)
            state = chat.state
        lost = client.chat(MODEL, resume=state, **GREEDY)
        with pytest.raises(SequenceLost):
            await lost.ask(QUESTIONS[2])
        assert (lost.is_lost, lost.is_open, lost.replays) == (True, False, 0)
        assert (lost.turns, lost.messages) == (2, state.messages)
        await lost.aclose()
        with pytest.raises(SequenceClosedError, match="conversation was ended"):
            await lost.detach()  # closed (END sent): there is nothing left to keep

        model = await client.model(MODEL)
        replaying = model.chat(resume=state, replay_on_loss=True, **GREEDY)
        reply = await replaying.ask(QUESTIONS[2])
        expected = await twin.ask(QUESTIONS[2])
        assert (reply.text, reply.context_tokens) == (expected.text, expected.context_tokens)
        assert reply.replayed
        assert (replaying.replays, replaying.turns, replaying.is_lost) == (1, 3, False)
        assert replaying.sequence_id != state.sequence_id
        assert replaying.messages == twin.messages
        await both_ask(replaying, twin, QUESTIONS[3])
        await replaying.aclose()
    assert await live(client) == baseline


async def test_a_state_one_turn_behind_rolls_back_the_turn_it_missed(client: Client) -> None:
    """A turn completed on the server after the state was taken (the gateway died before saving the newer state):
    resuming the older state makes the server undo that turn, and the conversation goes on from the state, as its
    twin (which never had that turn) does. The newer state now names a history the server no longer holds: its
    resumed turn raises SequenceLost and keeps nothing, never a mix of the two histories."""
    baseline = await live(client)
    async with client.chat(MODEL, system=SYSTEM, **GREEDY) as twin:
        chat = client.chat(MODEL, system=SYSTEM, **GREEDY)
        await both_ask(chat, twin, QUESTIONS[0])
        stale = chat.state
        await chat.ask("Tell me a story.")  # committed on the server; the stale state does not know it
        newer = await chat.detach()
        assert newer.turns == stale.turns + 1

        resumed = client.chat(MODEL, resume=stale, **GREEDY)
        await both_ask(resumed, twin, QUESTIONS[1])
        assert (resumed.sequence_id, resumed.replays, resumed.turns) == (stale.sequence_id, 0, 2)
        await both_ask(resumed, twin, QUESTIONS[2])

        late = client.chat(MODEL, resume=newer, **GREEDY)
        with pytest.raises(SequenceLost, match="history"):
            await late.ask(QUESTIONS[1])
        assert (late.is_lost, late.turns, late.messages) == (True, newer.turns, newer.messages)
        await late.aclose()  # ends the sequence: one chat per state's conversation at a time
        await resumed.aclose()
    assert await live(client) == baseline


async def test_a_state_two_turns_behind_is_lost_and_replays(client: Client) -> None:
    """Two turns behind is more than the server can undo: the history is refused as unknown, a SequenceLost; with
    replay_on_loss the turn replays the state's messages into a fresh sequence and answers as the twin that stopped
    where the state did (the refused id is ENDed, so the conversation two turns ahead is freed)."""
    baseline = await live(client)
    async with client.chat(MODEL, system=SYSTEM, **GREEDY) as twin:
        chat = client.chat(MODEL, system=SYSTEM, **GREEDY)
        await both_ask(chat, twin, QUESTIONS[0])
        stale = chat.state
        await chat.ask("Tell me a story.")
        await chat.ask("Tell me another.")
        await chat.detach()
        assert await live(client) == baseline + 2

        replaying = client.chat(MODEL, resume=stale, replay_on_loss=True, **GREEDY)
        await both_ask(replaying, twin, QUESTIONS[1])
        assert replaying.last_reply is not None
        assert replaying.last_reply.replayed
        assert (replaying.replays, replaying.turns) == (1, 2)
        assert replaying.sequence_id != stale.sequence_id
        assert await live(client) == baseline + 2  # the twin and the replay: the refused conversation was ended
        await replaying.aclose()
    assert await live(client) == baseline


async def test_while_a_turn_streams_the_state_is_the_one_before_it_and_detach_cancels_the_turn(client: Client) -> None:
    """state, read while a turn streams, is the state before it; detach() then cancels the turn (the server rolls it
    back, its reader gets SequenceClosedError) and returns that state, from which the conversation goes on as its
    twin's, which never had the cancelled turn."""
    baseline = await live(client)
    async with client.chat(MODEL, system=SYSTEM, **GREEDY) as twin:
        chat = client.chat(MODEL, system=SYSTEM, **GREEDY)
        await both_ask(chat, twin, QUESTIONS[0])
        before = chat.state
        pieces = chat.send("Tell me a very long story.", max_tokens=1200, min_tokens=1200)
        await anext(pieces)
        assert chat.is_streaming
        assert chat.state == before
        assert await chat.detach() == before
        with pytest.raises(SequenceClosedError, match="closed while this step streamed"):
            await anext(pieces)
        await pieces.aclose()

        resumed = client.chat(MODEL, resume=before, **GREEDY)
        await both_ask(resumed, twin, QUESTIONS[1])
        assert (resumed.sequence_id, resumed.replays, resumed.turns) == (before.sequence_id, 0, 2)
        await resumed.aclose()
    assert await live(client) == baseline


async def test_a_state_with_nothing_committed_starts_its_sequence_with_its_messages(client: Client) -> None:
    """A state taken before the first turn (digest ""): the server holds none of its messages, so the resumed chat's
    first turn starts the state's id (START) sending them, and answers as a fresh chat does."""
    baseline = await live(client)
    async with client.chat(MODEL, system=SYSTEM, **GREEDY) as twin:
        async with client.chat(MODEL, system=SYSTEM, **GREEDY) as chat:
            state = await chat.detach()
        assert (state.digest, state.turns, state.messages) == (EMPTY, 0, (ChatMessage("system", SYSTEM),))
        async with client.chat(MODEL, resume=state, **GREEDY) as resumed:
            await both_ask(resumed, twin, QUESTIONS[0])
            assert (resumed.sequence_id, resumed.replays, resumed.turns) == (state.sequence_id, 0, 1)
            await both_ask(resumed, twin, QUESTIONS[1])
    assert await live(client) == baseline


async def test_closing_a_resumed_chat_before_any_turn_ends_the_conversation(client: Client) -> None:
    """A resumed chat owns the conversation from the start: closed without a turn of its own, by name before it
    reached the model or on a model handle, it still sends END and the server frees the conversation."""
    baseline = await live(client)
    model = await client.model(MODEL)
    by_name: Callable[..., ChatSession] = functools.partial(client.chat, MODEL)
    for open_chat in (by_name, model.chat):
        chat = client.chat(MODEL, system=SYSTEM, **GREEDY)
        await chat.ask(QUESTIONS[0])
        state = await chat.detach()
        assert await live(client) == baseline + 1
        resumed = open_chat(resume=state)
        assert resumed.state == state
        await resumed.aclose()
        assert await live(client) == baseline
        with pytest.raises(SequenceClosedError):
            await resumed.ask(QUESTIONS[1])


async def test_a_resumed_chat_through_a_fleet_goes_to_the_replica_its_start_went_to(
    triton_server: LocalTriton, client: Client
) -> None:
    """In a fleet a resumed turn has no pin in its process: it is placed by rendezvous hashing, as its START was in
    the process that started it, so on the same replica (whatever order the URLs are given in), and it goes on
    there without a replay. (The two URLs reach one server here: what is checked is the placement, and that the
    fleet sends the pinless, START-less turn rather than refusing it.)"""
    urls = [f"grpc://127.0.0.1:{triton_server.grpc_port}", f"grpc://localhost:{triton_server.grpc_port}"]
    baseline = await live(client)
    async with client.chat(MODEL, system=SYSTEM, **GREEDY) as twin:
        await twin.ask(QUESTIONS[0])
        expected = await twin.ask(QUESTIONS[1])
    async with Client(urls, timeout_s=120) as first:
        # One conversation on each replica: ids picked where rendezvous puts them.
        ids: dict[str, int] = {}
        candidate = int.from_bytes(np.random.default_rng().bytes(7), "big") + 1
        while len(ids) < 2:
            ids.setdefault(str(await first.replica_for(MODEL, candidate)), candidate)
            candidate += 1
        states = {}
        for url, sequence_id in ids.items():
            chat = first.chat(MODEL, system=SYSTEM, sequence_id=sequence_id, **GREEDY)
            await chat.ask(QUESTIONS[0])
            assert await first.replica_for(MODEL, sequence_id) == url  # its pin
            states[url] = await chat.detach()
    assert set(states) == set(urls)
    async with Client(list(reversed(urls)), timeout_s=120) as second:
        for url, state in states.items():
            assert await second.replica_for(MODEL, state.sequence_id) == url  # no pin yet: where it would go
            async with second.chat(MODEL, resume=state, **GREEDY) as resumed:
                reply = await resumed.ask(QUESTIONS[1])
                assert (reply.text, reply.context_tokens) == (expected.text, expected.context_tokens)
                assert (resumed.replays, resumed.sequence_id) == (0, state.sequence_id)
                assert await second.replica_for(MODEL, state.sequence_id) == url  # pinned where it went
    assert await live(client) == baseline
