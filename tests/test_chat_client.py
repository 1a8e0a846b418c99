"""Chat sessions from the client side: pieces, options, history, cancellation, refusals; against the real `chat` model.

Replies are compared with other replies of the same server (greedy, or sampled with a seed), never with
hard-coded text: the demo model's words are whatever its weights make them.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
from collections.abc import AsyncIterator
from typing import Any

import attrs
import grpc
import numpy as np
import pytest

from triton_npu_client import (
    Call,
    ChatBusyError,
    ChatHistoryMismatch,
    ChatMessage,
    ChatMessageError,
    ChatOptionError,
    ChatOptions,
    ChatReply,
    ChatSession,
    Client,
    InternalServerError,
    InvalidArgumentError,
    LocalTriton,
    ModelNotFoundError,
    RequestTimeout,
    SequenceClosedError,
    SequenceLost,
    SequenceUsageError,
    UsageError,
)
from triton_npu_client._call import Caller
from triton_npu_client._protocol import EMPTY, history_digest
from triton_npu_client._sessions import _chat as chat_module
from triton_npu_client._sessions._chat import PieceDecoder, as_messages
from triton_npu_client._transport._stream import OwnStreamCall

MODEL = "chat"
SYSTEM = "You are a helpful assistant."


# --- pure: the piece decoder ---------------------------------------------------------------------


@pytest.mark.parametrize("char", ["é", "€", "😀"], ids=["2-byte", "3-byte", "4-byte"])
def test_pieces_that_split_a_character_decode_to_it(char: str) -> None:
    """A character split across pieces at any byte comes out whole, once, with no replacement character."""
    text = f"a{char}b{char}"
    data = text.encode()
    assert len(char.encode()) in (2, 3, 4)
    for cut in range(len(data) + 1):
        decoder = PieceDecoder()
        parts = [decoder.feed(data[:cut]), decoder.feed(data[cut:]), decoder.flush()]
        assert "".join(parts) == text
        assert all("\ufffd" not in p for p in parts)
    decoder = PieceDecoder()
    one_by_one = [decoder.feed(data[i : i + 1]) for i in range(len(data))]
    assert "".join(one_by_one) + decoder.flush() == text
    # A piece inside a character yields nothing until the character is complete.
    assert one_by_one[1 : len(char.encode())] == [""] * (len(char.encode()) - 1)


def test_invalid_bytes_become_the_replacement_character() -> None:
    """Invalid or truncated UTF-8 becomes U+FFFD, never an exception; a truncated tail shows at flush."""
    decoder = PieceDecoder()
    assert decoder.feed(b"a\xffb") == "a\ufffdb"
    assert decoder.feed(b"\xe2\x82") == ""  # maybe the start of a character
    assert decoder.flush() == "\ufffd"  # the turn ended inside it
    assert decoder.feed(b"\x80ok") == "\ufffdok"  # a lone continuation byte; the decoder was reset by flush


def test_incremental_decoding_equals_decoding_the_whole_reply() -> None:
    """However random bytes are cut into pieces, the text equals decoding them at once with replacement.

    The server re-encodes the whole reply's text that way into the history, so the client's text is the text
    the server keeps.
    """
    rng = random.Random(1)
    alphabet = [b"a", b" ", "é".encode(), "€".encode(), "😀".encode(), b"\xff", b"\xc3", b"\x80", b"\xf0\x9f"]
    for _ in range(300):
        data = b"".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 12)))
        cuts = sorted(rng.sample(range(len(data) + 1), k=min(3, len(data) + 1)))
        pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
        decoder = PieceDecoder()
        text = "".join(decoder.feed(p) for p in pieces) + decoder.flush()
        assert text == data.decode("utf-8", errors="replace"), pieces


# --- pure: options and messages --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("option", "value", "expected"),
    [
        ("max_tokens", -3, "an int >= 1"),
        ("max_tokens", 2.5, "an int >= 1"),
        ("max_tokens", True, "an int >= 1"),
        ("max_tokens", "8", "an int >= 1"),
        ("max_tokens", 2**31, "an int >= 1"),
        ("min_tokens", -1, "an int >= 0"),
        ("min_tokens", 1.0, "an int >= 0"),
        ("temperature", -0.1, "a number >= 0"),
        ("temperature", math.nan, "a number >= 0"),
        ("temperature", math.inf, "a number >= 0"),
        ("temperature", "0.5", "a number >= 0"),
        ("top_p", 0, "a number in (0, 1]"),
        ("top_p", 1.5, "a number in (0, 1]"),
        ("top_p", math.nan, "a number in (0, 1]"),
        ("top_k", -1, "an int >= 0"),
        ("top_k", 2.0, "an int >= 0"),
        ("seed", 2**63, "an int in the int64 range"),
        ("seed", 1.0, "an int in the int64 range"),
        ("stop", "###", "a list of non-empty strings"),
        ("stop", [""], "a list of non-empty strings"),
        ("stop", ["ok", ""], "a list of non-empty strings"),
        ("stop", [b"x"], "a list of non-empty strings"),
        ("stop", 5, "a list of non-empty strings"),
    ],
)
def test_an_invalid_option_is_refused_naming_it(option: str, value: Any, expected: str) -> None:
    """Each bad value raises ChatOptionError naming the option, what it takes and what was given."""
    with pytest.raises(ChatOptionError) as info:
        ChatOptions(**{option: value})
    err = info.value
    assert isinstance(err, UsageError)
    assert isinstance(err, ValueError)
    assert err.option == option
    assert err.given is value
    assert expected in err.expected
    assert f"chat option {option!r}" in str(err)
    assert expected in str(err)
    assert repr(value) in str(err)
    # A turn's override is checked the same way.
    with pytest.raises(ChatOptionError) as again:
        ChatOptions().override(**{option: value})
    assert again.value.option == option


def test_min_tokens_above_max_tokens_is_refused() -> None:
    """min_tokens may not exceed max_tokens when both are known, at open or after a turn's override."""
    with pytest.raises(ChatOptionError, match=r"'min_tokens': expected an int in 0..max_tokens \(4\), given 5"):
        ChatOptions(max_tokens=4, min_tokens=5)
    with pytest.raises(ChatOptionError) as info:
        ChatOptions(min_tokens=8).override(max_tokens=6)
    assert (info.value.option, info.value.given) == ("min_tokens", 8)
    assert ChatOptions(min_tokens=8).override(max_tokens=8).inputs()["MIN_TOKENS"].tolist() == [8]


