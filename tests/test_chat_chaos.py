"""Chaos on the real `chat` model: many conversations, each driven by a seeded random script of ordinary and hostile
actions at once; afterwards nobody was harmed by anybody else.

Actions: send a turn; read k pieces then cancel; time out mid-turn; close mid-turn (cancel, then close at once, what
``async with`` does on Ctrl-C); hostile values (a temperature of 1e-39, a 10 MB message, 200 stop strings of 10 KB);
constrained turns (a JSON schema or a regex: the reply must be valid; some cancelled mid-reply, which must leave no
trace, and constraints that do not compile, refused), sampled turns with penalties; tool turns (a forced call, which
must be valid for its schema; its result sent back as a tool message; a forced call cancelled at any moment; tools
whose schema does not compile, refused);
open a chat and never send; and, on ``chat_small`` (two slots, the longest-idle conversation evicted at once),
conversations that lose their slot to each other and replay their history.

Invariants, checked after every run:
- every turn that finished got exactly the reply a solo replay of its own recorded history gives on
  ``chat_stateless`` (greedy, or sampled with its seed: the same model and weights, keeping nothing; a constrained turn
  with its constraint, a tool turn with its tools and the tool fields of its history, its calls too);
- no conversation failed because of another: every error is the one its own action asked for;
- the server's ``LIVE`` and ``KV_BYTES`` (read with a one-request probe) return to their baseline.

The seed is printed. ``TNC_CHAOS_SEED=S`` runs seed S; ``TNC_CHAOS_RUNS=N`` runs N seeds from it (S, S+1, ...)::

    TNC_CHAOS_SEED=1 TNC_CHAOS_RUNS=20 .venv/bin/pytest -q -s -n 0 tests/test_chat_chaos.py
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import random
import re
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import attrs
import jsonschema  # type: ignore[import-untyped]
import numpy as np
import pytest

from triton_npu_client import (
    ChatMessage,
    ChatOptions,
    ChatSession,
    Client,
    InvalidArgumentError,
    LocalTriton,
    Model,
    RequestTimeout,
    ResponseFormat,
    SequenceCapacityError,
    Tool,
)

SEED = int(os.environ.get("TNC_CHAOS_SEED", "20261201"))
RUNS = int(os.environ.get("TNC_CHAOS_RUNS", "1"))
CONVERSATIONS = int(os.environ.get("TNC_CHAOS_CONVERSATIONS", "24"))
SMALL_CONVERSATIONS = 4  # on chat_small's two slots: every turn may evict another conversation
WORDS = ("tea", "garden", "letter", "ball", "rain", "village", "sister", "carriage", "novel", "dinner", "walk")
ACTIONS = (
    "send", "cancel", "timeout", "close_mid_turn", "temperature_tiny", "huge_message", "many_stops", "idle",
    "constrained", "constrained_cancel", "bad_constraint", "penalized", "tool_call", "tool_result", "tool_cancel",
    "bad_tools",
)  # fmt: skip
PERSON: dict[str, Any] = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer", "minimum": 0,
                                                                        "maximum": 99}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
FORMATS = (ResponseFormat.json_schema(PERSON), ResponseFormat.regex(r"(yes|no), [a-z]{2,6}\."))
WEATHER = Tool(
    "get_weather",
    description="The weather in a city",
    parameters={
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8},
                       "days": {"type": "integer", "minimum": 1, "maximum": 5}},
        "required": ["city", "days"],
        "additionalProperties": False,
    },
)
ROLL = Tool("roll", parameters={
    "type": "object", "properties": {"sides": {"type": "integer", "minimum": 2, "maximum": 20}}, "required": ["sides"],
    "additionalProperties": False,
})  # fmt: skip
TOOLS = (WEATHER, ROLL)
SCHEMAS: dict[str, Any] = {t.name: t.parameters for t in TOOLS}


@dataclass
class Finished:
    """A turn that finished: the history the client held before it, its message, its options and its reply."""

    history: tuple[ChatMessage, ...]
    text: str | ChatMessage
    options: dict[str, Any]
    reply: str
    calls: tuple[tuple[str, str, str], ...] = ()  # the reply's tool calls: (id, name, arguments)


@dataclass
class Tally:
    actions: collections.Counter[str] = field(default_factory=collections.Counter)
    outcomes: collections.Counter[str] = field(default_factory=collections.Counter)
    finished: list[Finished] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)


def turn_options(chat: ChatSession, given: dict[str, Any]) -> dict[str, Any]:
    """The options a turn ran with: the chat's defaults, then the turn's own."""
    defaults = {k: v for k, v in attrs.asdict(chat.options).items() if v is not None}
    return {**defaults, **given}


def sentence(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 7))).capitalize() + "?"


async def finish_turn(chat: ChatSession, tally: Tally, text: str | ChatMessage, **options: Any) -> None:
    """One whole turn; a finished one is recorded for the solo replay."""
    history = chat.messages
    reply = await chat.ask(text, **options)
    calls = tuple((c.id, c.name, c.arguments) for c in reply.tool_calls)
    tally.finished.append(Finished(history, text, turn_options(chat, options), reply.text, calls))
    tally.outcomes["finished"] += 1


async def read_then_stop(chat: ChatSession, tally: Tally, text: str, pieces: int, **options: Any) -> None:
    """Read ``pieces`` pieces of a turn, then leave it (its generator closed at once: the turn is cancelled)."""
    history = chat.messages
    turns = chat.turns
    got: list[str] = []
    async with contextlib.aclosing(chat.send(text, **options)) as stream:
        async for piece in stream:
            got.append(piece)
            if len(got) >= pieces:
                break
    if chat.turns > turns:  # the turn ended before we left: it is history now
        assert chat.last_reply is not None
        tally.finished.append(Finished(history, text, turn_options(chat, options), chat.last_reply.text))
        tally.outcomes["finished before the cancel"] += 1
    else:
        tally.outcomes["cancelled"] += 1


async def conversation(model: Model, rng: random.Random, tally: Tally, index: int) -> None:
    """One conversation's random script of actions; an error its own action did not ask for is a violation."""
    steps = rng.randint(2, 5)
    chat = model.chat(system=f"You are guest number {index}.", max_tokens=rng.randint(4, 12), timeout_s=120)
    closed = False
    try:
        for _ in range(steps):
            action = rng.choice(ACTIONS)
            tally.actions[action] += 1
            text = sentence(rng)
            try:
                if action == "send":
                    await finish_turn(chat, tally, text)
                elif action == "cancel":
                    await read_then_stop(chat, tally, text, rng.randint(1, 3), min_tokens=8, max_tokens=12)
                elif action == "timeout":
                    # Far more tokens than a short deadline allows; a turn that still finishes in time counts too.
                    history, turns = chat.messages, chat.turns
                    try:
                        reply = await chat.ask(text, min_tokens=600, max_tokens=600, timeout_s=0.2)
                    except RequestTimeout:
                        tally.outcomes["timed out"] += 1
                    else:
                        assert chat.turns == turns + 1
                        options = turn_options(chat, {"min_tokens": 600, "max_tokens": 600})
                        tally.finished.append(Finished(history, text, options, reply.text))
                        tally.outcomes["finished before the deadline"] += 1
                elif action == "close_mid_turn":
                    task = asyncio.create_task(read_then_stop(chat, tally, text, 10**6, min_tokens=40, max_tokens=40))
                    await asyncio.sleep(rng.random() * 0.05)  # any moment: before the request, mid-turn or after
                    task.cancel()
                    await asyncio.wait([task])  # not `await task`: its CancelledError is not ours to swallow
                    if not task.cancelled() and (failure := task.exception()) is not None:
                        raise failure
                    await chat.aclose()
                    closed = True
                    tally.outcomes["closed mid-turn"] += 1
                    return
                elif action == "temperature_tiny":
                    # A legal positive float: below the server's floor it is greedy, never an overflow.
                    await finish_turn(chat, tally, text, temperature=1e-39)
                elif action == "huge_message":
                    try:
                        await chat.ask("x" * 10_000_000)
                    except InvalidArgumentError:
                        tally.outcomes["refused: huge message"] += 1
                    else:
                        tally.violations.append(f"conversation {index}: a 10 MB message was not refused")
                elif action == "many_stops":
                    try:
                        await chat.ask(text, stop=["y" * 10_000] * 200)
                    except InvalidArgumentError:
                        tally.outcomes["refused: stop strings"] += 1
                    else:
                        tally.violations.append(f"conversation {index}: 200 stop strings of 10 KB were not refused")
                elif action == "constrained":
                    fmt = rng.choice(FORMATS)
                    await finish_turn(chat, tally, text, response_format=fmt, max_tokens=60, temperature=0.9,
                                      seed=rng.randrange(1 << 30))
                    reply = tally.finished[-1].reply
                    valid = (set(json.loads(reply)) == {"name", "age"}) if fmt.kind == "json_schema" else (
                        re.fullmatch(str(fmt.pattern), reply) is not None)
                    if not valid:
                        tally.violations.append(f"conversation {index}: {reply!r} is not valid for {fmt.kind}")
                elif action == "constrained_cancel":
                    await read_then_stop(chat, tally, text, rng.randint(1, 3), response_format=FORMATS[0],
                                         max_tokens=60, temperature=1.0, seed=rng.randrange(1 << 30))
                elif action == "bad_constraint":
                    try:
                        await chat.ask(text, response_format=ResponseFormat.regex("(unclosed"))
                    except InvalidArgumentError:
                        tally.outcomes["refused: constraint"] += 1
                    else:
                        tally.violations.append(f"conversation {index}: a regex that does not compile was taken")
                elif action == "penalized":
                    await finish_turn(chat, tally, text, temperature=0.8, seed=rng.randrange(1 << 30),
                                      presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=1.3)
                elif action == "tool_call":
                    forced = rng.choice(["required", {"type": "function", "function": {"name": "roll"}}])
                    await finish_turn(chat, tally, text, tools=TOOLS, tool_choice=forced, max_tokens=0,
                                      temperature=0.9, seed=rng.randrange(1 << 30))
                    done = tally.finished[-1]
                    if done.reply or not done.calls:
                        tally.violations.append(f"conversation {index}: forced, it gave {done.reply!r}, {done.calls}")
                    for _, name, arguments in done.calls:
                        try:
                            jsonschema.validate(json.loads(arguments), SCHEMAS[name])
                        except (KeyError, ValueError, jsonschema.ValidationError) as err:
                            tally.violations.append(f"conversation {index}: call {name}({arguments}) invalid: {err}")
                elif action == "tool_result":
                    last = chat.last_reply
                    if last is None or not last.tool_calls:
                        await finish_turn(chat, tally, text, tools=TOOLS)  # nothing to answer: tools shown, auto
                    else:
                        await finish_turn(chat, tally, ChatMessage.tool_result(last.tool_calls[0], "Rain, 12 C."),
                                          tools=TOOLS, temperature=0.8, seed=rng.randrange(1 << 30))
                        tally.outcomes["tool result sent"] += 1
                elif action == "tool_cancel":
                    # A forced call shows no text while it is written: cancelled at any moment of it (or after).
                    task = asyncio.create_task(finish_turn(chat, tally, text, tools=TOOLS, tool_choice="required",
                                                           max_tokens=0, temperature=1.0,
                                                           seed=rng.randrange(1 << 30)))
                    await asyncio.sleep(rng.random() * 0.5)  # any moment: before the request, mid-call or after
                    task.cancel()
                    await asyncio.wait([task])
                    if not task.cancelled() and (failure := task.exception()) is not None:
                        raise failure
                    if task.cancelled():
                        tally.outcomes["tool turn cancelled"] += 1
                elif action == "bad_tools":
                    broken = Tool("broken", parameters={"type": "wibble"})
                    try:
                        await chat.ask(text, tools=(broken,), tool_choice="required")
                    except InvalidArgumentError:
                        tally.outcomes["refused: tools"] += 1
                    else:
                        tally.violations.append(f"conversation {index}: a tool schema that does not compile was taken")
                elif action == "idle":
                    tally.outcomes["idle"] += 1  # a chat that is open and sends nothing this step
            except Exception as err:
                tally.violations.append(f"conversation {index}, action {action}: {type(err).__name__}: {err}"[:400])
                return
    finally:
        if not closed:
            await chat.aclose()


