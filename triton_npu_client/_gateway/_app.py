"""The OpenAI HTTP API as an ASGI app (Starlette), on this SDK's :class:`~triton_npu_client.Client`.

Routes: ``GET /v1/models``, ``POST /v1/chat/completions``, ``POST /v1/embeddings``, ``POST /v1/responses``,
``GET|DELETE /v1/responses/{id}``, ``GET /v1/responses/{id}/input_items``, ``POST /v1/conversations``,
``GET|POST|DELETE /v1/conversations/{id}``, ``GET|POST /v1/conversations/{id}/items``,
``GET|DELETE /v1/conversations/{id}/items/{item_id}``; ``GET /metrics`` (Prometheus) and ``GET /health`` without a
key.

How a request is served (docs/openai.md says it for users):

- **Checked first.** The key (constant time), the body's size (413 past the cap), its JSON and every parameter
  (:mod:`._schema`), the model's kind (:mod:`._catalog`) and the gateway's capacity (429 with ``Retry-After``), all
  before anything reaches a replica.
- **Chat Completions** is stateless: a fresh chat whose first turn carries the whole history; its END follows the
  reply. The server's shared prefix blocks spare the prefill of a history it has seen; ``usage`` says how much
  (``prompt_tokens_details.cached_tokens``). One exception: a reply that made tool calls keeps its chat open
  (*parked*, under the key of its whole history, :func:`._tools.history_key`), because the request that brings the
  calls' results sends that history again; a request whose messages up to its last assistant message are exactly a
  parked chat's history (every field: calls, ids, arguments by value, results) continues that chat, sending only its
  new messages, so the results are all the server prefills.
- **Responses** keep the chain's chat open (:mod:`._chains`) under the latest response's id, so a turn that names
  it sends and prefills only its new message. A turn naming an older response, or one whose chat is not open here
  (closed when idle, or a restarted gateway) starts from the stored state: resumed on the server's live sequence
  when it is the chain's head and the server still holds it, else replayed exactly from the stored messages.
- **Disconnects.** A client that goes away (streaming or not) cancels its turn: the SDK cancels it on the server,
  which rolls it back; a Responses chain stays at the response it continued.
- **Conversation items** grow with each turn in the same store write as the head; an edit through the items API
  claims the conversation as a turn does and clears its head, so the next turn replays the items exactly.
- **Token arrays** on ``/v1/embeddings`` go to the encoder step of the ensemble, framed as its tokenizer step frames
  a text (:mod:`._tokens`).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import json
import logging
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, Final, cast

import attrs
import numpy as np
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from .._errors import InvalidArgumentError, SequenceCapacityError, SequenceLost, TritonError
from .._jobs import score_batches
from .._sessions import ChatMessage, ChatReply, ChatSession, ChatState, ToolCall
from .._trace import AVAILABLE as TRACING
from .._trace import Span
from .._trace import start as start_span
from ._catalog import Catalog, ServedModel
from ._chains import Chains
from ._errors import APIError, busy, from_sdk, invalid, refused
from ._metrics import CONTENT_TYPE, Metrics
from ._schema import (
    ChatRequest,
    Limits,
    ResponseRequest,
    chat_request,
    conversation_items_request,
    conversation_request,
    conversation_update_request,
    embedding_request,
    format_echo,
    item_list_query,
    item_query,
    response_request,
)
from ._store import MemoryStore, MessageRecord, ResponseStore, StoredConversation, StoredResponse, message_item
from ._tokens import IDS, MASK, TokenPath, find_token_path
from ._tools import check_tool_results, from_records, history_key, records

if TYPE_CHECKING:
    from .._client import Client

__all__ = ["GatewayOptions", "create_app"]

_log = logging.getLogger("triton_npu_client.openai")

#: How often a conversation turn reads its conversation again when an edit landed between its read and its claim.
_CLAIM_TRIES: Final = 3

_FINISH: Final = {
    "stop": "stop", "stop_string": "stop", "length": "length", "context": "length", "tool_calls": "tool_calls",
}  # fmt: skip
#: Item ids by item type (OpenAI's prefixes).
_ITEM_PREFIX: Final = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}


def _keys_tuple(keys: Sequence[str]) -> tuple[str, ...]:
    return tuple(keys)


@attrs.frozen(kw_only=True)
class GatewayOptions:
    """How the gateway serves. ``api_keys``: the keys a request may carry (``Authorization: Bearer KEY``); none:
    no key is asked. ``max_turns``: generation requests at once (beyond: 429). ``max_live_chains``: Responses
    chains kept open on the server; ``live_idle_s``: an open chain idle this long is closed (its next turn
    replays). ``timeout_s``: one turn's deadline (504 past it). ``detach_on_close``: leave the open chains on
    the server when the gateway stops (a restarted gateway on the same store resumes them); else END them."""

    api_keys: tuple[str, ...] = attrs.field(default=(), converter=_keys_tuple)
    limits: Limits = attrs.field(factory=Limits)
    max_turns: int = 64
    max_live_chains: int = 256
    live_idle_s: float = 300.0
    timeout_s: float = 300.0
    detach_on_close: bool = False


async def _nothing(head: str) -> None:
    """A parked chat was closed: nothing refers to it."""


def _owner(key: str) -> str:
    # Stored instead of the key: a record names whose it is without keeping a secret.
    return hashlib.sha256(b"triton-npu-openai\0" + key.encode()).hexdigest()[:32]


def _new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(24)}"


def _finish_reason(reply: ChatReply) -> str:
    return "tool_calls" if reply.tool_calls else _FINISH.get(reply.finish_reason, "stop")


def _openai_call(call: ToolCall) -> dict[str, Any]:
    """A call as Chat Completions writes it in a message's ``tool_calls``."""
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def _has_message(reply: ChatReply) -> bool:
    """Whether a Responses output shows the reply's message item: it has text, or it made no call."""
    return bool(reply.text) or not reply.tool_calls


def _output_records(reply: ChatReply) -> list[MessageRecord]:
    """The reply as a conversation keeps its output items: its message, then one record per call."""
    out: list[MessageRecord] = [("assistant", reply.text)] if _has_message(reply) else []
    for call in reply.tool_calls:
        out.append(("assistant", "", {"tool_calls": [{"id": call.id, "name": call.name, "arguments": call.arguments}]}))
    return out


@attrs.frozen(kw_only=True)
class _Usage:
    prompt: int  # the whole input the reply was conditioned on
    prefilled: int  # computed for this request (the rest came from the conversation or shared prefix blocks)
    completion: int

    @classmethod
    def of(cls, reply: ChatReply) -> _Usage:
        # The server counts the whole prompt (INPUT_TOKENS) and what it computed of it (PROMPT_TOKENS). A model
        # from before INPUT_TOKENS reports 0: then the cache's length after the turn stands in for it (it holds
        # every reply token but the last, which no pass has read yet).
        prompt = reply.input_tokens or reply.context_tokens - max(reply.tokens - 1, 0)
        prompt = max(prompt, reply.prompt_tokens)
        return cls(prompt=prompt, prefilled=reply.prompt_tokens, completion=reply.tokens)

    @classmethod
    def of_choices(cls, replies: Sequence[ChatReply]) -> _Usage:
        """One request's ``n`` choices: the prompt counted once (as OpenAI bills it), what each computed and wrote
        summed."""
        each = [cls.of(r) for r in replies]
        return cls(prompt=each[0].prompt, prefilled=sum(u.prefilled for u in each),
                   completion=sum(u.completion for u in each))  # fmt: skip

    @property
    def cached(self) -> int:
        return max(self.prompt - self.prefilled, 0)