def test_options_override_and_inputs() -> None:
    """Per-turn options replace the defaults they name; only options that are set become inputs, typed."""
    defaults = ChatOptions(max_tokens=5, stop=["###"])
    turn = defaults.override(temperature=0.5, max_tokens=None, seed=7)
    assert (turn.max_tokens, turn.temperature, turn.seed, turn.stop) == (5, 0.5, 7, ("###",))
    assert defaults.override() is defaults
    inputs = turn.inputs()
    assert sorted(inputs) == ["MAX_TOKENS", "SEED", "STOP", "TEMPERATURE"]
    assert inputs["MAX_TOKENS"].dtype == np.int32
    assert inputs["MAX_TOKENS"].tolist() == [5]
    assert inputs["TEMPERATURE"].dtype == np.float32
    assert inputs["TEMPERATURE"].tolist() == [0.5]
    assert inputs["SEED"].dtype == np.int64
    assert inputs["SEED"].tolist() == [7]
    assert inputs["STOP"].tolist() == [b"###"]
    # An empty list overrides default stop strings with none.
    assert "STOP" not in defaults.override(stop=[]).inputs()
    assert ChatOptions().inputs() == {}
    full = ChatOptions(top_p=0.9, top_k=40).inputs()
    assert full["TOP_P"].dtype == np.float32
    assert full["TOP_K"].dtype == np.int32


def test_history_items_and_message_checks() -> None:
    """History takes ChatMessage values and (role, text) pairs; a bad role, item or text is refused clearly."""
    history = as_messages([("system", "s"), ChatMessage("user", "u"), ("assistant", "a")])
    assert history == (ChatMessage("system", "s"), ChatMessage("user", "u"), ChatMessage("assistant", "a"))
    assert as_messages(None) == ()
    with pytest.raises(ChatMessageError, match="role is one of system, user, assistant, tool; given 'bot'"):
        as_messages([("bot", "hi")])
    with pytest.raises(ChatMessageError, match=r"history\[1\]: expected a ChatMessage or a \(role, text\) pair"):
        as_messages([("user", "a"), ["user", "b"]])  # type: ignore[list-item]
    with pytest.raises(ChatMessageError, match="given a string"):
        as_messages("user: hi")  # type: ignore[arg-type]
    with pytest.raises(ChatMessageError, match="text is a str; given bytes"):
        ChatMessage("user", b"hi")  # type: ignore[arg-type]
    with pytest.raises(ChatMessageError, match="encodable as UTF-8"):
        ChatMessage("user", "\ud800")


def test_a_reply_reads_as_its_text() -> None:
    """str(reply) is the text; tokens_per_s covers the whole turn and is 0 for an instant one."""
    reply = ChatReply(
        text="hi", finish_reason="stop", tokens=10, prompt_tokens=4, context_tokens=16, dropped=0,
        time_to_first_token_s=0.5, elapsed_s=2.0,
    )
    assert str(reply) == "hi"
    assert reply.tokens_per_s == 5.0
    assert attrs.evolve(reply, elapsed_s=0.0).tokens_per_s == 0.0


# --- against the server ----------------------------------------------------------------------------


@pytest.fixture
async def client(triton_server: LocalTriton) -> AsyncIterator[Client]:
    async with Client(triton_server.grpc_url, timeout_s=120) as c:
        yield c


async def replies(chat: ChatSession, questions: list[str], **options: Any) -> list[ChatReply]:
    return [await chat.ask(q, **options) for q in questions]


async def test_pieces_join_to_the_reply(client: Client) -> None:
    """send() yields non-empty str pieces that join to last_reply.text; the reply's counts are the server's."""
    async with client.chat(MODEL, system=SYSTEM, max_tokens=24) as chat:
        assert chat.messages == (ChatMessage("system", SYSTEM),)
        pieces = [p async for p in chat.send("Tell me about the weather today.")]
        reply = chat.last_reply
        assert reply is not None
        assert pieces
        assert all(isinstance(p, str) and p for p in pieces)
        assert "".join(pieces) == reply.text == str(reply)
        assert 0 < reply.tokens <= 24
        assert reply.finish_reason in ("stop", "length")
        assert reply.prompt_tokens > 0
        assert reply.context_tokens == chat.context_tokens >= reply.prompt_tokens
        assert reply.time_to_first_token_s is not None
        assert 0 < reply.time_to_first_token_s <= reply.elapsed_s
        assert reply.tokens_per_s > 0
        assert chat.turns == 1
        # ask() returns the same record that last_reply holds afterwards.
        second = await chat.ask("And tomorrow?")
        assert second is chat.last_reply
        assert chat.turns == 2
        assert chat.context_tokens > reply.context_tokens


