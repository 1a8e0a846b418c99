"""A turn's own stream interval (STREAM_INTERVAL_MS): the engine's pacing of mid-reply pieces, per request.

Engine-level checks ride test_chat_engine's rig (a tiny random GPT-2, a fake clock, no Triton); the client and
server checks use the session's server (the `chat` model with the demo weights).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_chat_engine import Rig, checkpoint  # noqa: F401  (the fixture is used by name)

from triton_npu_client import ChatOptionError, ChatOptions, ChatSession, Client, InvalidArgumentError, LocalTriton
from triton_npu_client._protocol import INVALID_INPUT
from triton_npu_client._protocol.chat import STREAM_INTERVAL_MAX_MS
from triton_npu_client._sessions._chat import _check_options_fit as check_options_fit
from triton_npu_client.server.chat._chat import TurnOptions

PROMPT = ["The cat sat on the mat."]


def test_a_turns_interval_wins_over_the_engines(checkpoint: Path) -> None:  # noqa: F811
    """The clock stands still: an interval sends the first piece, then the rest with the final response."""
    every = Rig(checkpoint).turn(1, ["user"], PROMPT, max_tokens=20, min_tokens=20)
    assert len(every.chat) == 20
    # An engine that streams every pass; the turn asks for one piece a second.
    paced = Rig(checkpoint).turn(1, ["user"], PROMPT, max_tokens=20, min_tokens=20, stream_interval_ms=1000)
    assert paced.reply == every.reply
    assert len(paced.chat) == 2
    # An engine with a 1 s default; the turn asks for every token (0), its next turn leaves it to the engine.
    rig = Rig(checkpoint, stream_interval_s=1.0)
    eager = rig.turn(1, ["user"], PROMPT, max_tokens=20, min_tokens=20, stream_interval_ms=0)
    assert eager.reply == every.reply
    assert len(eager.chat) == 20
    default = rig.turn(2, ["user"], PROMPT, max_tokens=20, min_tokens=20)
    assert len(default.chat) == 2


@pytest.mark.parametrize("value", [-1, STREAM_INTERVAL_MAX_MS + 1])
def test_an_out_of_range_interval_is_refused_naming_the_input(checkpoint: Path, value: int) -> None:  # noqa: F811
    rig = Rig(checkpoint)
    with pytest.raises(ValueError, match=rf"STREAM_INTERVAL_MS must be in 0\.\.60000 milliseconds, got {value}"):
        rig.engine.parse(start=True, end=False, roles=["user"], texts=PROMPT, stream_interval_ms=value)
    with pytest.raises(ValueError, match=r"stream_interval_s must be in 0\.\.60 seconds"):
        TurnOptions(max_tokens=1, stream_interval_s=value / 1000)


# -- the client: ChatOptions, client.chat(..., stream_interval_ms=...) and the model's STREAM_INTERVAL_MS input ----


@pytest.mark.parametrize("value", [-1, STREAM_INTERVAL_MAX_MS + 1, 2.5, True, "10"])
def test_the_client_refuses_a_bad_interval_naming_it(value: object) -> None:
    with pytest.raises(ChatOptionError) as caught:
        ChatOptions(stream_interval_ms=value)  # type: ignore[arg-type]
    assert caught.value.option == "stream_interval_ms"
    assert caught.value.given is value
    with pytest.raises(ChatOptionError):
        ChatOptions().override(stream_interval_ms=value)


def test_the_interval_is_sent_only_when_given() -> None:
    assert "STREAM_INTERVAL_MS" not in ChatOptions(max_tokens=3).inputs()
    sent = ChatOptions(stream_interval_ms=50).inputs()["STREAM_INTERVAL_MS"]
    assert sent.dtype == np.int32
    assert sent.tolist() == [50]
    turn = ChatOptions(stream_interval_ms=50).override(stream_interval_ms=0)
    assert turn.inputs()["STREAM_INTERVAL_MS"].tolist() == [0]


@pytest.fixture
async def client(triton_server: LocalTriton) -> AsyncIterator[Client]:
    async with Client(triton_server.grpc_url, timeout_s=120) as c:
        yield c


async def pieces(chat: ChatSession, text: str, **options: Any) -> list[str]:
    out = []
    async with contextlib.aclosing(chat.send(text, max_tokens=20, min_tokens=20, **options)) as stream:
        async for piece in stream:
            out.append(piece)
    return out


async def test_a_chat_asks_for_fewer_larger_pieces_and_a_turn_may_ask_otherwise(client: Client) -> None:
    """A minute's interval: the first piece, then the rest with the last response; a turn's 0 streams every token.

    Greedy replies to the same question in two fresh chats are the same text however they were cut.
    """
    async with client.chat("chat", stream_interval_ms=STREAM_INTERVAL_MAX_MS) as paced:
        merged = await pieces(paced, "Where are you going?")
        again = await pieces(paced, "And then?")
        assert paced.last_reply is not None
        assert paced.last_reply.tokens == 20
    async with client.chat("chat", stream_interval_ms=STREAM_INTERVAL_MAX_MS) as eager:
        every = await pieces(eager, "Where are you going?", stream_interval_ms=0)
    assert "".join(merged) == "".join(every)
    assert len(merged) == 2
    assert len(again) == 2
    assert len(every) > 10  # about one piece per token (a token ending inside a character yields with the next)


async def test_the_server_refuses_an_interval_out_of_range_naming_the_input(client: Client) -> None:
    chat = await client.model("chat")
    async with chat.sequence() as seq:
        request = {
            "ROLE": np.array([b"user"], dtype=np.object_),
            "TEXT": np.array([b"hi"], dtype=np.object_),
            "STREAM_INTERVAL_MS": np.array([STREAM_INTERVAL_MAX_MS + 1], np.int32),
        }
        with pytest.raises(InvalidArgumentError) as caught:
            async for _ in seq.stream(request):
                pass
    assert INVALID_INPUT in str(caught.value)
    assert f"STREAM_INTERVAL_MS must be in 0..60000 milliseconds, got {STREAM_INTERVAL_MAX_MS + 1}" in str(caught.value)


def test_a_model_without_the_input_is_refused_before_anything_is_sent() -> None:
    class Spec:
        name = "old_chat"

        def input(self, name: str) -> object:
            return None

    check_options_fit(Spec(), ChatOptions())  # type: ignore[arg-type]  # nothing asked: nothing needed
    with pytest.raises(ChatOptionError, match=r"takes no STREAM_INTERVAL_MS input") as caught:
        check_options_fit(Spec(), ChatOptions(stream_interval_ms=20))  # type: ignore[arg-type]
    assert caught.value.option == "stream_interval_ms"