async def _merged(sources: Sequence[AsyncIterator[Any]]) -> AsyncIterator[tuple[int, Any]]:
    """The items of ``sources``, read at once, as (source index, item) in the order they arrive.

    Each source is read by a task of its own into one queue; the first error ends the whole (the others are
    cancelled), and leaving early cancels them all, each closing its source (so each choice's turn is stopped and
    its conversation closed, as for one choice).
    """
    queue: asyncio.Queue[tuple[int, Any, BaseException | None, bool]] = asyncio.Queue()

    async def pump(index: int, source: AsyncIterator[Any]) -> None:
        try:
            async with contextlib.aclosing(source):  # type: ignore[type-var]
                async for item in source:
                    await queue.put((index, item, None, False))
        except Exception as err:
            await queue.put((index, None, err, True))
            return
        await queue.put((index, None, None, True))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(sources)]
    try:
        left = len(tasks)
        while left:
            index, item, error, ended = await queue.get()
            if error is not None:
                raise error
            if ended:
                left -= 1
                continue
            yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _sse(data: Any, event: str | None = None) -> bytes:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n".encode()


class _Ahead:
    """``source``'s items, the first one asked for at once, in a task of its own.

    A stream's opening events (Responses: created, in_progress, the item, its part; Chat Completions: the role chunk)
    need nothing from the model: asking for the first piece before writing them sends the turn to the server at
    once, so its prefill overlaps the events' writing and the client's reading of them.
    """

    def __init__(self, source: AsyncIterator[Any]) -> None:
        self._source = source

        async def first() -> tuple[bool, Any]:
            try:
                return True, await anext(source)
            except StopAsyncIteration:
                return False, None

        self._first: asyncio.Task[tuple[bool, Any]] | None = asyncio.ensure_future(first())

    def __aiter__(self) -> _Ahead:
        return self

    async def __anext__(self) -> Any:
        if self._first is not None:
            task, self._first = self._first, None
            found, item = await task
            if not found:
                raise StopAsyncIteration
            return item
        return await anext(self._source)

    async def aclose(self) -> None:
        task, self._first = self._first, None
        if task is not None:
            task.cancel()  # the source must not run in that task while it is closed here
            await asyncio.gather(task, return_exceptions=True)
        await self._source.aclose()  # type: ignore[attr-defined]


async def _disconnected(receive: Receive) -> None:
    """Returns when the client has gone (the body is read by then, so nothing else is received)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class _EventStream(Response):
    """A ``text/event-stream`` response whose producer is cancelled the moment the client disconnects.

    Starlette's StreamingResponse notices a disconnect only at its next write (ASGI 2.4) or through the same
    watch; here it is explicit, because cancelling the producer is what rolls the turn back on the server.
    """

    def __init__(self, events: AsyncIterator[bytes], *, on_end: Callable[[], None]) -> None:
        super().__init__(media_type="text/event-stream")
        self._events = events
        self._on_end = on_end

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def pump() -> None:
            async with contextlib.aclosing(self._events) as events:  # type: ignore[type-var]
                async for chunk in events:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        # on_end runs whatever happens from here, the headers' own send included: it gives back the request's
        # slot and, for a turn that never ran, its chain's claims.
        tasks: tuple[asyncio.Future[None], ...] = ()
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [
                        (b"content-type", b"text/event-stream; charset=utf-8"),
                        (b"cache-control", b"no-cache"),
                        (b"x-accel-buffering", b"no"),
                    ],
                }
            )
            tasks = (asyncio.ensure_future(pump()), asyncio.ensure_future(_disconnected(receive)))
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._on_end()


async def _until_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """``work``'s result, unless the client disconnects first: then ``work`` is cancelled (a turn rolls back)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request.receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)
    if task.cancelled():
        raise APIError(499, "the client closed the request", code="client_closed_request")
    return task.result()


@attrs.frozen(kw_only=True)
class _Head:
    """The response a turn continues: from the store, or from the open chat under it (no store read)."""

    id: str
    model: str
    messages: tuple[MessageRecord, ...]
    chat_state: dict[str, Any] | None

    @classmethod
    def of(cls, record: StoredResponse) -> _Head:
        return cls(id=record.id, model=record.model, messages=record.messages, chat_state=record.chat_state)


@attrs.define
class _Turn:
    """A Responses turn made ready: its chat, how the chat was reached, and what it continues."""

    request: ResponseRequest
    owner: str
    chat: ChatSession
    how: str  # "new", "live", "resumed" or "replayed"
    previous: _Head | None
    conversation: StoredConversation | None
    keys: tuple[str | None, ...]
    id: str = attrs.field(factory=lambda: _new_id("resp"))
    message_id: str = attrs.field(factory=lambda: _new_id("msg"))
    created_at: int = attrs.field(factory=lambda: int(time.time()))
    reply: ChatReply | None = None
    ran: bool = False  # run() started: from then on it releases the claims and settles the chat itself
    call_items: list[str] = attrs.field(factory=list)  # the ids of the reply's function_call items, in order

    def call_item(self, index: int) -> str:
        """The item id of the reply's call ``index`` (made once, so the stream's events and the body agree)."""
        while len(self.call_items) <= index:
            self.call_items.append(_new_id("fc"))
        return self.call_items[index]


