"""Chaos over the OpenAI gateway: several users at once, each a seeded random schedule of ordinary and hostile requests
through the real ``openai`` client (raw ``httpx`` where it cannot go), with one gateway restart in the middle.

The gateway keeps its responses in an SQLiteStore (``tmp_path``) with ``detach_on_close``, and has two API keys;
the users take them in turn. Each user's actions (its own schedule, one request at a time):

- ``continue`` / ``stream``: a turn continuing the user's chain with ``previous_response_id`` (a new chain, sometimes
  with instructions, when it has none), not streamed or streamed;
- ``fork``: a turn naming a random older response of its own (a chain or conversation turn): a new branch;
- ``store_false``: a turn with ``store: false`` from its chain's head; then that response is neither fetched nor
  continued (404), and the chain goes on from its head as if it had not happened;
- ``disconnect``: a streamed turn read up to its first text delta, then the connection closed (on Responses; or on
  Chat Completions, stateless); the turn is rolled back, or, when it had already finished, it is the chain's head;
- ``busy``: the same, and while it streams a second turn naming the same response (409); then the first is read to
  its end or left;
- ``bad_input``: a refused parameter, an absurd value, an unknown id, a missing or wrong key, a body that is not JSON;
- ``foreign``: another key's response or conversation fetched, listed, continued or deleted (404, as a missing one);
- ``conversation``: ``POST /v1/conversations`` (sometimes with a system item), then turns with ``conversation=``;
- ``tool``: from the chain's head (or a new chain), a turn with tools and a named ``tool_choice`` (one call, its
  arguments valid for the function's schema), then its result as a ``function_call_output`` continuing that response
  (live: only the result is prefilled), streamed or not.

Between the users' actions (an ``asyncio.Barrier`` parks them all; no request is in flight) the gateway stops and a
new one starts on the same store, with a new ``Client``, as a new process would: every chain goes on across it.

Invariants, checked after the run (every violation collected, then one assert that lists them):

- every response that completed, stored or not, equals its stateless replay: the whole history as its user's own
  bookkeeping has it (calls and results included, with the same tools and tool_choice when the turn had them), sent
  to ``/v1/chat/completions`` (greedy, the same max tokens): the same text (and calls) and the same
  ``input_tokens`` (so the history it was conditioned on is that one: a disconnected turn appears in none; the
  demo model's few tokens hardly depend on the history, so the text alone would miss a wrong one);
- a streamed response's deltas add up to its final text, and its events open and close as the API says;
- every refused request got the status its mistake asks for (400, 401, 404, 409) in OpenAI's error shape
  (``{"error": {"message", "type", "param", "code"}}``, naming the parameter where there is one); a user's own
  request never failed because of another user; no request got a 5xx;
- a stored response reads back as it was returned; a rolled-back turn is never found;
- after every stored response and conversation is deleted and the gateway closed, the chat model's ``LIVE`` and
  ``KV_BYTES`` are back to their baseline; ``/metrics`` shows ``tnc_openai_turns_in_flight`` 0 at the restart and at
  the end.

The seed comes from the ``seed`` fixture (``TNC_SEED=S`` runs seed S) and is printed with the run's counts::

    TNC_SEED=1 .venv/bin/pytest tests/test_openai_chaos.py -q -s -n 0
"""

from __future__ import annotations

import asyncio
import collections
import json
import random
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx2 as httpx
import jsonschema  # type: ignore[import-untyped]
import openai
from _probe import probe
from openai import AsyncOpenAI

from triton_npu_client import Client, LocalTriton
from triton_npu_client._gateway import GatewayOptions, OpenAIGateway, SQLiteStore

SEED = 20261202
USERS = 8
KEYS = ("key-a", "key-b")
LONG = 200  # max_output_tokens of a turn that is left mid-stream: long enough to be running when it is left
MAX_FORKS = 2  # per user: every branch holds a conversation on the server (the chat model's cap is 64)
MAX_CONVERSATIONS = 2
WORDS = ("tea", "garden", "letter", "ball", "rain", "village", "sister", "carriage", "novel", "dinner", "walk")
ACTIONS = (
    "continue", "continue", "stream", "fork", "store_false", "disconnect", "busy", "bad_input", "foreign",
    "conversation", "tool",
)  # fmt: skip
ERROR_FIELDS = {"message", "type", "param", "code"}
ANY = object()  # an error field whose value is not checked

#: A message as the users keep it: (role, text), or (role, text, its tool fields in Chat Completions' shape).
Message = tuple[str, str] | tuple[str, str, dict[str, Any]]
Pairs = tuple[Message, ...]
WEATHER: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"enum": ["Bath", "Leeds", "York"]}, "days": {"type": "integer", "minimum": 1,
                                                                         "maximum": 7}},
    "required": ["city", "days"],
    "additionalProperties": False,
}  # fmt: skip
TOOLS: list[Any] = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
FLAT: list[Any] = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]


# --- what the users know ----------------------------------------------------------------------------------------


@dataclass
class Done:
    """A response that completed: the whole history it answered, as its user's bookkeeping has it, and its reply."""

    id: str
    user: int
    key: str
    action: str
    history: Pairs  # up to and including this turn's user message
    text: str
    tokens: int | None  # its max_output_tokens (None: none given)
    stored: bool
    input_tokens: int
    output_tokens: int
    tools: bool = False  # the turn had TOOLS (its replay sends them too)
    forced: str | None = None  # the function its tool_choice named
    calls: tuple[tuple[str, str, str], ...] = ()  # the reply's calls: (id, name, arguments)

    @property
    def after(self) -> Pairs:
        if not self.calls:
            return (*self.history, ("assistant", self.text))
        calls = [{"id": i, "type": "function", "function": {"name": n, "arguments": a}} for i, n, a in self.calls]
        return (*self.history, ("assistant", self.text, {"tool_calls": calls}))


@dataclass
class Conversation:
    id: str
    history: Pairs  # its items and every turn in it so far