async def test_length_options_reach_the_server_per_turn(client: Client) -> None:
    """max_tokens / min_tokens set at open are the defaults; a turn's own override them for that turn only.

    min_tokens keeps the demo model from ending early, so max_tokens alone decides where each reply stops.
    """
    async with client.chat(MODEL, system=SYSTEM, max_tokens=3, min_tokens=3) as chat:
        first = await chat.ask("Please describe the countryside in detail.")
        assert (first.finish_reason, first.tokens) == ("length", 3)
        second = await chat.ask("Please describe the town in detail.", max_tokens=5, min_tokens=5)
        assert (second.finish_reason, second.tokens) == ("length", 5)
        third = await chat.ask("Please describe the house in detail.")
        assert (third.finish_reason, third.tokens) == ("length", 3)
        # Without min_tokens the default max_tokens still caps the reply.
        fourth = await chat.ask("Say something.", min_tokens=0)
        assert 0 <= fourth.tokens <= 3


async def test_a_seed_makes_sampling_repeatable(client: Client) -> None:
    """With temperature > 0, the same seed gives the same reply in two fresh chats; other seeds differ."""

    async def sampled(seed: int) -> str:
        async with client.chat(MODEL, system=SYSTEM, temperature=1.2) as chat:
            return (await chat.ask("What shall we do this evening?", max_tokens=24, min_tokens=8, seed=seed)).text

    first = await sampled(7)
    assert await sampled(7) == first
    others = {await sampled(seed) for seed in (8, 9, 10)}
    assert others != {first}  # the seed reached the sampler: three other seeds do not all repeat it