class Gateway:
    """The app's state and handlers (see the module docstring); :func:`create_app` builds the ASGI app on it."""

    def __init__(self, client: Client, *, store: ResponseStore | None, options: GatewayOptions) -> None:
        self.client = client
        self.store: ResponseStore = store if store is not None else MemoryStore()
        self.options = options
        self.limits = options.limits
        self.catalog = Catalog(client)
        self.metrics = Metrics()
        self.chains = Chains(max_live=options.max_live_chains, idle_s=options.live_idle_s, on_close=self._chain_closed)
        # Chat Completions' chats whose reply made calls, under their history's key (their next request brings the
        # results); nothing is stored about them.
        self.parked = Chains(max_live=options.max_live_chains, idle_s=options.live_idle_s, on_close=_nothing)
        self._keys = tuple((_owner(k), hashlib.sha256(k.encode()).digest()) for k in options.api_keys)
        self._turns = 0
        self._closing: set[asyncio.Task[None]] = set()
        self._token_paths: dict[str, TokenPath] = {}  # model name -> how its encoder takes token arrays

    async def aclose(self) -> None:
        await self.catalog.aclose()
        await self.parked.aclose(detach=False)  # nothing stored names them: a restarted gateway could not find them
        chats = await self.chains.aclose(detach=self.options.detach_on_close)
        if self.options.detach_on_close:
            await asyncio.gather(*(chat.detach() for _, chat in chats), return_exceptions=True)
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)
        await self.store.aclose()

    async def _chain_closed(self, head: str) -> None:
        # Its conversation is gone from the server: a later turn must not try to resume it.
        with contextlib.suppress(Exception):
            await self.store.forget_chat_state(head)

    # -- checks -------------------------------------------------------------------------------------------------

    def authorize(self, request: Request) -> str:
        """The owner of the request's key ("" when the gateway asks none); 401 for a missing or wrong key."""
        if not self._keys:
            return ""
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            raise APIError(
                401,
                "Missing bearer authentication in header: give 'Authorization: Bearer KEY'",
                code="missing_api_key",
            )
        digest = hashlib.sha256(given.strip().encode()).digest()
        found = ""
        for owner, key in self._keys:  # every key compared, in constant time: no early exit that times the match
            if hmac.compare_digest(digest, key):
                found = owner
        if not found:
            raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")
        return found

    async def body(self, request: Request) -> Any:
        cap = self.limits.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > cap:
            raise APIError(413, f"the request body is {declared} bytes; at most {cap}", code="request_too_large")
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > cap:
                raise APIError(413, f"the request body is over {cap} bytes", code="request_too_large")
            chunks.append(chunk)
        try:
            return json.loads(b"".join(chunks))
        except (ValueError, UnicodeDecodeError, RecursionError):  # nested past what the reader goes: not JSON here
            raise APIError(
                400,
                "We could not parse the JSON body of your request: it must be a JSON object "
                "(Content-Type: application/json)",
                code="invalid_json",
            ) from None

    async def served(self, name: str, kind: str) -> ServedModel:
        try:
            model = await self.catalog.find(name)
        except TritonError as err:
            raise from_sdk(err) from None
        if model is None:
            raise APIError(
                404,
                f"The model '{name}' does not exist or you do not have access to it.",
                param="model",
                code="model_not_found",
            )
        if model.kind != kind:
            other = "/v1/embeddings" if model.kind == "embedding" else "/v1/chat/completions or /v1/responses"
            raise invalid("model", f"model '{name}' is a {model.kind} model, not a {kind} model: use {other}")
        return model

    @contextlib.contextmanager
    def turn_slot(self) -> Any:
        if self._turns >= self.options.max_turns:
            raise busy(f"the gateway runs {self._turns} generation requests, its cap; retry shortly")
        self._turns += 1
        self.metrics.in_flight.set(self._turns)
        try:
            yield
        finally:
            self._turns -= 1
            self.metrics.in_flight.set(self._turns)

    def _close_later(self, chat: ChatSession) -> None:
        """END a chat without making the caller wait (or be cancelled while it leaves)."""
        task = asyncio.get_running_loop().create_task(chat.aclose())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def _send(
        self, chat: ChatSession, message: ChatMessage | Sequence[ChatMessage], options: dict[str, Any]
    ) -> AsyncGenerator[str, None]:
        """``chat.send``, making room once when the server is at its conversation cap.

        The chains this gateway keeps open hold conversations on the server; while they are idle (but not yet
        idle long enough for the server to evict them) they could refuse every new conversation. So a turn the
        server refuses for capacity, before any text, closes this gateway's least recently used open chain (its
        next turn replays it) and is sent again, once. A refused START is no acknowledgement: the chat is intact.
        """
        try:
            first = True
            pieces = chat.send(message, **options)
            async with contextlib.aclosing(pieces):
                async for piece in pieces:
                    first = False
                    yield piece
            return
        except SequenceCapacityError:
            # A parked Chat Completions chat first: its next request replays with its prefix blocks shared.
            if not first or not (await self.parked.close_oldest() or await self.chains.close_oldest()):
                raise
        self.metrics.made_room.inc()
        pieces = chat.send(message, **options)
        async with contextlib.aclosing(pieces):
            async for piece in pieces:
                yield piece

    # -- models -------------------------------------------------------------------------------------------------

    async def list_models(self) -> dict[str, Any]:
        try:
            models = await self.catalog.models(refresh=True)
        except TritonError as err:
            raise from_sdk(err) from None
        data = []
        for m in sorted(models.values(), key=lambda m: m.name):
            entry: dict[str, Any] = {"id": m.name, "object": "model", "created": 0, "owned_by": "triton-npu"}
            entry["kind"] = m.kind
            if m.context_length is not None:
                entry["context_length"] = m.context_length
            if m.kind == "embedding":
                entry["dimensions"] = m.dimensions
            data.append(entry)
        return {"object": "list", "data": data}

    # -- embeddings ---------------------------------------------------------------------------------------------

    async def embeddings(self, raw: Any) -> dict[str, Any]:
        req = embedding_request(raw, self.limits)
        served = await self.served(req.model, "embedding")
        tokens = 0
        if req.token_ids is None:
            column = np.array([t.encode() for t in req.texts], dtype=object).reshape(-1, 1)
            vectors = await self._embed(served.name, [{served.text_input: column}], served.vector_output, len(column))
        else:
            path = await self._token_path(served)
            rows = [path.row(ids) for ids in req.token_ids]
            # One batch per request the encoder takes at most, each padded to its own longest row only.
            size = max((await self.client.model(path.encoder)).spec.max_batch_size, 1)
            batches = [path.batch(rows[i : i + size]) for i in range(0, len(rows), size)]
            vectors = await self._embed(path.encoder, batches, path.vector_output, len(rows), token_ids=True)
            tokens = sum(len(r) for r in rows)  # exactly the ids the encoder read
        data = []
        for i, vector in enumerate(vectors):
            values = np.asarray(vector, dtype="<f4")
            embedding: Any = base64.b64encode(values.tobytes()).decode() if req.base64 else values.tolist()
            data.append({"object": "embedding", "index": i, "embedding": embedding})
        # The encoder does not report its token counts (docs/openai.md): none is made up for text. For token arrays
        # the gateway knows them: the ids it sent, the tokenizer's frame included.
        usage = {"prompt_tokens": tokens, "total_tokens": tokens}
        return {"object": "list", "data": data, "model": served.name, "usage": usage}

    async def _embed(
        self, name: str, batches: list[dict[str, Any]], output: str, count: int, *, token_ids: bool = False
    ) -> list[Any]:
        """The vectors of ``count`` rows given as column ``batches`` to model ``name``; a refused row is a 400 naming
        it (``input[i]``)."""
        try:
            model = await self.client.model(name)
            vectors: list[Any] = [None] * count
            failures: list[tuple[int, Exception]] = []
            scored_batches = score_batches(model, batches, outputs=[output])
            async with contextlib.aclosing(scored_batches) as scored:  # type: ignore[type-var]
                async for batch in scored:
                    for start, outputs in batch.runs:
                        block = outputs[output]
                        for i in range(block.shape[0]):
                            vectors[start + i] = block[i]
                    failures.extend((index, error) for index, error, _ in batch.errors)
        except TritonError as err:
            raise from_sdk(err, param="input") from None
        if failures:
            index, error = failures[0]
            where = f"input[{index}]"
            if token_ids and isinstance(error, InvalidArgumentError):
                # The encoder's refusal names its vocabulary's size; say whose ids these must be, and how LangChain's
                # default (tiktoken's ids, of OpenAI's vocabulary) sends the text instead.
                raise invalid(
                    where,
                    f"{where}: token ids must be the encoder's own, from its tokenizer's vocabulary (model "
                    f"'{name}'); another tokenizer's ids mean other tokens here. The encoder refused them: {error}. "
                    "LangChain's OpenAIEmbeddings sends tiktoken's ids by default: give it "
                    "check_embedding_ctx_length=False to send the text",
                    code="invalid_token_ids",
                )
            raise from_sdk(error, param=where) if isinstance(error, TritonError) else invalid(where, str(error))
        return vectors

    async def _token_path(self, served: ServedModel) -> TokenPath:
        """How token arrays reach ``served``'s encoder (read once per model); a 400 when it takes text only."""
        path = self._token_paths.get(served.name)
        if path is None:
            try:
                path = await find_token_path(self.client, served)
            except TritonError as err:
                raise from_sdk(err, param="input") from None
            if path is None:
                raise refused(
                    "input",
                    f"token arrays for model '{served.name}' (its ensemble has no tokenizer step feeding an encoder "
                    f"step {IDS} and {MASK}; give the text)",
                )
            self._token_paths[served.name] = path
        return path

    # -- chat completions ---------------------------------------------------------------------------------------

    async def chat_completion(
        self, req: ChatRequest, owner: str, *, started: float
    ) -> AsyncIterator[tuple[str, int, Any]]:
        """The replies as ("piece", choice, text) events, then ("done", choice, reply) for each choice; errors raise
        APIError. With ``n`` > 1 each choice is a conversation of its own on the same history, sent at once (so the
        server admits them together and a long history's blocks are computed once and shared), its seed the
        request's plus its index when a seed is given; their events interleave as they arrive."""
        await self.served(req.model, "chat")
        if req.n == 1:
            async for kind, value in self._choice(req, req.generation.options(), started, owner):
                yield kind, 0, value
            return
        sources = []
        for i in range(req.n):
            options = req.generation.options()
            if "seed" in options:
                options["seed"] += i
            sources.append(self._choice(req, options, started, None))
        async with contextlib.aclosing(_merged(sources)) as events:  # type: ignore[type-var]
            async for i, (kind, value) in events:
                yield kind, i, value

    def _parked_chat(self, req: ChatRequest, owner: str) -> tuple[ChatSession, int, str] | None:
        """The parked chat this request continues, the index of its first new message and the chat's key: its
        messages up to the last assistant one (which made calls) are the chat's history, and the rest are results
        and user messages."""
        messages = req.messages
        last = next((i for i in range(len(messages) - 1, -1, -1) if messages[i].role == "assistant"), None)
        if last is None or not messages[last].tool_calls:
            return None
        if any(m.role not in ("user", "tool") for m in messages[last + 1 :]):
            return None
        key = history_key(owner, req.model, messages[: last + 1])
        chat = self.parked.take(key)
        return None if chat is None else (chat, last + 1, key)

    async def _choice(
        self, req: ChatRequest, options: dict[str, Any], started: float, owner: str | None
    ) -> AsyncIterator[tuple[str, Any]]:
        """One choice's turn. ``owner`` (one choice only) parks the chat when the reply makes calls, and continues a
        parked one when the request brings its calls' results."""
        found = None if owner is None else self._parked_chat(req, owner)
        if found is not None:
            chat, start, key = found
            outgoing: Sequence[ChatMessage] = req.messages[start:]
        else:
            history = req.messages[:-1]
            chat = self.client.chat(req.model, history=history, replay_on_loss=True, timeout_s=self.options.timeout_s)
            outgoing, key = req.messages[-1:], ""
        turns = chat.turns
        try:
            pieces = self._send(chat, outgoing[0] if len(outgoing) == 1 else outgoing, options)
            first = True
            async with contextlib.aclosing(pieces):
                async for piece in pieces:
                    if first:
                        self.metrics.ttft.labels("/v1/chat/completions").observe(time.perf_counter() - started)
                        first = False
                    yield "piece", piece
            reply = chat.last_reply
            assert reply is not None
            yield "done", reply
        except TritonError as err:
            raise from_sdk(err) from None
        finally:
            usable = chat.is_open and not chat.is_lost
            reply = chat.last_reply
            if owner is not None and usable and chat.turns > turns and reply is not None and reply.tool_calls:
                # The next request brings the calls' results with this very history: it continues here.
                self.parked.adopt(history_key(owner, req.model, chat.messages), chat, owner=owner,
                                  model=req.model)  # fmt: skip
            elif owner is not None and found is not None and usable and chat.turns == turns:
                self.parked.adopt(key, chat, owner=owner, model=req.model)  # the turn never ran: as it was
            else:
                self._close_later(chat)  # stateless: END frees the conversation (its full prefix blocks stay shared)

    # -- responses ----------------------------------------------------------------------------------------------

    async def prepare(self, req: ResponseRequest, owner: str) -> _Turn:
        """Find what the turn continues, claim it and reach its chat; nothing is generated yet."""
        await self.served(req.model, "chat")
        for _ in range(_CLAIM_TRIES):
            previous, conversation = await self._continued(req, owner)
            keys = (previous.id if previous else None, conversation.id if conversation else None)
            if not self.chains.claim(*keys):
                raise APIError(
                    409,
                    "a turn continuing this "
                    + ("conversation" if conversation else "response")
                    + " is still running; wait for it to finish, or name its response to go on from there",
                    param="conversation" if conversation else "previous_response_id",
                    code="conversation_busy",
                )
            if conversation is None:
                break
            # Read again now that it is claimed: an edit of its items (which claims it too) may have landed since
            # the first read, and its head, which that edit cleared, must not be continued.
            try:
                again = await self.store.get_conversation(conversation.id, owner=owner)
            except BaseException:
                self.chains.release(*keys)
                raise
            if again == conversation:
                break
            self.chains.release(*keys)
        else:
            raise APIError(409, "the conversation kept changing while this turn started; send it again",
                           param="conversation", code="conversation_busy")  # fmt: skip
        try:
            chat, how = await self._chat_for(req, previous, conversation)
        except BaseException:
            self.chains.release(*keys)
            raise
        return _Turn(
            request=req, owner=owner, chat=chat, how=how, previous=previous, conversation=conversation, keys=keys
        )

    async def _continued(self, req: ResponseRequest, owner: str) -> tuple[_Head | None, StoredConversation | None]:
        """What the turn continues: the response it names (or its conversation's head) and its conversation."""
        previous: _Head | None = None
        conversation: StoredConversation | None = None
        if req.previous_response_id is not None:
            live = self.chains.peek(req.previous_response_id, owner)
            if live is not None:
                chat, model = live
                previous = _Head(id=req.previous_response_id, model=model, messages=records(chat.messages),
                                 chat_state=None)  # fmt: skip
            else:
                record = await self.store.get_response(req.previous_response_id, owner=owner)
                previous = None if record is None else _Head.of(record)
            if previous is None:
                raise APIError(
                    404,
                    f"Previous response with id '{req.previous_response_id}' not found.",
                    param="previous_response_id",
                    code="previous_response_not_found",
                )
        if req.conversation is not None:
            conversation = await self.store.get_conversation(req.conversation, owner=owner)
            if conversation is None:
                raise APIError(
                    404, f"Conversation with id '{req.conversation}' not found.", param="conversation",
                    code="conversation_not_found",
                )  # fmt: skip
            if conversation.head is not None:
                record = await self.store.get_response(conversation.head, owner=owner)
                previous = None if record is None else _Head.of(record)
                if previous is None:
                    # Deleting a conversation's head clears it here (its items keep the history): this head was
                    # deleted under a schema-1 store, whose conversations kept only their first items, or by another
                    # gateway this very moment.
                    raise APIError(
                        404,
                        f"Conversation '{req.conversation}': its latest response ({conversation.head}) was deleted, "
                        "and its history with it; start a new conversation",
                        param="conversation",
                        code="conversation_not_found",
                    )
        return previous, conversation

    async def _chat_for(
        self, req: ResponseRequest, previous: _Head | None, conversation: StoredConversation | None
    ) -> tuple[ChatSession, str]:
        base: tuple[ChatMessage, ...] = ()
        if previous is not None:
            base = from_records(previous.messages)
        elif conversation is not None:
            base = from_records(conversation.messages)
        found = check_tool_results((*base, *req.messages))
        if found is not None:
            # One of the input's items, or (items added through the items API) one of the conversation's.
            param = f"input[{req.item_of[found[0] - len(base)]}].call_id" if found[0] >= len(base) else "input"
            raise invalid(param, f"{param}: {found[1]}")
        system = ChatMessage("system", req.instructions) if req.instructions is not None else None
        leading = next((i for i, m in enumerate(base) if m.role != "system"), len(base))
        same_system = system is None or (leading == 1 and base[0] == system)
        timeout = self.options.timeout_s
        # New messages only (the user's, tools' results): the chain's chat takes them as they are.
        appended = all(m.role in ("user", "tool") for m in req.messages)
        if previous is not None and previous.model == req.model and same_system and appended:
            chat = self.chains.take(previous.id)
            if chat is not None:
                return chat, "live"
            if previous.chat_state is not None:
                state = ChatState.from_dict(previous.chat_state)
                return (
                    self.client.chat(req.model, resume=state, replay_on_loss=True, timeout_s=timeout),
                    "resumed",
                )
        if system is not None and not same_system:
            # Instructions replace the chain's system message: the history goes again under the new one.
            base = (system, *base[leading:])
        elif system is not None and not base:
            base = (system,)
        history = base + req.messages[:-1]
        chat = self.client.chat(req.model, history=history, replay_on_loss=True, timeout_s=timeout)
        return chat, "replayed" if previous is not None or conversation is not None else "new"

    async def run(self, turn: _Turn, *, started: float) -> AsyncIterator[str]:
        """The turn's text pieces; at the end the turn is stored (or its chat closed) and ``turn.reply`` set."""
        req = turn.request
        chat = turn.chat
        turns_before = chat.turns
        turn.ran = True
        commit: asyncio.Task[None] | None = None
        try:
            # A chain's own chat takes the new messages; a fresh one holds all but the last as its history.
            outgoing = req.messages if turn.how in ("live", "resumed") else req.messages[-1:]
            pieces = self._send(chat, outgoing[0] if len(outgoing) == 1 else outgoing, req.generation.options())
            first = True
            async with contextlib.aclosing(pieces):
                async for piece in pieces:
                    if first:
                        self.metrics.ttft.labels("/v1/responses").observe(time.perf_counter() - started)
                        first = False
                    yield piece
        except TritonError as err:
            raise from_sdk(err) from None
        finally:
            if chat.turns > turns_before:
                # The server holds the turn (the chat commits it at its last response, even when the client leaves
                # at that very piece): it is stored, or its chat closed, whatever happens to this request now. The
                # commit runs as a task of its own, so a cancellation cannot cut it in half, and the chain's claims
                # are released only once it is done.
                turn.reply = chat.last_reply
                if turn.reply is not None and turn.reply.replayed:
                    self.metrics.replays.labels("lost").inc()
                elif turn.how == "replayed":
                    self.metrics.replays.labels("not_live").inc()
                commit = asyncio.get_running_loop().create_task(self._commit(turn))
                self._closing.add(commit)
                commit.add_done_callback(lambda task: self._committed(turn, task))
            else:
                self.chains.release(*turn.keys)
                self._abandon(turn)
                self.metrics.live_chains.set(len(self.chains))
        if commit is None:  # the SDK ends a turn with its reply or an error: never expected
            raise APIError(500, "the turn ended without a reply", type="server_error", code="server_error")
        await asyncio.shield(commit)

    def _committed(self, turn: _Turn, task: asyncio.Task[None]) -> None:
        self._closing.discard(task)
        self.chains.release(*turn.keys)
        self.metrics.live_chains.set(len(self.chains))
        if not task.cancelled() and task.exception() is not None:
            _log.error("storing response %s failed", turn.id, exc_info=task.exception())

    def settle(self, turn: _Turn) -> None:
        """For a turn whose stream ended before it ran (the client left at once): undo what prepare() did."""
        if not turn.ran:
            turn.ran = True
            self.chains.release(*turn.keys)
            self._abandon(turn)

    def _abandon(self, turn: _Turn) -> None:
        """The turn did not complete (rolled back on the server): the chain stays where it was."""
        chat = turn.chat
        if turn.how in ("live", "resumed") and turn.previous is not None and chat.is_open and not chat.is_lost:
            self.chains.adopt(turn.previous.id, chat, owner=turn.owner, model=turn.previous.model)
        else:
            self._close_later(chat)

    async def _commit(self, turn: _Turn) -> None:
        try:
            await self._store_turn(turn)
        except BaseException:
            self._close_later(turn.chat)  # not stored: nothing may continue this chat's history
            raise

    async def _store_turn(self, turn: _Turn) -> None:
        req = turn.request
        chat = turn.chat
        reply = turn.reply
        assert reply is not None
        body = self.response_body(turn)
        if turn.previous is not None and turn.how in ("live", "resumed"):
            # The sequence moved on: the older response is no longer its head, so it must never be resumed.
            await self.store.forget_chat_state(turn.previous.id)
        if not req.store:
            self._close_later(chat)  # store=false keeps nothing after the response
            return
        items = _with_ids(req.items)
        record = StoredResponse(
            id=turn.id,
            owner=turn.owner,
            created_at=turn.created_at,
            model=req.model,
            status=body["status"],
            body=body,
            input_items=items,
            messages=records(chat.messages),
            previous_response_id=turn.previous.id if turn.previous else None,
            conversation_id=turn.conversation.id if turn.conversation else None,
            chat_state=chat.state.to_dict(),
        )
        await self.store.put_response(record)
        if turn.conversation is not None:
            # The conversation's items grow by this turn's input and output in the same write as its head moves, so
            # they always equal the head's history (the instructions aside: OpenAI lists them as no item, and here
            # they stand in for the system message).
            turn_items = [_listed(item, rec) for item, rec in zip(items, req.records, strict=True)]
            turn_items.extend(body["output"])  # the reply's message and calls, as the response shows them
            recs = [*req.records, *_output_records(reply)]  # one per item; joined, they are the chat's messages
            moved = await self.store.advance_conversation(
                turn.conversation.id, owner=turn.owner, expected_head=turn.conversation.head, new_head=turn.id,
                items=turn_items, messages=recs,
            )  # fmt: skip
            if not moved:
                # Another gateway moved the conversation meanwhile: this response stays, outside it.
                _log.warning("conversation %s moved while a turn ran; response %s left out", turn.conversation.id,
                             turn.id)  # fmt: skip
        self.chains.adopt(turn.id, chat, owner=turn.owner, model=req.model)

    def response_body(self, turn: _Turn, *, status: str | None = None) -> dict[str, Any]:
        req = turn.request
        reply = turn.reply
        output: list[dict[str, Any]] = []
        usage: dict[str, Any] | None = None
        incomplete: dict[str, Any] | None = None
        if reply is not None:
            finish = _finish_reason(reply)
            status = status or ("incomplete" if finish == "length" else "completed")
            if finish == "length":
                incomplete = {"reason": "max_output_tokens"}
            if _has_message(reply):
                output.append(self.message_item(
                    turn, reply.text, "completed" if status == "completed" else "incomplete",
                    _openai_logprobs(reply) if req.generation.logprobs is not None else None,
                ))  # fmt: skip
            output.extend(self.call_item(turn, i, call) for i, call in enumerate(reply.tool_calls))
            u = _Usage.of(reply)
            usage = {
                "input_tokens": u.prompt,
                "input_tokens_details": {"cached_tokens": u.cached},
                "output_tokens": u.completion,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": u.prompt + u.completion,
            }
        return {
            "id": turn.id,
            "object": "response",
            "created_at": turn.created_at,
            "status": status or "in_progress",
            "error": None,
            "incomplete_details": incomplete,
            "instructions": req.instructions,
            "max_output_tokens": req.generation.max_tokens,
            "model": req.model,
            "output": output,
            "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": turn.previous.id if turn.previous and req.previous_response_id else None,
            "conversation": {"id": turn.conversation.id} if turn.conversation else None,
            "store": req.store,
            "temperature": req.generation.temperature,
            "top_p": req.generation.top_p,
            "text": {"format": format_echo(req.generation.response_format)},
            "tool_choice": req.tool_choice_echo,
            "tools": list(req.tools_echo),
            "truncation": req.truncation,
            "usage": usage,
            "metadata": req.metadata,
            "user": req.user,
        }

    def message_item(
        self, turn: _Turn, text: str | None, status: str, logprobs: list[dict[str, Any]] | None = None
    ) -> dict[str, Any]:
        content = [] if text is None else [self.text_part(text, logprobs)]
        return {"id": turn.message_id, "type": "message", "status": status, "role": "assistant", "content": content}

    @staticmethod
    def call_item(turn: _Turn, index: int, call: ToolCall, *, status: str = "completed") -> dict[str, Any]:
        """The reply's call ``index`` as a Responses ``function_call`` output item."""
        return {"id": turn.call_item(index), "type": "function_call", "status": status, "call_id": call.id,
                "name": call.name, "arguments": call.arguments}  # fmt: skip

    @staticmethod
    def text_part(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}

    async def delete_response(self, response_id: str, owner: str) -> dict[str, Any]:
        # Found for this owner first: another key's id must read as unknown (404), never as busy (409).
        if await self.store.get_response(response_id, owner=owner) is None:
            raise APIError(404, f"Response with id '{response_id}' not found.", code="response_not_found")
        if not self.chains.claim(response_id):
            raise APIError(409, "a turn continuing this response is still running", code="conversation_busy")
        try:
            record = await self.store.delete_response(response_id, owner=owner)
            if record is None:
                raise APIError(404, f"Response with id '{response_id}' not found.", code="response_not_found")
            if record.conversation_id is not None:
                # Its conversation goes on from its items, replayed: there is no head response left to continue.
                await self.store.advance_conversation(
                    record.conversation_id, owner=owner, expected_head=response_id, new_head=None
                )
            if not await self.chains.forget(response_id) and record.chat_state is not None:
                # Its conversation may still be live on the server (a gateway restarted since): END frees it.
                with contextlib.suppress(TritonError):
                    chat = self.client.chat(record.model, resume=ChatState.from_dict(record.chat_state))
                    await chat.aclose()
            self.metrics.live_chains.set(len(self.chains))
            return {"id": response_id, "object": "response.deleted", "deleted": True}
        finally:
            self.chains.release(response_id)