class Ended:
    """Counts the turns that ended on ``chat_small``: a START refused at the cap waits for a slot to stop generating."""

    def __init__(self) -> None:
        self.count = 0
        self.changed = asyncio.Condition()

    async def bump(self) -> None:
        async with self.changed:
            self.count += 1
            self.changed.notify_all()

    async def after(self, seen: int) -> None:
        async with self.changed:
            await self.changed.wait_for(lambda: self.count > seen)


async def small_conversation(model: Model, rng: random.Random, tally: Tally, ended: Ended, index: int) -> None:
    """On two slots with immediate eviction: conversations take each other's slot; replay keeps them exact.

    A START (or a replay's START) that finds both slots generating is refused with SequenceCapacityError, the
    documented policy (a generating conversation is never evicted): the chat stays usable, and the turn is sent
    again once some turn on the model has ended.
    """
    async with model.chat(system=f"You are the host number {index}.", max_tokens=6, replay_on_loss=True,
                          timeout_s=120) as chat:
        for _ in range(rng.randint(2, 4)):
            tally.actions["send (chat_small)"] += 1
            text = sentence(rng)
            while True:
                seen = ended.count
                try:
                    await finish_turn(chat, tally, text)
                except SequenceCapacityError:
                    # Refused before it took a slot: nothing ended, so wait for a turn that did.
                    tally.outcomes["refused at the cap, sent again"] += 1
                    await ended.after(seen)
                    continue
                except Exception as err:
                    await ended.bump()
                    tally.violations.append(f"small conversation {index}: {type(err).__name__}: {err}"[:400])
                    return
                await ended.bump()
                break
        tally.outcomes["replays"] += chat.replays