@dataclass
class User:
    index: int
    key: str
    rng: random.Random
    tokens: int
    schedule: list[str]
    tree: list[Done] = field(default_factory=list)  # its stored responses: what it may fork from
    head: Done | None = None  # the response its chain goes on from
    conversations: list[Conversation] = field(default_factory=list)
    forks: int = 0
    rolled_back: list[str] = field(default_factory=list)  # ids of its turns that were left mid-stream and undone
    broken: bool = False
    log: list[str] = field(default_factory=list)  # what it did, to tell in a violation

    def note(self, text: str) -> None:
        self.log.append(text)

    def story(self) -> str:
        return "; ".join(self.log)

    def __str__(self) -> str:
        return f"user {self.index} ({self.key})"


@dataclass
class Tally:
    users: list[User] = field(default_factory=list)
    actions: collections.Counter[str] = field(default_factory=collections.Counter)
    outcomes: collections.Counter[str] = field(default_factory=collections.Counter)
    refused: collections.Counter[int] = field(default_factory=collections.Counter)
    done: list[Done] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    foreign_deletes: list[tuple[str, str]] = field(default_factory=list)  # (who, which id): DELETEs of another's

    def violation(self, text: str, limit: int = 700) -> None:
        self.violations.append(text[:limit])


def sentence(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 7))).capitalize() + "?"


def history(pairs: Pairs) -> list[dict[str, Any]]:
    out = []
    for message in pairs:
        role, text = message[0], message[1]
        fields: dict[str, Any] = message[2] if len(message) > 2 else {}  # type: ignore[misc]
        content = None if fields.get("tool_calls") and not text else text  # a reply that is only calls: null
        out.append({"role": role, "content": content, **fields})
    return out


def auth(key: str | None) -> dict[str, str]:
    return {} if key is None else {"Authorization": f"Bearer {key}"}


def unknown(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(24)}"


# --- the gateway, the server (the helpers of tests/test_openai.py) ----------------------------------------------


class Gate:
    """The gateway now serving (it changes at the restart), an ``openai`` client per key on it, and a raw client."""

    def __init__(self, http: httpx.AsyncClient, path: Path) -> None:
        self.http = http
        self.path = path
        self.options = GatewayOptions(api_keys=KEYS, detach_on_close=True)
        self.gw: OpenAIGateway | None = None
        self.clients: dict[str, AsyncOpenAI] = {}
        self.own_client: Client | None = None  # the restarted gateway's: a new process has a new client

    async def start(self, client: Client) -> None:
        gw = OpenAIGateway(client, port=0, store=await SQLiteStore.open(self.path), options=self.options)
        await gw.__aenter__()
        self.gw = gw
        self.clients = {k: AsyncOpenAI(base_url=gw.base_url, api_key=k, max_retries=0, timeout=60) for k in KEYS}

    async def stop(self) -> None:
        """Close the clients and the gateway (its live chains detached: they stay on the server)."""
        for c in self.clients.values():
            await c.close()
        self.clients = {}
        gw, self.gw = self.gw, None
        if gw is not None:
            await gw.__aexit__(None, None, None)

    async def aclose(self) -> None:
        await self.stop()
        own, self.own_client = self.own_client, None
        if own is not None:
            await own.__aexit__(None, None, None)

    @property
    def served(self) -> OpenAIGateway:
        assert self.gw is not None, "no gateway is serving"
        return self.gw

    @property
    def base(self) -> str:
        return self.served.base_url

    def oa(self, key: str) -> AsyncOpenAI:
        return self.clients[key]

    @property
    def state(self) -> Any:
        return self.served.app.state.gateway


async def _settled(gate: Gate) -> None:
    """Until the gateway has finished cleaning up after requests whose clients left (no event to await)."""
    state = gate.state
    for _ in range(2000):
        if state.chains.claimed == 0 and state._turns == 0 and not state._closing:
            return
        await asyncio.sleep(0.005)
    raise AssertionError("the gateway did not settle")


async def _released(gate: Gate, response_id: str) -> None:
    """Until no turn holds ``response_id`` (a turn whose client left has been rolled back or stored)."""
    chains = gate.state.chains
    for _ in range(2000):
        if response_id not in chains._claimed:
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"{response_id} stayed claimed after its client left")


# --- checking what came back ------------------------------------------------------------------------------------


def check_error(
    tally: Tally, what: str, status: int, body: Any, expected: int, *, param: object = ANY, code: object = ANY
) -> None:
    """A refusal: the expected status, OpenAI's error shape, the parameter and code it names."""
    tally.refused[expected] += 1
    error = body.get("error") if isinstance(body, dict) else None
    if status != expected:
        tally.violation(f"{what}: status {status}, expected {expected}: {body}")
    elif not isinstance(error, dict) or set(error) != ERROR_FIELDS:
        tally.violation(f"{what}: not OpenAI's error shape: {body}")
    elif not isinstance(error["message"], str) or not error["message"] or not isinstance(error["type"], str):
        tally.violation(f"{what}: an error without a message or type: {body}")
    elif param is not ANY and error["param"] != param:
        tally.violation(f"{what}: the error names param {error['param']!r}, expected {param!r}: {body}")
    elif code is not ANY and error["code"] != code:
        tally.violation(f"{what}: the error's code is {error['code']!r}, expected {code!r}: {body}")