# --- the ASGI app ------------------------------------------------------------------------------------------------


def create_app(client: Client, *, store: ResponseStore | None = None, options: GatewayOptions | None = None) -> Any:
    """The OpenAI API on ``client`` as an ASGI app (Starlette). ``store``: where responses are kept (default: in
    memory, lost with the process; :class:`SQLiteStore` keeps them across restarts). The app does not own the
    client; its lifespan closes the store and the open chains."""
    gateway = Gateway(client, store=store, options=options or GatewayOptions())

    def endpoint(
        name: str, handler: Callable[[Request, str], Awaitable[Response]], *, auth: bool = True
    ) -> Callable[[Request], Awaitable[Response]]:
        async def serve(request: Request) -> Response:
            started = time.perf_counter()
            try:
                owner = gateway.authorize(request) if auth else ""
                response = await handler(request, owner)
            except APIError as err:
                if err.status >= 500:
                    _log.warning("%s %s: %s", request.method, name, err.message)
                response = JSONResponse(err.body(), status_code=err.status, headers=err.headers)
            except TritonError as err:
                api = from_sdk(err)
                response = JSONResponse(api.body(), status_code=api.status, headers=api.headers)
            gateway.metrics.requests.labels(name, str(response.status_code)).inc()
            if not isinstance(response, _EventStream):
                gateway.metrics.latency.labels(name).observe(time.perf_counter() - started)
            return response

        return serve

    async def models(request: Request, owner: str) -> Response:
        return JSONResponse(await gateway.list_models())

    async def embeddings(request: Request, owner: str) -> Response:
        raw = await gateway.body(request)
        return JSONResponse(await _until_disconnect(request, gateway.embeddings(raw)))

    async def chat_completions(request: Request, owner: str) -> Response:
        started = time.perf_counter()
        req = chat_request(await gateway.body(request), gateway.limits)
        slot = gateway.turn_slot()
        slot.__enter__()
        ident = _new_id("chatcmpl")
        created = int(time.time())
        events = gateway.chat_completion(req, owner, started=started)
        traced = _traced(events, "openai.chat.completions", req.model, request)
        if req.stream:
            return _EventStream(
                _chat_chunks(traced, ident, created, req), on_end=lambda: _finish(slot, gateway, started, "chat")
            )
        try:

            async def whole() -> tuple[list[str], list[ChatReply]]:
                parts: list[list[str]] = [[] for _ in range(req.n)]
                replies: list[ChatReply | None] = [None] * req.n
                async with contextlib.aclosing(traced) as stream:  # type: ignore[type-var]
                    async for kind, i, value in stream:
                        if kind == "piece":
                            parts[i].append(value)
                        else:
                            replies[i] = value
                assert all(r is not None for r in replies)
                return ["".join(p) for p in parts], cast(list[ChatReply], replies)

            texts, replies = await _until_disconnect(request, whole())
        finally:
            slot.__exit__(None, None, None)
        usage = _Usage.of_choices(replies)
        _count(gateway.metrics, "/v1/chat/completions", usage)
        return JSONResponse(
            {
                "id": ident,
                "object": "chat.completion",
                "created": created,
                "model": req.model,
                "choices": [
                    {
                        "index": i,
                        "message": _chat_message(text, reply),
                        "logprobs": _chat_logprobs_body(req, reply),
                        "finish_reason": _finish_reason(reply),
                    }
                    for i, (text, reply) in enumerate(zip(texts, replies, strict=True))
                ],
                "usage": _chat_usage(usage),
                "system_fingerprint": None,
            }
        )

    async def responses(request: Request, owner: str) -> Response:
        started = time.perf_counter()
        req = response_request(await gateway.body(request), gateway.limits)
        slot = gateway.turn_slot()
        slot.__enter__()
        try:
            # Short (a store read at most): a client gone meanwhile is seen by the turn's own watch.
            turn = await gateway.prepare(req, owner)
        except BaseException:
            slot.__exit__(None, None, None)
            raise
        pieces = _traced(gateway.run(turn, started=started), "openai.responses", req.model, request)
        if req.stream:

            def ended() -> None:
                gateway.settle(turn)
                _finish(slot, gateway, started, "responses")

            return _EventStream(_response_events(gateway, turn, pieces), on_end=ended)
        try:

            async def whole() -> None:
                async with contextlib.aclosing(pieces) as stream:  # type: ignore[type-var]
                    async for _ in stream:
                        pass

            await _until_disconnect(request, whole())
        finally:
            gateway.settle(turn)
            slot.__exit__(None, None, None)
        assert turn.reply is not None
        _count(gateway.metrics, "/v1/responses", _Usage.of(turn.reply))
        return JSONResponse(gateway.response_body(turn))

    async def get_response(request: Request, owner: str) -> Response:
        record = await gateway.store.get_response(request.path_params["id"], owner=owner)
        if record is None:
            raise APIError(404, f"Response with id '{request.path_params['id']}' not found.", code="response_not_found")
        return JSONResponse(record.body)

    async def delete_response(request: Request, owner: str) -> Response:
        return JSONResponse(await gateway.delete_response(request.path_params["id"], owner))

    async def input_items(request: Request, owner: str) -> Response:
        record = await gateway.store.get_response(request.path_params["id"], owner=owner)
        if record is None:
            raise APIError(404, f"Response with id '{request.path_params['id']}' not found.", code="response_not_found")
        # Newest first, as OpenAI lists them by default; ``order=asc`` for oldest first.
        items = list(record.input_items)
        if request.query_params.get("order", "desc") != "asc":
            items.reverse()
        return JSONResponse(
            {
                "object": "list",
                "data": items,
                "first_id": items[0]["id"] if items else None,
                "last_id": items[-1]["id"] if items else None,
                "has_more": False,
            }
        )

    async def create_conversation(request: Request, owner: str) -> Response:
        raw = await gateway.body(request) if request.headers.get("content-length") not in (None, "0") else {}
        req = conversation_request(raw, gateway.limits)
        record = StoredConversation(
            id=_new_id("conv"),
            owner=owner,
            created_at=int(time.time()),
            metadata=req.metadata,
            items=_conversation_items(req.items, req.records),
            messages=req.records,
            head=None,
        )
        await gateway.store.put_conversation(record)
        return JSONResponse(_conversation_body(record))

    async def owned_conversation(request: Request, owner: str) -> StoredConversation:
        """The conversation the path names, when it is ``owner``'s; another key's is unknown (404), never busy."""
        record = await gateway.store.get_conversation(request.path_params["id"], owner=owner)
        if record is None:
            raise _no_conversation(request.path_params["id"])
        return record

    @contextlib.asynccontextmanager
    async def editing(conv_id: str) -> AsyncIterator[None]:
        # An edit claims the conversation as a turn does: never while a turn in it runs (its head would move under
        # the edit), and a turn starting meanwhile reads it again once the edit is done.
        if not gateway.chains.claim(conv_id):
            raise APIError(409, "a turn in this conversation is still running; edit it once the turn is done",
                           code="conversation_busy")  # fmt: skip
        try:
            yield
        finally:
            gateway.chains.release(conv_id)

    async def update_conversation(request: Request, owner: str) -> Response:
        metadata = conversation_update_request(await gateway.body(request), gateway.limits)
        await owned_conversation(request, owner)
        record = await gateway.store.update_conversation(request.path_params["id"], owner=owner, metadata=metadata)
        if record is None:
            raise _no_conversation(request.path_params["id"])
        return JSONResponse(_conversation_body(record))

    async def list_items(request: Request, owner: str) -> Response:
        query = item_list_query(request.query_params)
        record = await owned_conversation(request, owner)
        items = list(record.items)
        if query.order == "desc":
            items.reverse()
        start = 0
        if query.after is not None:
            index = next((i for i, item in enumerate(items) if item.get("id") == query.after), None)
            if index is None:
                raise invalid("after", f"after: no item '{query.after}' in conversation '{record.id}'")
            start = index + 1
        page = items[start : start + query.limit]
        return JSONResponse(
            {
                "object": "list",
                "data": page,
                "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None,
                "has_more": start + query.limit < len(items),
            }
        )

    async def add_items(request: Request, owner: str) -> Response:
        item_query(request.query_params)
        req = conversation_items_request(await gateway.body(request), gateway.limits)
        conv_id = (await owned_conversation(request, owner)).id
        items = _conversation_items(req.items, req.records)
        async with editing(conv_id):
            record = await gateway.store.add_conversation_items(conv_id, owner=owner, items=items, messages=req.records)
        if record is None:
            raise _no_conversation(conv_id)
        return JSONResponse(
            {"object": "list", "data": list(items), "first_id": items[0]["id"], "last_id": items[-1]["id"],
             "has_more": False}
        )  # fmt: skip

    def find_item(record: StoredConversation, item_id: str) -> dict[str, Any]:
        item = next((i for i in record.items if i.get("id") == item_id), None)
        if item is None:
            raise APIError(404, f"Item with id '{item_id}' not found in conversation '{record.id}'.",
                           param="item_id", code="item_not_found")  # fmt: skip
        return item

    async def get_item(request: Request, owner: str) -> Response:
        item_query(request.query_params)
        return JSONResponse(find_item(await owned_conversation(request, owner), request.path_params["item_id"]))

    async def delete_item(request: Request, owner: str) -> Response:
        item_id = request.path_params["item_id"]
        find_item(await owned_conversation(request, owner), item_id)
        conv_id = request.path_params["id"]
        async with editing(conv_id):
            record = await gateway.store.delete_conversation_item(conv_id, item_id, owner=owner)
        if record is None:  # gone meanwhile (another gateway on the same store)
            find_item(await owned_conversation(request, owner), item_id)
            raise _no_conversation(conv_id)
        # OpenAI answers with the conversation itself.
        return JSONResponse(_conversation_body(record))

    async def get_conversation(request: Request, owner: str) -> Response:
        record = await gateway.store.get_conversation(request.path_params["id"], owner=owner)
        if record is None:
            raise APIError(
                404, f"Conversation with id '{request.path_params['id']}' not found.", code="conversation_not_found"
            )
        return JSONResponse(_conversation_body(record))

    async def delete_conversation(request: Request, owner: str) -> Response:
        conv_id = request.path_params["id"]
        # Found for this owner first: another key's id must read as unknown (404), never as busy (409).
        if await gateway.store.get_conversation(conv_id, owner=owner) is None:
            raise APIError(404, f"Conversation with id '{conv_id}' not found.", code="conversation_not_found")
        if not gateway.chains.claim(conv_id):
            raise APIError(409, "a turn in this conversation is still running", code="conversation_busy")
        try:
            if not await gateway.store.delete_conversation(conv_id, owner=owner):
                raise APIError(404, f"Conversation with id '{conv_id}' not found.", code="conversation_not_found")
        finally:
            gateway.chains.release(conv_id)
        return JSONResponse({"id": conv_id, "object": "conversation.deleted", "deleted": True})

    async def metrics(request: Request, owner: str) -> Response:
        gateway.metrics.live_chains.set(len(gateway.chains))
        return Response(gateway.metrics.exposition(), media_type=CONTENT_TYPE)

    async def health(request: Request, owner: str) -> Response:
        return JSONResponse({"status": "ok"})

    async def not_found(request: Request, exc: Exception) -> Response:
        status = exc.status_code if isinstance(exc, HTTPException) else 500
        message = f"Invalid URL ({request.method} {request.url.path})" if status in (404, 405) else "server error"
        return JSONResponse(APIError(status, message, code="not_found" if status == 404 else None).body(), status)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await gateway.aclose()

    routes = [
        Route("/v1/models", endpoint("/v1/models", models), methods=["GET"]),
        Route("/v1/embeddings", endpoint("/v1/embeddings", embeddings), methods=["POST"]),
        Route("/v1/chat/completions", endpoint("/v1/chat/completions", chat_completions), methods=["POST"]),
        Route("/v1/responses", endpoint("/v1/responses", responses), methods=["POST"]),
        Route("/v1/responses/{id}", endpoint("/v1/responses/{id}", get_response), methods=["GET"]),
        Route("/v1/responses/{id}", endpoint("/v1/responses/{id}", delete_response), methods=["DELETE"]),
        Route("/v1/responses/{id}/input_items", endpoint("/v1/responses/{id}/input_items", input_items)),
        Route("/v1/conversations", endpoint("/v1/conversations", create_conversation), methods=["POST"]),
        Route("/v1/conversations/{id}", endpoint("/v1/conversations/{id}", get_conversation), methods=["GET"]),
        Route("/v1/conversations/{id}", endpoint("/v1/conversations/{id}", delete_conversation), methods=["DELETE"]),
        Route("/v1/conversations/{id}", endpoint("/v1/conversations/{id}", update_conversation), methods=["POST"]),
        Route("/v1/conversations/{id}/items", endpoint("/v1/conversations/{id}/items", list_items), methods=["GET"]),
        Route("/v1/conversations/{id}/items", endpoint("/v1/conversations/{id}/items", add_items), methods=["POST"]),
        Route(
            "/v1/conversations/{id}/items/{item_id}",
            endpoint("/v1/conversations/{id}/items/{item_id}", get_item),
            methods=["GET"],
        ),
        Route(
            "/v1/conversations/{id}/items/{item_id}",
            endpoint("/v1/conversations/{id}/items/{item_id}", delete_item),
            methods=["DELETE"],
        ),
        Route("/metrics", endpoint("/metrics", metrics, auth=False)),
        Route("/health", endpoint("/health", health, auth=False)),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: not_found}, lifespan=lifespan)
    app.state.gateway = gateway
    return app