async def evicted_and_replayed(model: Model, rng: random.Random, tally: Tally) -> None:
    """Two slots, three conversations in turn: the first loses its slot to the third, and its next turn replays.

    The random scripts may or may not cause an eviction (that depends on how their turns interleave); this one
    always does, so every run checks a replay.
    """
    first = model.chat(system="You keep the inn.", max_tokens=6, replay_on_loss=True, timeout_s=120)
    second, third = (model.chat(max_tokens=4, timeout_s=120) for _ in range(2))
    async with first, second, third:
        await finish_turn(first, tally, sentence(rng))
        await finish_turn(second, tally, sentence(rng))
        await finish_turn(third, tally, sentence(rng))  # both slots held, neither generating: the longest idle goes
        await finish_turn(first, tally, sentence(rng))
        tally.outcomes["replays"] += first.replays
        if first.replays != 1:
            tally.violations.append(f"the evicted conversation replayed {first.replays} times, not once")


async def solo_reply(stateless: Model, done: Finished) -> str:
    """The reply ``chat_stateless`` gives to the whole recorded history sent at once (a conversation of its own)."""
    last = done.text if isinstance(done.text, ChatMessage) else ChatMessage("user", done.text)
    messages = [*done.history, last]
    inputs: dict[str, Any] = {
        "ROLE": np.array([m.role.encode() for m in messages], dtype=np.object_),
        "TEXT": np.array([m.text.encode() for m in messages], dtype=np.object_),
        # The options as the SDK sends them (the protocol's tensors): the replay is raw tensors for the rest.
        **ChatOptions(**done.options).inputs(),
    }
    if any(m.tool_calls or m.tool_call_id is not None for m in messages):
        inputs["TOOL_META"] = np.array([m.tool_meta().encode() for m in messages], dtype=np.object_)
    reply = b""
    calls: tuple[tuple[str, str, str], ...] = ()
    async for r in stateless.stream(**inputs):
        reply += bytes(r["PIECE"][0, 0])
        if "TOOL_CALLS" in r.outputs and (raw := bytes(r["TOOL_CALLS"][0, 0])):
            calls = tuple((c["id"], c["name"], c["arguments"]) for c in json.loads(raw))
    if calls != done.calls:
        return f"{reply.decode('utf-8', 'replace')} with calls {calls}, not {done.calls}"
    return reply.decode("utf-8", "replace")