async def test_stop_strings_cut_the_reply(client: Client) -> None:
    """A stop string taken from a greedy reply cuts the same reply there, finishing with "stop_string"."""
    question = "Tell me a story about a ball."
    async with client.chat(MODEL, system=SYSTEM) as chat:
        full = await chat.ask(question, max_tokens=32, min_tokens=32)
    # Three characters from the reply's second half, none a replacement character (the server matches bytes).
    starts = [k for k in range(len(full.text) // 2, len(full.text) - 2) if "\ufffd" not in full.text[k : k + 3]]
    assert starts, full
    stop = full.text[starts[0] : starts[0] + 3]
    async with client.chat(MODEL, system=SYSTEM, stop=[stop]) as chat:
        cut = await chat.ask(question, max_tokens=32, min_tokens=32)
    assert cut.finish_reason == "stop_string"
    assert cut.text == full.text[: full.text.index(stop)]


async def test_messages_grow_by_two_per_completed_turn(client: Client) -> None:
    """Each completed turn adds its user message and the assistant's reply text, after the system message."""
    async with client.chat(MODEL, system=SYSTEM, max_tokens=8) as chat:
        got = await replies(chat, ["Hello.", "How are you?", "Goodbye."])
        expected = [ChatMessage("system", SYSTEM)]
        for question, reply in zip(["Hello.", "How are you?", "Goodbye."], got, strict=True):
            expected += [ChatMessage("user", question), ChatMessage("assistant", reply.text)]
        assert chat.messages == tuple(expected)
        assert chat.turns == 3


async def test_a_turn_cut_short_is_rolled_back(client: Client) -> None:
    """A turn left after its first piece (inside aclosing) is not in the history, here or on the server.

    The next turn's greedy reply equals the reply of a chat that never had the cancelled turn, and so do the
    context counts: the server rolled it back.
    """
    async with client.chat(MODEL, system=SYSTEM, max_tokens=12) as chat:
        await chat.ask("Good morning.")
        before = chat.messages
        left_early = False
        long_turn = chat.send("Tell me a very long story.", max_tokens=400, min_tokens=400)
        async with contextlib.aclosing(long_turn) as pieces:
            async for _ in pieces:
                left_early = True
                break
        assert left_early
        assert chat.messages == before
        assert chat.turns == 1
        assert chat.last_reply is not None
        assert chat.last_reply.text == before[-1].text
        after = await chat.ask("What is your name?")
        assert chat.messages == (
            *before, ChatMessage("user", "What is your name?"), ChatMessage("assistant", after.text)
        )

    async with client.chat(MODEL, system=SYSTEM, max_tokens=12) as clean:
        await clean.ask("Good morning.")
        expected = await clean.ask("What is your name?")
    assert after.text == expected.text
    assert after.context_tokens == expected.context_tokens


async def test_a_loop_left_at_the_last_piece_keeps_the_turn(client: Client) -> None:
    """The turn is recorded before its last piece is handed out: leaving the loop at that piece keeps it, as the
    server does (its call had completed), and the next turn sees the same history on both sides."""
    async with client.chat(MODEL, system=SYSTEM) as clean:
        all_pieces = [p async for p in clean.send("Good morning.", max_tokens=8, min_tokens=8)]
        expected = await clean.ask("What is your name?", max_tokens=12)
    async with client.chat(MODEL, system=SYSTEM) as chat:
        seen = []
        async with contextlib.aclosing(chat.send("Good morning.", max_tokens=8, min_tokens=8)) as pieces:
            async for piece in pieces:
                seen.append(piece)
                if len(seen) == len(all_pieces):
                    break  # at the last piece, before the generator returns
        assert seen == all_pieces
        assert chat.turns == 1
        assert chat.last_reply is not None
        assert chat.last_reply.text == "".join(all_pieces)
        after = await chat.ask("What is your name?", max_tokens=12)
    assert (after.text, after.context_tokens) == (expected.text, expected.context_tokens)


async def test_a_cancelled_task_rolls_its_turn_back(client: Client) -> None:
    """Cancelling the task that reads a turn rolls the turn back; the chat goes on (even when it was the first)."""
    async with client.chat(MODEL, system=SYSTEM, max_tokens=12) as chat:
        streaming = asyncio.Event()

        async def read() -> None:
            async for _ in chat.send("Tell me a very long story.", max_tokens=400, min_tokens=400):
                streaming.set()

        task = asyncio.create_task(read())
        await streaming.wait()
        assert chat.is_streaming
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not chat.is_streaming
        assert chat.messages == (ChatMessage("system", SYSTEM),)
        assert chat.turns == 0
        # The cancelled first turn took the system message with it: the next turn sends it again.
        reply = await chat.ask("What is your name?")
    async with client.chat(MODEL, system=SYSTEM, max_tokens=12) as clean:
        expected = await clean.ask("What is your name?")
    assert reply.text == expected.text
    assert reply.context_tokens == expected.context_tokens


async def test_a_second_turn_while_one_streams_is_refused_at_once(client: Client) -> None:
    """send() while a turn streams raises ChatBusyError at the call; the streaming turn is unharmed."""
    async with client.chat(MODEL, system=SYSTEM) as chat:
        early = chat.send("A second question.")  # made before the first turn starts, started while it streams
        first = chat.send("Tell me a long story.", max_tokens=40, min_tokens=8)
        pieces = [await anext(first)]
        with pytest.raises(ChatBusyError, match="a turn is still streaming") as info:
            chat.send("Another question.")
        assert isinstance(info.value, UsageError)
        with pytest.raises(ChatBusyError):
            await anext(early)
        with pytest.raises(ChatBusyError):
            await chat.ask("Yet another.")
        pieces += [p async for p in first]
        reply = chat.last_reply
        assert reply is not None
        assert "".join(pieces) == reply.text
        assert chat.turns == 1
        assert len(chat.messages) == 3
        assert (await chat.ask("Now a second question.", max_tokens=4)).tokens > 0
        assert chat.turns == 2


async def test_options_are_checked_before_anything_is_sent(client: Client) -> None:
    """A bad option raises at client.chat() or at send() itself, before any iteration; the chat is unharmed."""
    with pytest.raises(ChatOptionError, match="'top_p'"):
        async with client.chat(MODEL, top_p=0):
            pass
    async with client.chat(MODEL, system=SYSTEM, max_tokens=4) as chat:
        with pytest.raises(ChatOptionError, match="'max_tokens'") as info:
            chat.send("hi", max_tokens=-1)
        assert info.value.given == -1
        with pytest.raises(ChatOptionError, match="'stop'"):
            await chat.ask("hi", stop="END")
        for timeout_s in (0, -1.0, math.nan, "1"):
            with pytest.raises(ChatOptionError, match="'timeout_s': expected a number of seconds > 0"):
                chat.send("hi", timeout_s=timeout_s)  # type: ignore[arg-type]
        assert chat.turns == 0
        assert (await chat.ask("hi")).tokens > 0
    with pytest.raises(ChatOptionError, match="'replay_on_loss': expected a bool, given 'yes'"):
        (await client.model(MODEL)).chat(replay_on_loss="yes")  # type: ignore[arg-type]


async def test_an_http_client_is_refused_at_open(triton_server: LocalTriton) -> None:
    """Over HTTP, client.chat() and model.chat() refuse with a clear SequenceUsageError before any inference."""
    async with Client(triton_server.http_url) as http:
        before = (await http.inference_statistics(MODEL))[0].inference_count
        with pytest.raises(SequenceUsageError, match=r"serves only over the gRPC stream.*speaks http.*grpc://"):
            async with http.chat(MODEL, system=SYSTEM):
                pass
        model = await http.model(MODEL)
        with pytest.raises(SequenceUsageError, match="gRPC stream"):
            model.chat()
        assert (await http.inference_statistics(MODEL))[0].inference_count == before


async def test_a_model_that_is_not_a_chat_model_is_refused(client: Client) -> None:
    """A decoupled sequence model without ROLE/TEXT/PIECE is refused at open, naming what it lacks."""
    with pytest.raises(SequenceUsageError, match=r"'seq_count_stream' is not a chat model \(it lacks: ROLE, TEXT"):
        async with client.chat("seq_count_stream"):
            pass
    with pytest.raises(SequenceUsageError, match="lacks: decoupled, sequence batching, ROLE"):
        async with client.chat("scale_fp32"):
            pass


async def test_history_replay_gives_the_same_tokens(client: Client) -> None:
    """A fresh chat opened with history=old.messages answers the next question exactly as the old chat does."""
    questions = ["Good morning.", "Where do you live?", "Do you like to dance?"]
    async with client.chat(MODEL, system=SYSTEM, max_tokens=16) as old:
        await replies(old, questions)
        history = old.messages
        expected = await old.ask("What is your favourite book?")
    # The system message rides inside the history.
    async with client.chat(MODEL, history=history, max_tokens=16) as replayed:
        assert replayed.messages == history
        got = await replayed.ask("What is your favourite book?")
        assert replayed.messages[: len(history)] == history
    assert (got.text, got.tokens) == (expected.text, expected.tokens)
    assert got.context_tokens == expected.context_tokens
    # (role, text) pairs work the same.
    async with client.chat(MODEL, history=[(m.role, m.text) for m in history], max_tokens=16) as pairs:
        assert (await pairs.ask("What is your favourite book?")).text == expected.text


async def test_messages_drop_what_the_server_drops_when_the_context_overflows(client: Client) -> None:
    """Long turns overflow the context: the server drops the oldest messages (never the system message), and
    chat.messages drops the same ones, so a replay still gives exactly the same next reply."""
    long_text = "Tell me about the garden and the house. " * 40  # about 400 tokens: three turns fill the context
    transcript = [ChatMessage("system", SYSTEM)]
    async with client.chat(MODEL, system=SYSTEM, max_tokens=4) as chat:
        dropped = 0
        for i in range(5):
            reply = await chat.ask(f"{i}. {long_text}")
            dropped += reply.dropped
            transcript += [ChatMessage("user", f"{i}. {long_text}"), ChatMessage("assistant", reply.text)]
        assert dropped > 0
        assert chat.messages == (transcript[0], *transcript[1 + dropped :])
        history = chat.messages
        expected = await chat.ask("What is your name?")
    async with client.chat(MODEL, history=history, max_tokens=4) as replayed:
        got = await replayed.ask("What is your name?")
    assert (got.text, got.dropped, got.context_tokens) == (expected.text, expected.dropped, expected.context_tokens)


async def test_closing_the_chat_frees_the_conversation(client: Client) -> None:
    """Leaving the block sends END: the server no longer holds the conversation (LIVE counts it out)."""

    async def live() -> int:
        """Conversations the model holds, counting the probe that asks (a one-token turn of its own)."""
        model = await client.model(MODEL)
        async with model.sequence() as probe:
            inputs = {"ROLE": np.array(["user"], object), "TEXT": np.array([b"hi"], object), "MAX_TOKENS": [1]}
            results = [r async for r in probe.stream(inputs)]
        return int(results[-1]["LIVE"].reshape(-1)[0])

    async with client.chat(MODEL, max_tokens=2) as chat:
        await chat.ask("hello")
        while_open = await live()
    assert await live() == while_open - 1


async def test_a_lost_conversation_raises_sequence_lost(client: Client) -> None:
    """When the server no longer holds the conversation, the turn raises SequenceLost and the chat is lost;
    its messages replay into a new chat that goes on."""
    async with client.chat(MODEL, system=SYSTEM, max_tokens=6) as chat:
        await chat.ask("Hello.")
        model = await client.model(MODEL)
        # Another session with the same id ends the conversation behind the chat's back (START+END, no inputs).
        async with model.sequence(sequence_id=chat.sequence_id) as intruder:
            await intruder.end()
        with pytest.raises(SequenceLost):
            await chat.ask("Are you there?")
        assert chat.is_lost
        assert not chat.is_open
        assert chat.turns == 1
        assert len(chat.messages) == 3
        with pytest.raises(SequenceLost):
            await chat.ask("Still there?")
        history = chat.messages
    async with client.chat(MODEL, history=history, max_tokens=6) as again:
        assert (await again.ask("Are you there?")).tokens > 0
        assert again.turns == 1


# --- timeouts, closing mid-turn, the history digest, replay on loss ---------------------------------


def conflicts(server: LocalTriton) -> int:
    """How many times the server's log says a START met a sequence still in progress ("has a conflict"): Triton
    then ends the old one early, the path under which 2.51 has lost requests and crashed. A client never goes there."""
    assert server.log_path is not None
    return server.log_path.read_text(errors="replace").count("has a conflict")


async def live(client: Client) -> int:
    """Conversations the chat model holds, counting the probe that asks (a one-token turn of its own)."""
    model = await client.model(MODEL)
    async with model.sequence() as probe:
        inputs = {"ROLE": np.array(["user"], object), "TEXT": np.array([b"hi"], object), "MAX_TOKENS": [1]}
        results = [r async for r in probe.stream(inputs)]
    return int(results[-1]["LIVE"].reshape(-1)[0])


async def test_client_chat_and_model_chat_are_one_shape(client: Client) -> None:
    """client.chat(name) is the ChatSession model.chat() gives, made without I/O (the model is reached when the
    chat is entered or sends its first turn), and both are used the same ways: entered, or used and then closed."""
    unknown = client.chat("no_such_model", max_tokens=2)  # nothing sent yet: no error here
    assert isinstance(unknown, ChatSession)
    assert unknown.model == "no_such_model"
    with pytest.raises(SequenceUsageError, match="enter it"):
        unknown.sequence_id  # noqa: B018
    with pytest.raises(ModelNotFoundError):
        await unknown.ask("hello")
    with pytest.raises(ChatOptionError, match="'max_tokens'"):
        client.chat(MODEL, max_tokens=-1)  # options are checked at the call, as model.chat() checks them

    model = await client.model(MODEL)
    baseline = await live(client)
    for chat in (client.chat(MODEL, system=SYSTEM, max_tokens=2), model.chat(system=SYSTEM, max_tokens=2)):
        assert isinstance(chat, ChatSession)
        assert (await chat.ask("hello")).tokens > 0  # used without entering it
        assert isinstance(chat.sequence_id, int)
        assert await live(client) == baseline + 1
        await chat.aclose()  # END: the server frees the conversation
        assert await live(client) == baseline
        with pytest.raises(SequenceClosedError):
            await chat.ask("again")
    for chat in (client.chat(MODEL, max_tokens=2), model.chat(max_tokens=2)):
        async with chat as entered:
            assert entered is chat
            assert isinstance(chat.sequence_id, int)  # known once entered
            assert (await chat.ask("hello")).tokens > 0
        assert not chat.is_open
    assert await live(client) == baseline
    never_used = client.chat(MODEL)
    await never_used.aclose()  # closed before it reached the model: nothing to end, no turn afterwards
    with pytest.raises(SequenceClosedError, match="is closed"):
        await never_used.ask("hello")


async def solo_replay(client: Client, messages: tuple[ChatMessage, ...], **options: int) -> tuple[str, int]:
    """The reply and context size chat_stateless gives to ``messages`` sent at once (greedy)."""
    model = await client.model("chat_stateless")
    inputs: dict[str, Any] = {
        "ROLE": np.array([m.role.encode() for m in messages], dtype=object),
        "TEXT": np.array([m.text.encode() for m in messages], dtype=object),
        **{name.upper(): np.array([value], np.int32) for name, value in options.items()},
    }
    reply = b""
    context = -1
    async for r in model.stream(**inputs):
        reply += bytes(r["PIECE"].reshape(-1)[0])
        if "CONTEXT_TOKENS" in r.outputs:
            context = int(r["CONTEXT_TOKENS"].reshape(-1)[0])
    return reply.decode("utf-8", "replace"), context


# Far more tokens than LONG_TIMEOUT_S allows on any machine this runs on (1200 tokens take seconds; the deadline
# is a fraction of a second), and a short enough prompt that they fit in the context.
LONG: dict[str, Any] = {"max_tokens": 1200, "min_tokens": 1200}
SHORT_TIMEOUT_S = 0.2


async def test_a_turn_that_times_out_is_rolled_back_and_the_chat_goes_on(client: Client) -> None:
    """A turn past its timeout raises RequestTimeout (a TimeoutError); the chat is not lost, the turn is in
    neither side's history, and the next turn's reply is the one a chat that never had it gives."""
    async with client.chat(MODEL, system=SYSTEM, max_tokens=12) as chat:
        await chat.ask("Good morning.")
        before = chat.messages
        with pytest.raises(RequestTimeout) as info:
            async for _ in chat.send("Tell me a very long story.", timeout_s=SHORT_TIMEOUT_S, **LONG):
                pass
        assert isinstance(info.value, TimeoutError)
        assert not chat.is_lost
        assert chat.is_open
        assert not chat.is_streaming
        assert (chat.messages, chat.turns) == (before, 1)
        # A second one, through ask(), then the conversation goes on.
        with pytest.raises(RequestTimeout):
            await chat.ask("Tell me another very long story.", timeout_s=SHORT_TIMEOUT_S, **LONG)
        after = await chat.ask("What is your name?")
        assert chat.messages == (
            *before, ChatMessage("user", "What is your name?"), ChatMessage("assistant", after.text)
        )
    async with client.chat(MODEL, system=SYSTEM, max_tokens=12) as clean:
        await clean.ask("Good morning.")
        expected = await clean.ask("What is your name?")
    assert (after.text, after.context_tokens) == (expected.text, expected.context_tokens)


async def test_a_first_turn_that_times_out_leaves_the_chat_usable(client: Client, triton_server: LocalTriton) -> None:
    """Even the first turn (which carries the system message and START): the next turn sends them again, after an
    END alone that frees the id the timed-out START may still hold on the server (no conflict in its log)."""
    before = conflicts(triton_server)
    async with client.chat(MODEL, system=SYSTEM, max_tokens=12) as chat:
        with pytest.raises(RequestTimeout):
            await chat.ask("Tell me a very long story.", timeout_s=SHORT_TIMEOUT_S, **LONG)
        assert (chat.messages, chat.turns, chat.is_lost) == ((ChatMessage("system", SYSTEM),), 0, False)
        reply = await chat.ask("What is your name?")
    assert conflicts(triton_server) == before
    async with client.chat(MODEL, system=SYSTEM, max_tokens=12) as clean:
        expected = await clean.ask("What is your name?")
    assert (reply.text, reply.context_tokens) == (expected.text, expected.context_tokens)


@pytest.mark.parametrize(
    ("refused", "options"),
    [("x" * 1_000_000, {}), ("Hello.", {"stop": ["y" * 10_000] * 200})],
    ids=["message-over-the-cap", "stop-strings-over-the-cap"],
)
async def test_a_refused_first_turn_leaves_the_chat_usable(
    client: Client, triton_server: LocalTriton, refused: str, options: Any
) -> None:
    """A first turn the server refuses (an input over its caps) left no conversation there: the next turn starts
    it again (START, with the system message), instead of being told the conversation is unknown; Triton's
    sequence batcher held the id all the same, so END alone goes first and its log shows no conflict."""
    before = conflicts(triton_server)
    async with client.chat(MODEL, system=SYSTEM, max_tokens=12) as chat:
        with pytest.raises(InvalidArgumentError):
            await chat.ask(refused, **options)
        assert (chat.messages, chat.turns, chat.is_lost) == ((ChatMessage("system", SYSTEM),), 0, False)
        reply = await chat.ask("What is your name?")
        # A refusal after the first turn leaves the conversation as it was, too.
        with pytest.raises(InvalidArgumentError):
            await chat.ask(refused, **options)
        after = await chat.ask("Where do you live?")
    assert conflicts(triton_server) == before
    async with client.chat(MODEL, system=SYSTEM, max_tokens=12) as clean:
        expected = [await clean.ask("What is your name?"), await clean.ask("Where do you live?")]
    assert [(r.text, r.context_tokens) for r in (reply, after)] == [(r.text, r.context_tokens) for r in expected]


@pytest.mark.parametrize("how", ["break", "cancel", "timeout"])
async def test_a_turn_cut_short_is_stopped_by_the_model_not_by_cancelling_its_call(
    client: Client, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """Leaving a turn's loop, cancelling its reader or its timeout: the chat sends CANCEL, the model ends the turn
    (rolled back) and the turn's gRPC call ends on the server's side with OK. No call is cancelled by the client
    (Triton 2.51 crashes when such a cancellation races the responses it writes), and the chat goes on exactly."""
    calls: list[OwnStreamCall] = []
    model = await client.model(MODEL)
    real = Caller.call

    def spy(caller: Caller, call: Call) -> Any:
        responses = real(caller, call)
        if isinstance(responses, OwnStreamCall):
            calls.append(responses)
        return responses

    monkeypatch.setattr(Caller, "call", spy)
    baseline = await live(client)
    async with model.chat(system=SYSTEM, max_tokens=12) as chat:
        await chat.ask("Good morning.")
        before = chat.messages
        if how == "break":
            async with contextlib.aclosing(chat.send("Tell me a very long story.", **LONG)) as pieces:
                async for _ in pieces:
                    break
        elif how == "cancel":
            streaming = asyncio.Event()

            async def read() -> None:
                async for _ in chat.send("Tell me a very long story.", **LONG):
                    streaming.set()

            task = asyncio.create_task(read())
            await streaming.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        else:
            with pytest.raises(RequestTimeout, match="stopped"):
                await chat.ask("Tell me a very long story.", timeout_s=SHORT_TIMEOUT_S, **LONG)
        assert (chat.messages, chat.turns, chat.is_lost) == (before, 1, False)
        turn_call, stop_call = calls[1], calls[2]  # the turn cut short, then its CANCEL request
        for call in (turn_call, stop_call):
            assert call._call is not None
            assert call._call.done()
            assert not call._call.cancelled()
            assert await call._call.code() == grpc.StatusCode.OK
        after = await chat.ask("What is your name?")
    assert await live(client) == baseline
    assert not any(c._call is not None and c._call.cancelled() for c in calls)
    async with client.chat(MODEL, system=SYSTEM, max_tokens=12) as clean:
        await clean.ask("Good morning.")
        expected = await clean.ask("What is your name?")
    assert (after.text, after.context_tokens) == (expected.text, expected.context_tokens)


async def test_a_plain_sequence_step_that_times_out_still_loses_the_sequence(client: Client) -> None:
    """Only a step sent as rolled back (a chat turn) survives its timeout: on a plain decoupled sequence model,
    whose steps keep what they computed, a timed-out stream step leaves the state unknown, as before."""
    model = await client.model("seq_count_stream")
    async with model.sequence() as seq:
        assert [int(r["VALUE"].reshape(-1)[0]) async for r in seq.stream(N=[1])] == [1]
        with pytest.raises(RequestTimeout):
            async for _ in seq.stream(N=[3], DELAY_MS=[5000], timeout_s=SHORT_TIMEOUT_S):
                pass
        assert seq.is_lost
        with pytest.raises(SequenceLost):
            await seq.infer(N=[1])


async def test_a_turn_left_streaming_is_cancelled_when_the_chat_closes(client: Client) -> None:
    """A turn whose loop was left without closing it (the generator still holds the turn) does not keep the
    conversation: closing the chat cancels the turn and sends END at once, and the server frees the slot."""
    baseline = await live(client)
    async with client.chat(MODEL, system=SYSTEM) as chat:
        pieces = chat.send("Tell me a very long story.", **LONG)
        await anext(pieces)  # streaming; then abandoned
        assert chat.is_streaming
    assert await live(client) == baseline
    with pytest.raises(SequenceClosedError, match="closed while this step streamed"):
        await anext(pieces)  # the turn was cancelled under it
    await pieces.aclose()
    with pytest.raises(SequenceClosedError, match="is closed"):
        chat.send("Are you there?")


async def test_cancelling_a_turn_then_closing_at_once_frees_the_conversation(client: Client) -> None:
    """What ``async with`` does on Ctrl-C: the reading task is cancelled and the chat closes at once. The END goes
    out without waiting, and the server frees the conversation (LIVE is back to what it was)."""
    baseline = await live(client)
    chat = (await client.model(MODEL)).chat(system=SYSTEM)
    streaming = asyncio.Event()

    async def read() -> None:
        async with chat:
            async for _ in chat.send("Tell me a very long story.", **LONG):
                streaming.set()

    task = asyncio.create_task(read())
    await streaming.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not chat.is_open
    assert await live(client) == baseline


async def test_closing_from_another_task_ends_the_turn_being_read(client: Client) -> None:
    """chat.aclose() while another task reads a turn: the reader gets SequenceClosedError, the slot is freed."""
    baseline = await live(client)
    chat = (await client.model(MODEL)).chat(system=SYSTEM)
    streaming = asyncio.Event()

    async def read() -> None:
        async for _ in chat.send("Tell me a very long story.", **LONG):
            streaming.set()

    task = asyncio.create_task(read())
    await streaming.wait()
    await chat.aclose()
    with pytest.raises(SequenceClosedError, match="closed while this step streamed"):
        await task
    assert await live(client) == baseline


async def test_the_reply_digest_is_the_shared_chain(client: Client) -> None:
    """Each final response carries the history digest; the client's own chain, over the messages it sent and the
    text it decoded, equals it turn after turn (else the turn would raise ChatHistoryMismatch)."""
    model = await client.model(MODEL)
    assert model.spec.input("DIGEST") is not None
    assert model.spec.output("DIGEST") is not None
    async with client.chat(MODEL, system=SYSTEM, max_tokens=6) as chat:
        digest = EMPTY
        sent: list[tuple[str, str]] = [("system", SYSTEM)]
        for question in ("Good morning.", "How are you?"):
            reply = await chat.ask(question)
            digest = history_digest(digest, [*sent, ("user", question)], reply.text)
            sent = []
            assert chat._digest == digest  # the value the next turn sends


async def test_a_turn_the_server_finished_but_the_client_cancelled_is_rolled_back_on_both_sides(
    client: Client,
) -> None:
    """The one window where the two sides could disagree: the server finished (and kept) a turn, but the client
    cancelled it before reading its final response. The next turn carries the client's digest, the server rolls
    that turn back, and the reply is what a solo replay of the client's recorded history gives on chat_stateless.

    Deterministic: a two-token turn whose first piece has been read has exactly its final response left, which
    the server sends in the pass after the first piece's; another conversation's one-token turn, sent after that
    piece arrived, is answered in that pass or a later one. So once it is answered, the server has finished
    ours, and we leave without reading the end.
    """
    async with client.chat(MODEL, system=SYSTEM, max_tokens=8) as chat:
        await chat.ask("Good morning.")
        before = chat.messages
        async with contextlib.aclosing(chat.send("Tell me a story.", max_tokens=2, min_tokens=2)) as pieces:
            await anext(pieces)
            assert chat.turns == 1  # the piece was not the last: the final response is still to come
            async with client.chat(MODEL, max_tokens=1) as other:
                await other.ask("Hi.")
        assert (chat.turns, chat.messages) == (1, before)
        after = await chat.ask("What is your name?")
        history = chat.messages
    assert history == (*before, ChatMessage("user", "What is your name?"), ChatMessage("assistant", after.text))
    solo = await solo_replay(client, (*before, ChatMessage("user", "What is your name?")), max_tokens=8)
    assert (after.text, after.context_tokens) == solo


async def test_a_digest_the_server_disagrees_with_raises_and_the_next_turn_repairs(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Should the digests ever differ, the turn raises ChatHistoryMismatch (an InternalServerError) and is not
    kept; the next turn carries the digest the client holds, so the server drops that turn too."""
    async with client.chat(MODEL, system=SYSTEM, max_tokens=8) as chat:
        await chat.ask("Good morning.")
        before = chat.messages
        with monkeypatch.context() as patched:
            patched.setattr(chat_module, "history_digest", lambda *_: "a digest the server never made")
            with pytest.raises(ChatHistoryMismatch, match="disagree") as info:
                await chat.ask("Tell me a story.")
        assert isinstance(info.value, InternalServerError)
        assert info.value.expected == "a digest the server never made"
        assert info.value.given not in ("", info.value.expected)
        assert (chat.turns, chat.messages, chat.is_lost) == (1, before, False)
        after = await chat.ask("What is your name?")
    solo = await solo_replay(client, (*before, ChatMessage("user", "What is your name?")), max_tokens=8)
    assert (after.text, after.context_tokens) == solo


async def test_replay_on_loss_goes_on_with_the_same_tokens(client: Client) -> None:
    """With replay_on_loss, a turn whose conversation the server lost replays the recorded messages into a fresh
    sequence (a new id) as its first turn: the reply is the one the uninterrupted conversation gives."""
    questions = ["Good morning.", "Where do you live?"]
    async with client.chat(MODEL, system=SYSTEM, max_tokens=10) as clean:
        await replies(clean, questions)
        expected = await clean.ask("Are you there?")
        expected_next = await clean.ask("Goodbye.")
    async with client.chat(MODEL, system=SYSTEM, max_tokens=10, replay_on_loss=True) as chat:
        await replies(chat, questions)
        history, old_id = chat.messages, chat.sequence_id
        model = await client.model(MODEL)
        # Another session with the same id ends the conversation behind the chat's back (START+END, no inputs).
        async with model.sequence(sequence_id=old_id) as intruder:
            await intruder.end()
        pieces = [p async for p in chat.send("Are you there?")]
        reply = chat.last_reply
        assert reply is not None
        assert "".join(pieces) == reply.text
        assert (reply.text, reply.context_tokens) == (expected.text, expected.context_tokens)
        assert reply.replayed
        assert reply.time_to_first_token_s is not None
        assert 0 < reply.time_to_first_token_s <= reply.elapsed_s
        assert (chat.replays, chat.turns, chat.is_lost, chat.is_open) == (1, 3, False, True)
        assert chat.sequence_id != old_id
        assert chat.messages == (*history, ChatMessage("user", "Are you there?"), ChatMessage("assistant", reply.text))
        # The fresh conversation goes on as the old one would have.
        after = await chat.ask("Goodbye.")
        assert not after.replayed
        assert (after.text, after.context_tokens) == (expected_next.text, expected_next.context_tokens)
        assert chat.replays == 1


async def test_replay_on_loss_survives_a_reload_of_the_model(client: Client, triton_server: LocalTriton) -> None:
    """The server forgets every conversation when the model is reloaded (as on a restart); with replay_on_loss
    the next turn replays the history, and its reply equals the solo replay on chat_stateless."""
    async with client.chat(MODEL, system=SYSTEM, max_tokens=10, replay_on_loss=True) as chat:
        await chat.ask("Good morning.")
        history = chat.messages
        await client.unload_model(MODEL)
        await client.load_model(MODEL)
        reply = await chat.ask("Where do you live?")
        assert (chat.replays, reply.replayed) == (1, True)
    solo = await solo_replay(client, (*history, ChatMessage("user", "Where do you live?")), max_tokens=10)
    assert (reply.text, reply.context_tokens) == solo


async def test_replay_on_loss_survives_eviction_at_the_slot_cap(client: Client) -> None:
    """On chat_small (two slots, the conversation idle longest evicted at once by a START at the cap): two other
    conversations evict ours; its next turn replays (evicting in turn) and answers as the solo replay does."""
    async with client.chat("chat_small", system=SYSTEM, max_tokens=8, replay_on_loss=True) as chat:
        await chat.ask("Good morning.")
        history = chat.messages
        async with client.chat("chat_small", max_tokens=1) as first, client.chat("chat_small", max_tokens=1) as second:
            await first.ask("Hi.")
            await second.ask("Hi.")  # at the cap: ours, idle longest, is evicted
            reply = await chat.ask("Where do you live?")
        assert (chat.replays, reply.replayed, chat.turns) == (1, True, 2)
    solo = await solo_replay(client, (*history, ChatMessage("user", "Where do you live?")), max_tokens=8)
    assert (reply.text, reply.context_tokens) == solo


async def test_without_replay_on_loss_a_loss_propagates_and_stays(client: Client) -> None:
    """The default: SequenceLost propagates, nothing is replayed, and the chat stays lost."""
    async with client.chat(MODEL, system=SYSTEM, max_tokens=6) as chat:
        await chat.ask("Hello.")
        model = await client.model(MODEL)
        async with model.sequence(sequence_id=chat.sequence_id) as intruder:
            await intruder.end()
        old_id = chat.sequence_id
        with pytest.raises(SequenceLost):
            await chat.ask("Are you there?")
        assert (chat.replays, chat.sequence_id, chat.is_lost, chat.is_open) == (0, old_id, True, False)


async def test_a_closed_chat_does_not_replay(client: Client) -> None:
    """A closed chat refuses a turn at send(), even a lost one with replay_on_loss."""
    async with client.chat(MODEL, system=SYSTEM, max_tokens=6, replay_on_loss=True) as chat:
        await chat.ask("Hello.")
    assert not chat.is_open
    with pytest.raises(SequenceClosedError):
        chat.send("Are you there?")
    assert chat.replays == 0