def _finish(slot: Any, gateway: Gateway, started: float, kind: str) -> None:
    slot.__exit__(None, None, None)
    endpoint = "/v1/chat/completions" if kind == "chat" else "/v1/responses"
    gateway.metrics.latency.labels(endpoint).observe(time.perf_counter() - started)


def _count(metrics: Metrics, endpoint: str, usage: _Usage) -> None:
    metrics.tokens.labels(endpoint, "prompt").inc(usage.prompt)
    metrics.tokens.labels(endpoint, "prefilled").inc(usage.prefilled)
    metrics.tokens.labels(endpoint, "completion").inc(usage.completion)


def _chat_usage(usage: _Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt,
        "completion_tokens": usage.completion,
        "total_tokens": usage.prompt + usage.completion,
        "prompt_tokens_details": {"cached_tokens": usage.cached},
    }


def _no_conversation(conv_id: str) -> APIError:
    return APIError(404, f"Conversation with id '{conv_id}' not found.", code="conversation_not_found")


def _with_ids(items: Sequence[dict[str, Any]]) -> tuple[dict[str, Any], ...]:
    """Items as given, each with a new id of its type's prefix."""
    return tuple({"id": _new_id(_ITEM_PREFIX.get(item["type"], "msg")), **item} for item in items)


def _listed(item: dict[str, Any], rec: MessageRecord) -> dict[str, Any]:
    """An input item (with its id) as a conversation lists it: a message written as the gateway writes its output
    (its role as given), another item as it is."""
    return message_item(item["id"], item["role"], rec[1]) if item["type"] == "message" else item