async def probe(model: Model) -> tuple[int, int]:
    """LIVE and KV_BYTES as the model reports them, read with a one-request conversation (START and END at once)."""
    async with model.sequence() as seq:
        live = kv = -1
        inputs = {
            "ROLE": np.array([b"user"], dtype=np.object_),
            "TEXT": np.array([b"Hi."], dtype=np.object_),
            "MAX_TOKENS": np.array([1], np.int32),
        }
        async for r in seq.stream(inputs, end=True):
            if "LIVE" in r.outputs:
                live, kv = int(r["LIVE"][0, 0]), int(r["KV_BYTES"][0, 0])
        return live, kv


async def run_once(client: Client, seed: int) -> Tally:
    chat, small, stateless = [await client.model(n) for n in ("chat", "chat_small", "chat_stateless")]
    rng = random.Random(seed)
    tally = Tally()
    baseline = {m.name: await probe(m) for m in (chat, small)}
    scripts = [conversation(chat, random.Random(rng.random()), tally, i) for i in range(CONVERSATIONS)]
    ended = Ended()
    scripts += [
        small_conversation(small, random.Random(rng.random()), tally, ended, i) for i in range(SMALL_CONVERSATIONS)
    ]
    await asyncio.gather(*scripts)
    await evicted_and_replayed(small, random.Random(rng.random()), tally)
    after = {m.name: await probe(m) for m in (chat, small)}
    if after != baseline:
        tally.violations.append(f"LIVE and KV_BYTES did not return to their baseline: {baseline} before, {after} after")
    for done in tally.finished:
        solo = await solo_reply(stateless, done)
        if solo != done.reply:
            tally.violations.append(f"a reply differs from its solo replay: {done.reply!r} vs {solo!r} ({done})"[:600])
    return tally