def _json(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return response.text


async def expect_refused(
    tally: Tally, what: str, call: Callable[[], Awaitable[Any]], expected: int, *, param: object = ANY,
    code: object = ANY,
) -> None:  # fmt: skip
    """``call`` (through the openai client) must fail with ``expected``."""
    try:
        got = await call()
    except openai.APIStatusError as err:
        check_error(tally, what, err.status_code, _json(err.response), expected, param=param, code=code)
    else:
        tally.refused[expected] += 1
        tally.violation(f"{what}: not refused (expected {expected}), got {str(got)[:200]}")


def _text(body: dict[str, Any]) -> str:
    return "".join(
        part.get("text", "") for item in body.get("output", []) for part in item.get("content", [])
        if part.get("type") == "output_text"
    )  # fmt: skip


def check_events(tally: Tally, what: str, kinds: list[str], deltas: list[str], final: dict[str, Any] | None) -> None:
    """A whole Responses stream: opened and closed as the API says, its deltas adding up to its text."""
    opening = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    closing = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    if final is None:
        tally.violation(f"{what}: the stream ended without response.completed or .incomplete: {kinds}")
        return
    ending = "response.completed" if final["status"] == "completed" else "response.incomplete"
    if kinds[:4] != opening or kinds[-4:] != [*closing, ending]:
        tally.violation(f"{what}: events out of order: {kinds}")
    if "".join(deltas) != _text(final):
        tally.violation(f"{what}: the deltas {''.join(deltas)!r} are not the text {_text(final)!r}")


# --- one turn ---------------------------------------------------------------------------------------------------


async def read_stream(oa: Any, kwargs: dict[str, Any]) -> tuple[list[str], list[str], dict[str, Any] | None]:
    """A streamed Responses turn read whole: its event types, its text deltas and its final response (None: none)."""
    kinds: list[str] = []
    deltas: list[str] = []
    final: dict[str, Any] | None = None
    async with await oa.responses.create(**kwargs, stream=True) as events:
        async for event in events:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
            elif event.type in ("response.completed", "response.incomplete"):
                final = event.response.model_dump()
            elif event.type in ("error", "response.failed"):
                raise AssertionError(f"the stream failed: {event}")
    return kinds, deltas, final


async def respond(
    gate: Gate,
    user: User,
    tally: Tally,
    action: str,
    *,
    before: Pairs,
    previous: Done | None = None,
    conversation: Conversation | None = None,
    instructions: str | None = None,
    store: bool = True,
    stream: bool = False,
) -> Done:
    """A turn through the openai client, checked as it comes back and recorded for the stateless replay."""
    question = sentence(user.rng)
    kwargs: dict[str, Any] = {"model": "chat", "input": question, "max_output_tokens": user.tokens, "temperature": 0}
    if user.rng.random() < 0.2:  # the same message as an input item
        kwargs["input"] = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": question}]}]
    if previous is not None:
        kwargs["previous_response_id"] = previous.id
    if conversation is not None:
        kwargs["conversation"] = conversation.id
    if instructions is not None:
        kwargs["instructions"] = instructions
    if not store:
        kwargs["store"] = False
    oa = gate.oa(user.key)
    what = f"{user}, {action}"
    if stream:
        kinds, deltas, final = await read_stream(oa, kwargs)
        check_events(tally, what, kinds, deltas, final)
        assert final is not None
        body = final
    else:
        body = (await oa.responses.create(**kwargs)).model_dump()
    if body["status"] not in ("completed", "incomplete"):
        tally.violation(f"{what}: status {body['status']!r}")
    if body["previous_response_id"] != (previous.id if previous else None):
        tally.violation(f"{what}: previous_response_id {body['previous_response_id']!r}, expected {previous}")
    if (body.get("conversation") or {}).get("id") != (conversation.id if conversation else None):
        tally.violation(f"{what}: conversation {body.get('conversation')!r}, expected {conversation}")
    if body["store"] is not store:
        tally.violation(f"{what}: store {body['store']!r}, expected {store}")
    done = Done(
        id=body["id"], user=user.index, key=user.key, action=action, history=(*before, ("user", question)),
        text=_text(body), tokens=user.tokens, stored=store, input_tokens=body["usage"]["input_tokens"],
        output_tokens=body["usage"]["output_tokens"],
    )  # fmt: skip
    tally.done.append(done)
    tally.outcomes["completed" if store else "completed, store=false"] += 1
    origin = previous.id if previous else conversation.id if conversation else "nothing"
    user.note(f"{action}{' streamed' if stream else ''}{'' if store else ' store=false'}: {done.id} from {origin}")
    return done


class RawStream:
    """A streamed request through raw httpx, read event by event (so it can be left mid-reply)."""

    def __init__(self, response: httpx.Response) -> None:
        self.response = response
        self._lines = response.aiter_lines()
        self.response_id: str | None = None
        self.kinds: list[str] = []
        self.deltas: list[str] = []
        self.final: dict[str, Any] | None = None
        self.ended = False

    @classmethod
    async def open(cls, gate: Gate, key: str, path: str, body: dict[str, Any]) -> RawStream:
        url = f"{gate.base}{path}"
        request = gate.http.build_request("POST", url, json={**body, "stream": True}, headers=auth(key))
        response = await gate.http.send(request, stream=True)
        if response.status_code != 200:
            text = (await response.aread()).decode(errors="replace")
            await response.aclose()
            raise AssertionError(f"POST {path} answered {response.status_code}: {text[:300]}")
        return cls(response)

    async def next_event(self) -> dict[str, Any] | None:
        """The next event's data (None at the end of the stream)."""
        while not self.ended:
            try:
                line = await self._lines.__anext__()
            except StopAsyncIteration:
                self.ended = True
                break
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                continue
            data: dict[str, Any] = json.loads(line[len("data: ") :])
            kind = data.get("type") or data.get("object", "")
            self.kinds.append(kind)
            if kind == "response.created":
                self.response_id = data["response"]["id"]
            elif kind == "response.output_text.delta":
                self.deltas.append(data["delta"])
            elif kind in ("response.completed", "response.incomplete"):
                self.final = data["response"]
            return data
        return None

    async def until_text(self) -> bool:
        """Read up to the first piece of text; False when the stream ended before any."""
        while (data := await self.next_event()) is not None:
            kind = data.get("type")
            if kind == "response.output_text.delta":
                return True
            if kind is None and any(c.get("delta", {}).get("content") for c in data.get("choices", [])):
                return True
        return False

    async def rest(self) -> None:
        while await self.next_event() is not None:
            pass

    async def aclose(self) -> None:
        await self.response.aclose()


def done_from_body(user: User, action: str, before: Pairs, question: str, tokens: int, body: dict[str, Any]) -> Done:
    return Done(
        id=body["id"], user=user.index, key=user.key, action=action, history=(*before, ("user", question)),
        text=_text(body), tokens=tokens, stored=bool(body["store"]), input_tokens=body["usage"]["input_tokens"],
        output_tokens=body["usage"]["output_tokens"],
    )  # fmt: skip


async def after_leaving(gate: Gate, user: User, tally: Tally, action: str, stream: RawStream, base: Done,
                        question: str) -> None:  # fmt: skip
    """A turn continuing ``base`` was left mid-stream: rolled back (never found), or it finished first (the head)."""
    await _released(gate, base.id)
    if stream.response_id is None:
        tally.violation(f"{user}, {action}: the stream gave no response id before its text")
        return
    got = await gate.http.get(f"{gate.base}/responses/{stream.response_id}", headers=auth(user.key))
    if got.status_code == 404:
        user.rolled_back.append(stream.response_id)
        tally.outcomes["left mid-stream, rolled back"] += 1
        user.note(f"{action}: left {stream.response_id} from {base.id}, rolled back")
    elif got.status_code == 200:
        # It had finished before the gateway saw the client go: it is a response like any other.
        done = done_from_body(user, action, base.after, question, LONG, got.json())
        tally.done.append(done)
        user.tree.append(done)
        user.head = done
        tally.outcomes["left mid-stream, finished first"] += 1
        user.note(f"{action}: left {done.id} from {base.id}, finished first")
    else:
        tally.violation(f"{user}, {action}: GET of the left turn answered {got.status_code}: {got.text[:300]}")


# --- the actions ------------------------------------------------------------------------------------------------


async def do_continue(gate: Gate, user: User, tally: Tally, *, stream: bool = False, action: str = "continue") -> None:
    base = user.head
    if base is None:
        instructions = f"You are guest number {user.index}." if user.rng.random() < 0.5 else None
        before: Pairs = (("system", instructions),) if instructions is not None else ()
        done = await respond(gate, user, tally, action, before=before, instructions=instructions, stream=stream)
    else:
        done = await respond(gate, user, tally, action, before=base.after, previous=base, stream=stream)
    user.tree.append(done)
    user.head = done


async def do_stream(gate: Gate, user: User, tally: Tally) -> None:
    await do_continue(gate, user, tally, stream=True, action="stream")


async def do_fork(gate: Gate, user: User, tally: Tally) -> None:
    older = [d for d in user.tree if d is not user.head]
    if not older or user.forks >= MAX_FORKS:
        await do_continue(gate, user, tally, stream=user.rng.random() < 0.5)
        return
    base = user.rng.choice(older)
    user.forks += 1
    done = await respond(gate, user, tally, "fork", before=base.after, previous=base, stream=user.rng.random() < 0.5)
    user.tree.append(done)
    user.head = done


async def do_store_false(gate: Gate, user: User, tally: Tally) -> None:
    base = user.head
    stream = user.rng.random() < 0.5
    before = base.after if base is not None else ()
    done = await respond(gate, user, tally, "store_false", before=before, previous=base, store=False, stream=stream)
    oa = gate.oa(user.key)
    what = f"{user}, store_false"
    await expect_refused(tally, f"{what}: retrieve", lambda: oa.responses.retrieve(done.id), 404,
                         code="response_not_found")  # fmt: skip
    await expect_refused(
        tally, f"{what}: continue it",
        lambda: oa.responses.create(model="chat", input="More?", previous_response_id=done.id, max_output_tokens=2),
        404, param="previous_response_id", code="previous_response_not_found",
    )  # fmt: skip


async def do_disconnect(gate: Gate, user: User, tally: Tally) -> None:
    base = user.head
    if base is None:
        await do_continue(gate, user, tally)
        return
    question = sentence(user.rng)
    if user.rng.random() < 0.25:
        # Stateless: nothing to roll back in the chain; the server's conversation ends with the request.
        messages = history((*base.after, ("user", question)))
        body = {"model": "chat", "messages": messages, "max_tokens": LONG, "temperature": 0}
        stream = await RawStream.open(gate, user.key, "/chat/completions", body)
        await stream.until_text()
        await stream.aclose()
        tally.outcomes["left mid-stream (chat completions)"] += 1
        user.note("disconnect: left a chat completion")
        return
    body = {"model": "chat", "input": question, "previous_response_id": base.id, "max_output_tokens": LONG,
            "temperature": 0}  # fmt: skip
    stream = await RawStream.open(gate, user.key, "/responses", body)
    await stream.until_text()
    await stream.aclose()  # the client goes away mid-reply
    await after_leaving(gate, user, tally, "disconnect", stream, base, question)


async def do_busy(gate: Gate, user: User, tally: Tally) -> None:
    base = user.head
    if base is None:
        await do_continue(gate, user, tally)
        return
    first_question = sentence(user.rng)
    body = {"model": "chat", "input": first_question, "previous_response_id": base.id, "max_output_tokens": LONG,
            "temperature": 0}  # fmt: skip
    stream = await RawStream.open(gate, user.key, "/responses", body)
    await stream.until_text()
    second_question = sentence(user.rng)
    oa = gate.oa(user.key)
    what = f"{user}, busy"
    second: Done | None = None
    try:
        got = await oa.responses.create(model="chat", input=second_question, previous_response_id=base.id,
                                        max_output_tokens=user.tokens, temperature=0)  # fmt: skip
    except openai.APIStatusError as err:
        check_error(tally, f"{what}: a second turn on a running chain", err.status_code, _json(err.response), 409,
                    param="previous_response_id", code="conversation_busy")  # fmt: skip
    else:
        # Legitimate only if the first turn had already finished (its claim released): then it is a fork.
        second = done_from_body(user, "busy (second)", base.after, second_question, user.tokens, got.model_dump())
    if second is None and user.rng.random() < 0.5:
        await stream.aclose()
        await after_leaving(gate, user, tally, "busy", stream, base, first_question)
        return
    await stream.rest()
    await stream.aclose()
    check_events(tally, f"{what}: the first turn", stream.kinds, stream.deltas, stream.final)
    if stream.final is None:
        return
    first = done_from_body(user, "busy (first)", base.after, first_question, LONG, stream.final)
    tally.done.append(first)
    user.tree.append(first)
    user.head = first
    tally.outcomes["completed"] += 1
    user.note(f"busy: {first.id} from {base.id}, read whole")
    if second is not None:
        tally.done.append(second)
        user.tree.append(second)
        tally.outcomes["the first turn finished before the second came"] += 1
        user.note(f"busy: the second {second.id} from {base.id}")


def _bad_responses(prev: dict[str, Any]) -> list[tuple[str, Any, int, str | None, str | None]]:
    """Bodies for POST /v1/responses that must be refused: (name, body, status, param, code)."""
    base = {"model": "chat", "input": "Hello?", "max_output_tokens": 4, **prev}
    image = [{"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]
    return [
        ("tools", {**base, "tools": [{"type": "web_search"}]}, 400, "tools[0].type", "unsupported_parameter"),
        ("reasoning", {**base, "reasoning": {"effort": "high"}}, 400, "reasoning", "unsupported_parameter"),
        ("background", {**base, "background": True}, 400, "background", "unsupported_parameter"),
        # Log-probabilities and formats are served: what is refused is what the gateway has nothing for.
        ("include", {**base, "include": ["reasoning.encrypted_content"]}, 400, "include", "unsupported_parameter"),
        ("top_logprobs 21", {**base, "top_logprobs": 21}, 400, "top_logprobs", "invalid_value"),
        ("text format xml", {**base, "text": {"format": {"type": "xml"}}}, 400, "text.format", "invalid_value"),
        ("an image", {**base, "input": image}, 400, "input[0].content[0].type", "unsupported_parameter"),
        ("a tool output answering no call", {**base, "input": [{"type": "function_call_output", "call_id": "c",
         "output": "x"}]}, 400, "input[0].call_id", "invalid_value"),
        ("max_output_tokens 0", {**base, "max_output_tokens": 0}, 400, "max_output_tokens", "invalid_value"),
        ("max_output_tokens 1e12", {**base, "max_output_tokens": 10**12}, 400, "max_output_tokens", "invalid_value"),
        ("temperature -1", {**base, "temperature": -1}, 400, "temperature", "invalid_value"),
        ("temperature 1e300", {**base, "temperature": 1e300}, 400, "temperature", "invalid_value"),
        ("temperature hot", {**base, "temperature": "hot"}, 400, "temperature", "invalid_type"),
        ("temperature NaN", json.dumps({**base, "temperature": float("nan")}).encode(), 400, "temperature",
         "invalid_type"),
        ("top_p 0", {**base, "top_p": 0}, 400, "top_p", "invalid_value"),
        ("seed 2**70", {**base, "seed": 2**70}, 400, "seed", "invalid_value"),
        ("an empty stop", {**base, "stop": [""]}, 400, "stop", "invalid_value"),
        ("17 stops", {**base, "stop": ["s"] * 17}, 400, "stop", "invalid_value"),
        ("70 KB of input", {**base, "input": "x" * 70_000}, 400, "input", "string_above_max_length"),
        ("no input", {k: v for k, v in base.items() if k != "input"}, 400, "input", "missing_required_parameter"),
        ("an empty input", {**base, "input": []}, 400, "input", "invalid_value"),
        ("the assistant last", {**base, "input": [{"role": "assistant", "content": "x"}]}, 400, "input",
         "invalid_value"),
        ("a wizard", {**base, "input": [{"role": "wizard", "content": "x"}]}, 400, "input[0].role", "invalid_value"),
        ("truncation sideways", {**base, "truncation": "sideways"}, 400, "truncation", "invalid_value"),
        ("17 metadata pairs", {**base, "metadata": {str(i): "v" for i in range(17)}}, 400, "metadata",
         "invalid_value"),
        ("an unknown parameter", {**base, "not_a_parameter": 1}, 400, "not_a_parameter", "unknown_parameter"),
        ("both a previous and a conversation", {**base, "previous_response_id": unknown("resp"),
         "conversation": unknown("conv")}, 400, "conversation", "invalid_value"),
        ("an unknown previous id", {**base, "previous_response_id": unknown("resp")}, 404, "previous_response_id",
         "previous_response_not_found"),
        ("an unknown conversation", {**{k: v for k, v in base.items() if k != "previous_response_id"},
         "conversation": unknown("conv")}, 404, "conversation", "conversation_not_found"),
        ("an unknown model", {**base, "model": "no_such_model"}, 404, "model", "model_not_found"),
        ("not JSON", b"{not json", 400, None, "invalid_json"),
        ("a JSON array", b"[1, 2]", 400, None, "invalid_json"),
    ]  # fmt: skip


def _bad_chat() -> list[tuple[str, Any, int, str | None, str | None]]:
    """Bodies for POST /v1/chat/completions that must be refused."""
    base = {"model": "chat", "messages": [{"role": "user", "content": "Hello?"}], "max_tokens": 4}
    return [
        ("n 17", {**base, "n": 17}, 400, "n", "invalid_value"),
        ("top_logprobs without logprobs", {**base, "top_logprobs": 2}, 400, "top_logprobs", "invalid_value"),
        ("store", {**base, "store": True}, 400, "store", "unsupported_parameter"),
        ("no messages", {**base, "messages": []}, 400, "messages", "invalid_value"),
        ("the assistant last", {**base, "messages": [{"role": "assistant", "content": "x"}]}, 400, "messages[0].role",
         "invalid_value"),
        ("max_tokens 0", {**base, "max_tokens": 0}, 400, "max_tokens", "invalid_value"),
    ]  # fmt: skip


async def do_bad_input(gate: Gate, user: User, tally: Tally) -> None:
    rng = user.rng
    oa = gate.oa(user.key)
    prev = {"previous_response_id": user.head.id} if user.head is not None and rng.random() < 0.5 else {}
    kind = rng.choice(("responses", "responses", "responses", "chat", "openai", "key", "route"))
    what = f"{user}, bad_input ({kind})"
    if kind in ("responses", "chat"):
        cases = _bad_responses(prev) if kind == "responses" else _bad_chat()
        name, body, status, param, code = rng.choice(cases)
        path = "/responses" if kind == "responses" else "/chat/completions"
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers = {**auth(user.key), "Content-Type": "application/json"}
        got = await gate.http.post(f"{gate.base}{path}", content=content, headers=headers)
        check_error(tally, f"{what}: {name}", got.status_code, _json(got), status, param=param, code=code)
    elif kind == "openai":
        choice = rng.randrange(5)
        if choice == 0:
            await expect_refused(
                tally, f"{what}: an unknown previous id",
                lambda: oa.responses.create(model="chat", input="Hi?", previous_response_id=unknown("resp"),
                                            max_output_tokens=2),
                404, param="previous_response_id", code="previous_response_not_found",
            )  # fmt: skip
        elif choice == 1:
            await expect_refused(
                tally, f"{what}: reasoning",
                lambda: oa.responses.create(model="chat", input="Hi?", reasoning={"effort": "high"},
                                            previous_response_id=prev.get("previous_response_id")),
                400, param="reasoning", code="unsupported_parameter",
            )  # fmt: skip
        elif choice == 2:
            await expect_refused(tally, f"{what}: retrieve an unknown id",
                                 lambda: oa.responses.retrieve(unknown("resp")), 404,
                                 code="response_not_found")  # fmt: skip
        elif choice == 3:
            await expect_refused(tally, f"{what}: an unknown conversation",
                                 lambda: oa.conversations.retrieve(unknown("conv")), 404,
                                 code="conversation_not_found")  # fmt: skip
        else:
            await expect_refused(
                tally, f"{what}: n 17",
                lambda: oa.chat.completions.create(model="chat", messages=[{"role": "user", "content": "Hi?"}], n=17),
                400, param="n", code="invalid_value",
            )  # fmt: skip
    elif kind == "key":
        target = user.head.id if user.head is not None else unknown("resp")
        if rng.random() < 0.5:
            got = await gate.http.get(f"{gate.base}/responses/{target}")
            check_error(tally, f"{what}: no key", got.status_code, _json(got), 401, code="missing_api_key")
        else:
            async with AsyncOpenAI(base_url=gate.base, api_key="key-c", max_retries=0, timeout=60) as wrong:
                try:
                    await wrong.responses.retrieve(target)
                except openai.APIStatusError as err:
                    body = _json(err.response)
                    check_error(tally, f"{what}: a wrong key", err.status_code, body, 401, code="invalid_api_key")
                    if "key-c" in json.dumps(body):
                        tally.violation(f"{what}: the refusal echoes the key: {body}")
                else:
                    tally.refused[401] += 1
                    tally.violation(f"{what}: a wrong key read {target}")
    else:
        got = await gate.http.get(f"{gate.base}/no/such/route", headers=auth(user.key))
        check_error(tally, f"{what}: an unknown route", got.status_code, _json(got), 404, code="not_found")


async def do_foreign(gate: Gate, user: User, tally: Tally) -> None:
    """Another key's response or conversation: a 404 whatever is asked, as for a missing one; it stays intact."""
    rng = user.rng
    others = [u for u in tally.users if u.key != user.key and u.tree]
    if not others:
        await do_bad_input(gate, user, tally)
        return
    victim = rng.choice(others)
    oa = gate.oa(user.key)
    headers = auth(user.key)
    http = gate.http
    if victim.conversations and rng.random() < 0.3:
        conv = rng.choice(victim.conversations)
        what = f"{user}, foreign: {victim}'s conversation"
        ask = rng.randrange(3)
        if ask == 0:
            got = await http.get(f"{gate.base}/conversations/{conv.id}", headers=headers)
            check_error(tally, f"{what}: GET", got.status_code, _json(got), 404, code="conversation_not_found")
        elif ask == 1:
            got = await http.delete(f"{gate.base}/conversations/{conv.id}", headers=headers)
            check_error(tally, f"{what}: DELETE", got.status_code, _json(got), 404, code="conversation_not_found")
        else:
            await expect_refused(
                tally, f"{what}: a turn in it",
                lambda: oa.responses.create(model="chat", input="Hi?", conversation=conv.id, max_output_tokens=2),
                404, param="conversation", code="conversation_not_found",
            )  # fmt: skip
        tally.outcomes["foreign conversation probes"] += 1
        return
    # The victim's head when it has one: the response most likely to be in use right now.
    target = victim.head if victim.head is not None and rng.random() < 0.7 else rng.choice(victim.tree)
    what = f"{user}, foreign: {victim}'s {target.id}"
    ask = rng.randrange(4)
    if ask == 0:
        got = await http.get(f"{gate.base}/responses/{target.id}", headers=headers)
        check_error(tally, f"{what}: GET", got.status_code, _json(got), 404, code="response_not_found")
    elif ask == 1:
        got = await http.get(f"{gate.base}/responses/{target.id}/input_items", headers=headers)
        check_error(tally, f"{what}: input_items", got.status_code, _json(got), 404, code="response_not_found")
    elif ask == 2:
        tally.foreign_deletes.append((str(user), target.id))
        got = await http.delete(f"{gate.base}/responses/{target.id}", headers=headers)
        check_error(tally, f"{what}: DELETE", got.status_code, _json(got), 404, code="response_not_found")
    else:
        await expect_refused(
            tally, f"{what}: continue it",
            lambda: oa.responses.create(model="chat", input="Hi?", previous_response_id=target.id, max_output_tokens=2),
            404, param="previous_response_id", code="previous_response_not_found",
        )  # fmt: skip
    tally.outcomes["foreign response probes"] += 1


async def do_conversation(gate: Gate, user: User, tally: Tally) -> None:
    rng = user.rng
    oa = gate.oa(user.key)
    if not user.conversations or (len(user.conversations) < MAX_CONVERSATIONS and rng.random() < 0.3):
        if rng.random() < 0.5:
            system = f"Be brief, guest {user.index}."
            made = await oa.conversations.create(items=[{"type": "message", "role": "system", "content": system}],
                                                 metadata={"user": str(user.index)})  # fmt: skip
            conv = Conversation(made.id, (("system", system),))
        else:
            made = await oa.conversations.create()
            conv = Conversation(made.id, ())
        user.conversations.append(conv)
        tally.outcomes["conversations made"] += 1
    else:
        conv = rng.choice(user.conversations)
    done = await respond(gate, user, tally, "conversation", before=conv.history, conversation=conv,
                         stream=rng.random() < 0.5)  # fmt: skip
    conv.history = done.after
    user.tree.append(done)  # a conversation's response may be forked from, like any other


async def do_tool(gate: Gate, user: User, tally: Tally) -> None:
    """A forced call (named), then its result continuing that response: the tool loop of an agent."""
    base = user.head
    oa = gate.oa(user.key)
    what = f"{user}, tool"
    question = sentence(user.rng)
    before = base.after if base is not None else ()
    previous = {"previous_response_id": base.id} if base is not None else {}
    body = (await oa.responses.create(
        model="chat", input=question, tools=FLAT, tool_choice={"type": "function", "name": "get_weather"},
        temperature=0, **previous,  # type: ignore[arg-type]
    )).model_dump()  # fmt: skip
    items = body["output"]
    if body["status"] != "completed" or [i["type"] for i in items] != ["function_call"]:
        raise AssertionError(f"a forced call gave {body['status']} {[i['type'] for i in items]}")
    call = items[0]
    arguments = json.loads(call["arguments"])
    try:
        jsonschema.validate(arguments, WEATHER)
    except jsonschema.ValidationError as err:
        tally.violation(f"{what}: the call's arguments {call['arguments']!r} are not valid: {err.message}")
    called = Done(
        id=body["id"], user=user.index, key=user.key, action="tool call", history=(*before, ("user", question)),
        text="", tokens=None, stored=True, input_tokens=body["usage"]["input_tokens"],
        output_tokens=body["usage"]["output_tokens"], tools=True, forced="get_weather",
        calls=((call["call_id"], call["name"], call["arguments"]),),
    )  # fmt: skip
    tally.done.append(called)  # not the head, nor a fork's base: a call is answered by its result, not a question
    result = f"{arguments.get('city')}: rain, {arguments.get('days')} days"
    output = [{"type": "function_call_output", "call_id": call["call_id"], "output": result}]
    ask: dict[str, Any] = {"model": "chat", "previous_response_id": called.id, "tools": FLAT, "temperature": 0,
                           "max_output_tokens": user.tokens, "input": output}  # fmt: skip
    if user.rng.random() < 0.5:
        kinds, deltas, final = await read_stream(oa, ask)
        check_events(tally, f"{what} result", kinds, deltas, final)
        assert final is not None
        answered = final
    else:
        answered = (await oa.responses.create(**ask)).model_dump()
    usage = answered["usage"]
    if usage["input_tokens"] - usage["input_tokens_details"]["cached_tokens"] > 40:
        tally.violation(f"{what}: the result turn prefilled {usage['input_tokens']} - "
                        f"{usage['input_tokens_details']['cached_tokens']}: not live on the call's chat")  # fmt: skip
    done = Done(
        id=answered["id"], user=user.index, key=user.key, action="tool result",
        history=(*called.after, ("tool", result, {"tool_call_id": call["call_id"]})), text=_text(answered),
        tokens=user.tokens, stored=True, input_tokens=usage["input_tokens"], output_tokens=usage["output_tokens"],
        tools=True,
    )  # fmt: skip
    tally.done.append(done)
    tally.outcomes["tool loops"] += 1
    user.tree.append(done)
    user.head = done
    user.note(f"tool: {called.id} called, {done.id} answered, from {base.id if base else 'nothing'}")


ACTS: dict[str, Callable[[Gate, User, Tally], Awaitable[None]]] = {
    "continue": do_continue,
    "stream": do_stream,
    "fork": do_fork,
    "store_false": do_store_false,
    "disconnect": do_disconnect,
    "busy": do_busy,
    "bad_input": do_bad_input,
    "foreign": do_foreign,
    "conversation": do_conversation,
    "tool": do_tool,
}


# --- the run ------------------------------------------------------------------------------------------------------


async def act(gate: Gate, user: User, tally: Tally, action: str) -> None:
    """One action; an error it did not ask for is a violation, and the user stops (its bookkeeping may be off)."""
    tally.actions[action] += 1
    try:
        await ACTS[action](gate, user, tally)
    except Exception as err:
        mine = {d.id for d in user.tree}
        deletes = [f"{who} DELETEd {which}" for who, which in tally.foreign_deletes if which in mine]
        tally.violation(f"{user}, action {action}: {type(err).__name__}: {err} (its story: {user.story()}; "
                        f"another key's requests on its responses: {deletes or 'none'})", 2000)  # fmt: skip
        user.broken = True


async def script(gate: Gate, user: User, tally: Tally, barrier: asyncio.Barrier, restart_at: int) -> None:
    for step, action in enumerate(user.schedule):
        if step == restart_at:
            await barrier.wait()  # parked: the gateway restarts
            await barrier.wait()  # a new gateway serves
            user.note("(the gateway restarted)")
        if not user.broken:
            await act(gate, user, tally, action)
    if restart_at >= len(user.schedule):
        await barrier.wait()
        await barrier.wait()


async def metrics(gate: Gate, tally: Tally, when: str) -> None:
    """``/metrics``: no turn in flight, and no request answered with a 5xx."""
    text = (await gate.http.get(f"{gate.served.url}/metrics")).text
    in_flight = [line for line in text.splitlines() if line.startswith("tnc_openai_turns_in_flight ")]
    if in_flight != ["tnc_openai_turns_in_flight 0.0"]:
        tally.violation(f"{when}: /metrics shows {in_flight or 'no tnc_openai_turns_in_flight'}, expected 0")
    counts = [line for line in text.splitlines() if line.startswith("tnc_openai_requests_total")]
    failed = [line for line in counts if 'status="5' in line]
    if failed:
        tally.violation(f"{when}: requests answered with a 5xx: {failed}")


async def restart(gate: Gate, barrier: asyncio.Barrier, tally: Tally, server: LocalTriton) -> None:
    """Once every user is parked: stop the gateway (its chains detached) and start a new one on the same store."""
    try:
        await barrier.wait()
        await _settled(gate)
        await metrics(gate, tally, "before the restart")
        await gate.stop()
        fresh = Client(server.grpc_url, timeout_s=120)
        await fresh.__aenter__()
        gate.own_client = fresh
        await gate.start(fresh)
        tally.outcomes["gateway restarts"] += 1
    except BaseException:
        await barrier.abort()
        raise
    await barrier.wait()


async def twin(gate: Gate, done: Done) -> tuple[str, int, int, tuple[tuple[str, str, str], ...]]:
    """The stateless replay: the whole history through Chat Completions (greedy, the same max tokens, the same tools
    and tool_choice)."""
    extra: dict[str, Any] = {"tools": TOOLS} if done.tools else {}
    if done.forced is not None:
        extra["tool_choice"] = {"type": "function", "function": {"name": done.forced}}
    got = await gate.oa(done.key).chat.completions.create(
        model="chat", messages=history(done.history), max_tokens=done.tokens, temperature=0, **extra  # type: ignore[arg-type]
    )
    assert got.usage is not None
    message = got.choices[0].message
    calls = tuple((c.id, c.function.name, c.function.arguments) for c in message.tool_calls or ())  # type: ignore[union-attr]
    return message.content or "", got.usage.prompt_tokens, got.usage.completion_tokens, calls


async def check_after(gate: Gate, tally: Tally) -> None:
    """The invariants that need the gateway (the second one): replays, stored bodies, deletes, metrics."""
    await _settled(gate)
    http = gate.http
    for user in tally.users:
        for response_id in user.rolled_back:
            got = await http.get(f"{gate.base}/responses/{response_id}", headers=auth(user.key))
            if got.status_code != 404:
                tally.violation(f"{user}: the turn {response_id} left mid-stream and rolled back is now found")
    limit = asyncio.Semaphore(4)

    async def compare(done: Done) -> None:
        async with limit:
            text, prompt, completion, calls = await twin(gate, done)
        story = tally.users[done.user].story()
        if calls != done.calls:
            tally.violation(f"{done.action} {done.id} of user {done.user}: calls {done.calls} but its stateless replay "
                            f"{calls} (history {done.history}; the user's story: {story})", 2500)  # fmt: skip
        elif text != done.text:
            tally.violation(f"{done.action} {done.id} of user {done.user}: {done.text!r} but its stateless replay "
                            f"{text!r} (history {done.history}; the user's story: {story})", 2500)  # fmt: skip
        elif (prompt, completion) != (done.input_tokens, done.output_tokens):
            tally.violation(f"{done.action} {done.id} of user {done.user}: {done.input_tokens} tokens in, "
                            f"{done.output_tokens} out; its stateless replay {prompt} in, {completion} out (history "
                            f"{done.history}; the user's story: {story})", 2500)  # fmt: skip

    await asyncio.gather(*(compare(d) for d in tally.done))
    stored = [d for d in tally.done if d.stored]
    for done in stored:
        got = await http.get(f"{gate.base}/responses/{done.id}", headers=auth(done.key))
        if got.status_code != 200 or _text(got.json()) != done.text:
            tally.violation(f"{done.id} of user {done.user} reads back as {got.status_code} {got.text[:300]}")
    for done in stored:
        got = await http.delete(f"{gate.base}/responses/{done.id}", headers=auth(done.key))
        if got.status_code != 200 or got.json().get("deleted") is not True:
            tally.violation(f"deleting {done.id} of user {done.user}: {got.status_code} {got.text[:300]}")
    for user in tally.users:
        for conv in user.conversations:
            got = await http.delete(f"{gate.base}/conversations/{conv.id}", headers=auth(user.key))
            if got.status_code != 200:
                tally.violation(f"deleting {conv.id} of {user}: {got.status_code} {got.text[:300]}")
    await _settled(gate)
    await metrics(gate, tally, "at the end")


def schedules(rng: random.Random) -> list[list[str]]:
    """Each user's random schedule; every action appears in one at least (a run checks what it claims to)."""
    plans = [[rng.choice(ACTIONS) for _ in range(rng.randint(6, 9))] for _ in range(USERS)]
    for action in sorted(set(ACTIONS) - {a for plan in plans for a in plan}):
        plan = rng.choice(plans)
        plan.insert(rng.randint(1, len(plan)), action)
    return plans


async def run_chaos(client: Client, server: LocalTriton, path: Path, seed: int) -> Tally:
    rng = random.Random(seed)
    tally = Tally()
    plans = schedules(rng)
    tally.users = [
        User(index=i, key=KEYS[i % len(KEYS)], rng=random.Random(rng.random()), tokens=rng.randint(6, 8),
             schedule=plans[i])
        for i in range(USERS)
    ]  # fmt: skip
    restart_at = [rng.randint(2, len(u.schedule) - 2) for u in tally.users]
    baseline = await probe(client)
    barrier = asyncio.Barrier(USERS + 1)
    async with httpx.AsyncClient(timeout=60) as http:
        gate = Gate(http, path)
        try:
            await gate.start(client)
            await asyncio.gather(
                restart(gate, barrier, tally, server),
                *(script(gate, u, tally, barrier, at) for u, at in zip(tally.users, restart_at, strict=True)),
            )
            await check_after(gate, tally)
        finally:
            await gate.aclose()
    # Every conversation of the run was ended: the server holds what it held before (END is processed in turn,
    # so the bound is for a slow machine, not a race made to pass).
    after = await probe(client)
    for _ in range(100):
        if after == baseline:
            break
        await asyncio.sleep(0.05)
        after = await probe(client)
    if after != baseline:
        tally.violation(f"LIVE and KV_BYTES did not return to their baseline: {baseline} before, {after} after")
    return tally


async def test_chaos_over_the_openai_gateway(
    triton_server: LocalTriton, tmp_path: Path, seed: Callable[[int], int]
) -> None:
    """Seeded users at once, a restart between their actions: exact replies, right refusals, state back to baseline."""
    value = seed(SEED)
    async with Client(triton_server.grpc_url, timeout_s=120) as client:
        tally = await asyncio.wait_for(run_chaos(client, triton_server, tmp_path / "responses.sqlite3", value), 300)
    print(
        f"openai chaos seed {value}: actions {dict(tally.actions)}; outcomes {dict(tally.outcomes)}; "
        f"refused {dict(tally.refused)}; {len(tally.done)} responses compared; {len(tally.violations)} violations"
    )
    assert tally.violations == [], f"seed {value}: {len(tally.violations)} violations:\n" + "\n".join(tally.violations)
    assert tally.outcomes["gateway restarts"] == 1
    assert len(tally.done) >= USERS * 2
    assert set(tally.actions) == set(ACTIONS)