def _conversation_items(given: Sequence[dict[str, Any]], recs: Sequence[MessageRecord]) -> tuple[dict[str, Any], ...]:
    """Items as a conversation lists them, each with a new id (one record per item)."""
    return tuple(_listed(item, rec) for item, rec in zip(_with_ids(given), recs, strict=True))


def _conversation_body(record: StoredConversation) -> dict[str, Any]:
    return {"id": record.id, "object": "conversation", "created_at": record.created_at, "metadata": record.metadata}


def _error_event(err: BaseException) -> dict[str, Any]:
    api = err if isinstance(err, APIError) else from_sdk(err) if isinstance(err, TritonError) else None
    if api is None:
        _log.exception("a stream failed", exc_info=err)
        api = APIError(500, "the server failed while streaming", type="server_error", code="server_error")
    error: dict[str, Any] = api.body()["error"]
    return error


async def _traced(events: AsyncIterator[Any], name: str, model: str, request: Request) -> AsyncIterator[Any]:
    """``events`` inside a span of their own (joining the caller's trace from its ``traceparent``), so the SDK's
    chat-turn and step spans hang under it."""
    span: Span | None = None
    token: object = None
    if TRACING:
        parent = _extract(request)
        outer = None if parent is None else _attach(parent)
        try:
            span = start_span(name, model=model)
        finally:
            if outer is not None:
                _detach(outer)
        if span is not None:
            token = span.attach()
    error: BaseException | None = None
    try:
        async with contextlib.aclosing(events) as stream:  # type: ignore[type-var]
            async for event in stream:
                yield event
    except BaseException as err:
        error = err
        raise
    finally:
        if span is not None:
            span.finish(None if isinstance(error, GeneratorExit | asyncio.CancelledError) else error)
            with contextlib.suppress(ValueError):  # a generator closed from another context
                Span.detach(token)