@pytest.fixture(scope="module")
def chat_server() -> Iterator[LocalTriton]:
    """A server of this file's own with the three chat models, which must live through the script.

    Triton 2.51 crashes (SIGSEGV; SIGABRT with ``GRPC_CALL_ERROR_TOO_MANY_OPERATIONS``, "double free") when a
    client's cancellation of a gRPC call races the responses it writes or its own end of the call: before the
    chat client stopped turns with a CANCEL request and let finished or refused calls end on the server's side,
    this script crashed it in about one run of three (one in two with only cancels and 10 MB refusals). A
    crash here fails the test (its turns fail with ServerUnavailable); a server of its own keeps that to this test.
    Nor may the script ever START an id Triton still holds ("has a conflict" in the log: Triton then ends the
    old sequence early, a path under which 2.51 has also lost requests).
    """
    server = LocalTriton(model_control_mode="explicit", load_models=["chat", "chat_small", "chat_stateless"],
                         stop_grace_s=0)  # fmt: skip
    with server:
        yield server
        assert server.log_path is not None
        log = server.log_path.read_text(errors="replace")
        assert "has a conflict" not in log, [line for line in log.splitlines() if "has a conflict" in line][:5]
        assert server.is_running, "tritonserver died under the chaos script:\n" + log[-3000:]
    assert server.processes() == []


@pytest.fixture
async def client(chat_server: LocalTriton) -> AsyncIterator[Client]:
    async with Client(chat_server.grpc_url, timeout_s=120) as c:
        yield c


async def test_chaos_on_the_chat_model(client: Client) -> None:
    """Seeded random scripts of ordinary and hostile actions at once: exact replies, no harm, state back to baseline."""
    totals: collections.Counter[str] = collections.Counter()
    for seed in range(SEED, SEED + RUNS):
        tally = await run_once(client, seed)
        print(f"chat chaos seed {seed}: actions {dict(tally.actions)}; outcomes {dict(tally.outcomes)}; "
              f"{len(tally.finished)} finished turns compared; {len(tally.violations)} violations")
        assert tally.violations == [], f"seed {seed}: " + "\n".join(tally.violations)
        assert len(tally.finished) >= CONVERSATIONS // 2
        totals += tally.outcomes
    # The runs exercised what they claim to (seeds whose scripts missed these would check less than they say).
    exercised = ("cancelled", "timed out", "closed mid-turn", "refused: huge message", "replays", "tool result sent",
                 "tool turn cancelled", "refused: tools")
    for outcome in exercised:
        assert totals[outcome] >= 1, f"no {outcome!r} in seeds {SEED}..{SEED + RUNS - 1}"