def _extract(request: Request) -> Any:
    try:
        from opentelemetry import propagate
    except ImportError:  # pragma: no cover - AVAILABLE said it is there
        return None
    if "traceparent" not in request.headers:
        return None
    return propagate.extract(dict(request.headers))


def _attach(ctx: Any) -> object:
    from opentelemetry import context

    return context.attach(ctx)


def _detach(token: object) -> None:
    from opentelemetry import context

    context.detach(token)  # type: ignore[arg-type]


def _openai_logprobs(reply: ChatReply) -> list[dict[str, Any]]:
    """The reply's token log-probabilities in OpenAI's shape (``token``, ``logprob``, ``bytes``, ``top_logprobs``)."""
    return [
        {
            "token": t.token, "logprob": t.logprob, "bytes": list(t.bytes),
            "top_logprobs": [{"token": a.token, "logprob": a.logprob, "bytes": list(a.bytes)} for a in t.top],
        }
        for t in reply.logprobs or ()
    ]  # fmt: skip


def _chat_message(text: str, reply: ChatReply) -> dict[str, Any]:
    """A choice's message: its content (null when the reply is only calls, as OpenAI's) and its calls."""
    message: dict[str, Any] = {"role": "assistant", "content": text if text or not reply.tool_calls else None,
                               "refusal": None}  # fmt: skip
    if reply.tool_calls:
        message["tool_calls"] = [_openai_call(c) for c in reply.tool_calls]
    return message


def _call_deltas(reply: ChatReply) -> list[dict[str, Any]]:
    """A reply's calls as Chat Completions streams them: per call, a delta with its id, type, name and empty
    arguments, then one with the arguments."""
    deltas: list[dict[str, Any]] = []
    for i, call in enumerate(reply.tool_calls):
        head = {"index": i, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}
        deltas.append({"tool_calls": [head]})
        deltas.append({"tool_calls": [{"index": i, "function": {"arguments": call.arguments}}]})
    return deltas


def _chat_logprobs_body(req: ChatRequest, reply: ChatReply) -> dict[str, Any] | None:
    if req.generation.logprobs is None:
        return None
    return {"content": _openai_logprobs(reply), "refusal": None}


async def _chat_chunks(
    events: AsyncIterator[tuple[str, int, Any]], ident: str, created: int, req: ChatRequest
) -> AsyncIterator[bytes]:
    """Chat Completions' SSE: a role chunk, content chunks, the calls' chunks (they come whole with the reply's last
    response), a finish chunk, the usage chunk if asked, [DONE]."""

    def chunk(delta: dict[str, Any], finish: str | None, logprobs: Any = None, *, index: int = 0) -> bytes:
        body: dict[str, Any] = {
            "id": ident,
            "object": "chat.completion.chunk",
            "created": created,
            "model": req.model,
            "system_fingerprint": None,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
        }
        if req.include_usage:
            body["usage"] = None
        return _sse(body)

    replies: list[ChatReply] = []
    try:
        async with contextlib.aclosing(_Ahead(events)) as stream:
            # When the reply may be only calls, its content is null until text comes (as OpenAI streams it).
            opening = {"role": "assistant", "content": None if req.generation.calls_possible else ""}
            for i in range(req.n):
                yield chunk(opening, None, index=i)
            async for kind, index, value in stream:
                if kind == "piece":
                    yield chunk({"content": value}, None, index=index)
                    continue
                reply: ChatReply = value
                replies.append(reply)
                for delta in _call_deltas(reply):
                    yield chunk(delta, None, index=index)
                # The reply's log-probabilities come whole with its last response: they ride the finish chunk.
                yield chunk({}, _finish_reason(reply), _chat_logprobs_body(req, reply), index=index)
                if req.include_usage and len(replies) == req.n:
                    usage = _Usage.of_choices(replies)
                    yield _sse(
                        {
                            "id": ident,
                            "object": "chat.completion.chunk",
                            "created": created,
                            "model": req.model,
                            "system_fingerprint": None,
                            "choices": [],
                            "usage": _chat_usage(usage),
                        }
                    )
    except (APIError, TritonError, SequenceLost) as err:
        yield _sse({"error": _error_event(err)})
    yield b"data: [DONE]\n\n"


async def _response_events(gateway: Gateway, turn: _Turn, pieces: AsyncIterator[str]) -> AsyncIterator[bytes]:
    """The Responses API's stream: created, in_progress, the message item and its text part, deltas, the done
    events; then each call's item (added, its arguments' delta and done, the item done: the calls come whole with
    the reply's last response); then ``response.completed`` (or ``response.incomplete``; ``response.failed`` after
    an error). When the reply may be only calls, its message item opens with its first text (and at the end when
    it has neither text nor calls)."""
    number = 0

    def event(kind: str, **fields: Any) -> bytes:
        nonlocal number
        data = {"type": kind, "sequence_number": number, **fields}
        number += 1
        return _sse(data, kind)

    ids = {"item_id": turn.message_id, "output_index": 0, "content_index": 0}
    parts: list[str] = []
    opened = False

    def opening() -> list[bytes]:
        nonlocal opened
        opened = True
        item = gateway.message_item(turn, None, "in_progress")
        return [
            event("response.output_item.added", output_index=0, item=item),
            event("response.content_part.added", **ids, part=gateway.text_part("")),
        ]

    async with contextlib.aclosing(_Ahead(pieces)) as stream:
        yield event("response.created", response=gateway.response_body(turn))
        yield event("response.in_progress", response=gateway.response_body(turn))
        if not turn.request.generation.calls_possible:
            for data in opening():
                yield data
        try:
            async for piece in stream:
                if not opened:
                    for data in opening():
                        yield data
                parts.append(piece)
                yield event("response.output_text.delta", **ids, delta=piece, logprobs=[])
        except (APIError, TritonError) as err:
            error = _error_event(err)
            yield event("error", code=error["code"], message=error["message"], param=error["param"])
            body = gateway.response_body(turn, status="failed")
            body["error"] = {"code": error["code"] or "server_error", "message": error["message"]}
            yield event("response.failed", response=body)
            return
    text = "".join(parts)
    body = gateway.response_body(turn)
    output = body["output"]
    first_call = 0
    if output and output[0]["type"] == "message":
        first_call = 1
        if not opened:
            for data in opening():
                yield data
        # The reply's log-probabilities come whole with its last response: the done events carry them.
        logprobs = output[0]["content"][0]["logprobs"]
        yield event("response.output_text.done", **ids, text=text, logprobs=logprobs)
        yield event("response.content_part.done", **ids, part=gateway.text_part(text, logprobs))
        yield event("response.output_item.done", output_index=0, item=output[0])
    for index in range(first_call, len(output)):
        item = output[index]
        yield event("response.output_item.added", output_index=index,
                    item={**item, "arguments": "", "status": "in_progress"})  # fmt: skip
        yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                    delta=item["arguments"])  # fmt: skip
        yield event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                    arguments=item["arguments"])  # fmt: skip
        yield event("response.output_item.done", output_index=index, item=item)
    assert turn.reply is not None
    _count(gateway.metrics, "/v1/responses", _Usage.of(turn.reply))
    yield event("response.completed" if body["status"] == "completed" else "response.incomplete", response=body)
