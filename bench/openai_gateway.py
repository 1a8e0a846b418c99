"""The OpenAI-compatible gateway against the SDK it runs on: time to first token deep in a conversation, and tokens/s
with many streams at once, side by side against one server.

Run from the repository root (starts its own server on a copy of server_models/chat; nothing else is needed)::

    .venv/bin/python bench/openai_gateway.py [--ttft-rounds 9] [--turns 10] [--tokens 16]
        [--rounds 5] [--streams 32] [--stream-tokens 128] [--stream-turns 3]
    .venv/bin/python bench/openai_gateway.py --quick     # a smoke run: small and fast, numbers not meaningful

One ``tritonserver`` serves the packaged `chat` model (the GPT-2 demo, one torch thread); the gateway
(``triton_npu_client._gateway.OpenAIGateway``) runs in this process, on this process's event loop, in front of
the same ``Client`` the SDK contenders use. The gateway's clients are the ``openai`` package's ``AsyncOpenAI``
(``max_retries=0``, its own default connection limits); the TTFT contenders' goes over an httpx2 transport that
notes when each response's first body byte arrives and how many bytes each request carried. Every reply is greedy
(temperature 0) and capped at a fixed length (``max_tokens`` / ``max_output_tokens``). The OpenAI API has no
``min_tokens``; the script asks the gateway whether it takes ``extra_body={"min_tokens": N}`` and, if it does not
(it refuses unknown parameters), sends ``max_tokens`` only to every contender, so all of them see the same greedy
replies; reply lengths are then counted, not assumed. Every Responses chain a conversation or a round opens is
deleted (``DELETE /v1/responses/{id}`` of its latest response, which ENDs its chat on the server) when that
conversation or round ends, so nothing piles up against the server's conversation cap (64); the script reads the
gateway's ``/metrics`` after each round and prints its live chains, the chains it closed to make room and its
replays (all 0 when the rounds clean up after themselves).

1. **Time to first token at turn ``--turns``.** One conversation at a time (a person chatting): turn 1 a system
   message and a question, then a question per turn (bench/chat.py's ``QUESTIONS``), each reply ``--tokens``
   tokens at most. Each conversation's system message carries its own tag, so no conversation shares prefix
   blocks with another (a stateless client is helped only by its own earlier turns). Contenders, their order
   rotating round by round, one conversation each per round (``--ttft-rounds``):

   (a) **Responses + previous_response_id**: ``POST /v1/responses``, streaming, each turn naming the previous
       response; the gateway keeps the chain's chat open, so a turn sends and prefills only its new message.
   (b) **Chat Completions, history resent**: ``POST /v1/chat/completions``, streaming, the whole history every
       turn (``stream_options.include_usage``); the server's shared prefix blocks spare the prefill of what its
       earlier turns left there (``usage.prompt_tokens_details.cached_tokens``), but the request still carries
       and the server still renders the whole history.
   (c) **SDK chat**: ``client.chat("chat", system=...)`` and ``chat.send(question)``, no HTTP.

   Columns (medians over the ``--ttft-rounds`` rounds): **TTFT** from the caller starting the request (``create(...)``,
   ``send``) to the first text (the first ``response.output_text.delta`` event, the first non-empty content delta, the
   first piece), at turn 1 and at turn ``--turns``; **vs SDK**: turn ``--turns``'s TTFT over (c)'s; **first byte**: to
   the first byte of the HTTP response body (the gateway sends its first events before the turn reaches the SDK, so
   this is the client's request building and the gateway's own handling: parse, check, find the chain); **prompt**:
   the tokens the reply was conditioned on (the whole conversation); **prefilled**: computed for this request
   (``prompt - cached``; the SDK's ``ChatReply.prompt_tokens``); **cached**: the prompt tokens the server did not
   compute; **request bytes**: the HTTP body (JSON) of that turn; **reply tokens**: the median reply length over the
   conversation's turns. Goal: (a)'s TTFT at turn ``--turns`` within 1.2x of (c)'s.

2. **Tokens/s at ``--streams`` streams.** ``--streams`` conversations, each opened with a short streamed turn
   (untimed), then all generate at the same time, each ``--stream-turns`` turns in a row ("Go on.") of
   ``--stream-tokens`` tokens at most (the demo's greedy replies end by themselves, at about 50 tokens, and the
   gateway takes no ``min_tokens``: several turns make the timed window long enough to measure). Contenders, rotating
   round by round:

   - **gateway, AsyncOpenAI in this process**: streamed ``/v1/responses`` turns continuing each conversation, tokens
     counted from ``usage.output_tokens``; the OpenAI client (building requests, parsing every SSE event into pydantic
     objects) shares this process's loop and GIL with the gateway and the SDK under it.
   - **gateway, AsyncOpenAI in another process**: the same client code run by this script in a second process
     (``--worker URL``, hidden: it opens its chains, says it is ready, runs the timed turns when told, prints one
     JSON line of tokens, wall seconds, TTFTs and its CPU, then deletes its chains), as in a deployment, where the
     applications are not inside the gateway's process. On this 2-core machine it still competes for the same cores
     with the gateway and the server, but not for this process's GIL and loop.
   - **gateway, raw httpx2 in this process**: the same requests, the SSE lines only scanned, not parsed into the
     OpenAI client's objects: what the OpenAI client's own parsing costs.
   - **SDK, client.chat**: ``client.chat`` conversations, ``ChatReply.tokens``, no HTTP.

   Columns (medians over the ``--rounds`` rounds): **tokens** generated by all streams in the timed turns; **wall s**
   from starting the first turn to the last stream's end (timed where the streams run); **tokens/s** = tokens / wall;
   **vs SDK**; **TTFT p50 ms**: the streams' median time to the first text of their first timed turn; **gateway
   process CPU ms / 1k tokens**: this process's CPU (the gateway and the SDK; the in-process clients too) per 1,000
   tokens generated; **client process CPU**: the worker's own, the same unit, for the other-process row; **server
   CPU**: the server's processes' (tritonserver and the model's stub, from /proc), the same unit. The three CPU
   columns share the machine's two cores: what one row spends beyond the SDK's is taken from the server's share.
   Goal: the gateway with the OpenAI client >= 0.8x the SDK's tokens/s (verdicts for the client in this process and
   in another).

Prints the tables, the ratios against their goals, each round's values and how it was run (machine, load average
at the start and the end).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shutil
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import httpx2 as httpx  # the openai client's HTTP library here: a fork of httpx, the same API
import openai

# The questions bench/chat.py asks (its own list: the chat benchmarks time the same conversations); a script's own
# folder is sys.path[0].
from chat import QUESTIONS

from triton_npu_client import Client, LocalTriton
from triton_npu_client._gateway import OpenAIGateway

ROOT = Path(__file__).resolve().parents[1]
MODEL = "chat"
SYSTEM = "You are Emma Woodhouse, answering a friend at Hartfield."
RESPONSES = "(a) Responses, previous_response_id"
COMPLETIONS = "(b) Chat Completions, history resent"
SDK = "(c) SDK chat"
TTFT_CONTENDERS = (RESPONSES, COMPLETIONS, SDK)
GW_OPENAI = "gateway, AsyncOpenAI in this process"
GW_WORKER = "gateway, AsyncOpenAI in another process"
GW_RAW = "gateway, raw httpx2 in this process"
SDK_MANY = "SDK, client.chat"
MANY_CONTENDERS = (GW_OPENAI, GW_WORKER, GW_RAW, SDK_MANY)


# --- an httpx2 transport that times the first body byte ---------------------------------------------------------


@attrs.define
class Probe:
    """One HTTP exchange as the transport saw it (``time.perf_counter()``)."""

    request_bytes: int
    first_byte_at: float | None = None


class _TimedStream(httpx.AsyncByteStream):
    def __init__(self, inner: httpx.AsyncByteStream, probe: Probe) -> None:
        self._inner = inner
        self._probe = probe

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._inner:
            if chunk and self._probe.first_byte_at is None:
                self._probe.first_byte_at = time.perf_counter()
            yield chunk

    async def aclose(self) -> None:
        await self._inner.aclose()


class TimingTransport(httpx.AsyncBaseTransport):
    """The default transport with the OpenAI client's own connection limits, noting each request's body size and its
    response's first body byte; ``last`` is the latest exchange (the TTFT contenders run one request at a time)."""

    def __init__(self) -> None:
        self._inner = httpx.AsyncHTTPTransport(limits=openai.DEFAULT_CONNECTION_LIMITS)
        self.last: Probe | None = None

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        probe = Probe(request_bytes=int(request.headers.get("content-length", 0)))
        self.last = probe
        response = await self._inner.handle_async_request(request)
        assert isinstance(response.stream, httpx.AsyncByteStream)
        return httpx.Response(
            response.status_code,
            headers=response.headers,
            stream=_TimedStream(response.stream, probe),
            extensions=response.extensions,
        )

    async def aclose(self) -> None:
        await self._inner.aclose()


# --- 1. time to first token at turn N ---------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Turn:
    contender: str
    index: int  # 1-based
    ttft_s: float
    first_byte_s: float | None  # None for the SDK (no HTTP)
    prompt: int
    prefilled: int
    request_bytes: int | None
    reply_tokens: int
    reply: str
    sdk_ttft_s: float | None = None  # ChatReply.time_to_first_token_s


@attrs.frozen(kw_only=True)
class Fixed:
    """How replies are made a fixed length: ``max_tokens`` always; ``min_tokens`` where the gateway takes it."""

    tokens: int
    min_tokens: bool

    def gateway(self) -> dict[str, Any]:
        return {"extra_body": {"min_tokens": self.tokens}} if self.min_tokens else {}

    def sdk(self) -> dict[str, Any]:
        return {"max_tokens": self.tokens, "min_tokens": self.tokens if self.min_tokens else None}


def question(i: int) -> str:
    return str(QUESTIONS[i % len(QUESTIONS)])


def tagged(tag: int) -> str:
    """The system message of conversation ``tag``: its own first tokens, so it shares no prefix block."""
    return f"Visit {tag}. {SYSTEM}"


async def responses_conversation(
    oa: openai.AsyncOpenAI, transport: TimingTransport, turns: int, fixed: Fixed, tag: int
) -> list[Turn]:
    out: list[Turn] = []
    previous: str | None = None
    try:
        for i in range(turns):
            extra: dict[str, Any] = {"instructions": tagged(tag)} if i == 0 else {"previous_response_id": previous}
            started = time.perf_counter()
            stream = await oa.responses.create(
                model=MODEL, input=question(i), max_output_tokens=fixed.tokens, temperature=0, stream=True,
                **extra, **fixed.gateway(),
            )  # fmt: skip
            first: float | None = None
            final: Any = None
            async for event in stream:
                if event.type == "response.output_text.delta":
                    if first is None and event.delta:
                        first = time.perf_counter()
                elif event.type in ("response.completed", "response.incomplete"):
                    final = event.response
                elif event.type in ("error", "response.failed"):
                    raise RuntimeError(f"the gateway's stream failed: {event}")
            probe = transport.last
            assert first is not None and final is not None and final.usage is not None and probe is not None  # noqa: PT018
            usage = final.usage
            previous = final.id
            out.append(
                Turn(
                    contender=RESPONSES, index=i + 1, ttft_s=first - started,
                    first_byte_s=(probe.first_byte_at or first) - started, prompt=usage.input_tokens,
                    prefilled=usage.input_tokens - usage.input_tokens_details.cached_tokens,
                    request_bytes=probe.request_bytes, reply_tokens=usage.output_tokens, reply=final.output_text,
                )
            )  # fmt: skip
    finally:
        if previous is not None:  # ENDs the chain's open chat (the server's conversation cap is 64)
            await oa.responses.delete(previous)
    return out


async def completions_conversation(
    oa: openai.AsyncOpenAI, transport: TimingTransport, turns: int, fixed: Fixed, tag: int
) -> list[Turn]:
    out: list[Turn] = []
    history: list[dict[str, str]] = [{"role": "system", "content": tagged(tag)}]
    for i in range(turns):
        history.append({"role": "user", "content": question(i)})
        started = time.perf_counter()
        stream = await oa.chat.completions.create(  # type: ignore[call-overload]
            model=MODEL, messages=history, max_tokens=fixed.tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, **fixed.gateway(),
        )  # fmt: skip
        first: float | None = None
        usage: Any = None
        parts: list[str] = []
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                if first is None:
                    first = time.perf_counter()
                parts.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                usage = chunk.usage
        probe = transport.last
        assert first is not None and usage is not None and probe is not None  # noqa: PT018
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
        reply = "".join(parts)
        out.append(
            Turn(
                contender=COMPLETIONS, index=i + 1, ttft_s=first - started,
                first_byte_s=(probe.first_byte_at or first) - started, prompt=usage.prompt_tokens,
                prefilled=usage.prompt_tokens - (cached or 0), request_bytes=probe.request_bytes,
                reply_tokens=usage.completion_tokens, reply=reply,
            )
        )  # fmt: skip
        history.append({"role": "assistant", "content": reply})
    return out


async def sdk_conversation(client: Client, turns: int, fixed: Fixed, tag: int) -> list[Turn]:
    out: list[Turn] = []
    async with client.chat(MODEL, system=tagged(tag), temperature=0, **fixed.sdk()) as chat:
        for i in range(turns):
            started = time.perf_counter()
            first: float | None = None
            pieces = chat.send(question(i))
            async with contextlib.aclosing(pieces):
                async for _ in pieces:
                    if first is None:
                        first = time.perf_counter()
            reply = chat.last_reply
            assert first is not None and reply is not None  # noqa: PT018
            out.append(
                Turn(
                    contender=SDK, index=i + 1, ttft_s=first - started, first_byte_s=None,
                    prompt=max(reply.context_tokens - reply.tokens, reply.prompt_tokens), prefilled=reply.prompt_tokens,
                    request_bytes=None, reply_tokens=reply.tokens, reply=reply.text,
                    sdk_ttft_s=reply.time_to_first_token_s,
                )
            )  # fmt: skip
    return out


# --- 2. tokens/s at many streams --------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Many:
    contender: str
    tokens: int
    wall_s: float
    cpu_s: float  # this (the gateway's) process, over the timed window
    ttfts_s: tuple[float, ...]
    server_cpu_s: float  # the server's processes (tritonserver and the model's stub), over the timed window
    client_cpu_s: float | None = None  # the worker's own, where the client ran in another process

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0


StreamTurn = Callable[[Any], Awaitable[tuple[int, float | None, Any]]]
# The server's processes (main() fills it in once the model is up; the worker leaves it empty).
SERVER_PIDS: list[int] = []


def cpu_of(pids: Sequence[int]) -> float:
    """User + system CPU seconds ``pids`` have used so far (/proc/PID/stat; 0 for one that is gone)."""
    ticks = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            ticks += int(fields[11]) + int(fields[12])  # utime and stime: the stat line's 14th and 15th fields
    return ticks / os.sysconf("SC_CLK_TCK")


async def _timed_streams(heads: list[Any], turns: int, turn: StreamTurn, label: str) -> Many:
    """Every stream runs ``turns`` turns in a row (``turn(head)`` -> (tokens, first text's time, new head)), all
    streams at once; the clock runs from the start to the last stream's end. ``heads[i]`` follows stream ``i``'s
    latest head as it goes (what its owner deletes at the end, even after a failure)."""

    async def stream(i: int, t0: float) -> tuple[int, float]:
        tokens, ttft = 0, None
        for _ in range(turns):
            n, first, heads[i] = await turn(heads[i])
            tokens += n
            if ttft is None:
                assert first is not None, "a turn without text"
                ttft = first - t0
        assert ttft is not None
        return tokens, ttft

    cpu0, server0 = time.process_time(), cpu_of(SERVER_PIDS)
    t0 = time.perf_counter()
    done = await asyncio.gather(*(stream(i, t0) for i in range(len(heads))))
    wall = time.perf_counter() - t0
    cpu, server = time.process_time() - cpu0, cpu_of(SERVER_PIDS) - server0
    return Many(
        contender=label, tokens=sum(n for n, _ in done), wall_s=wall, cpu_s=cpu, server_cpu_s=server,
        ttfts_s=tuple(t for _, t in done),
    )  # fmt: skip


async def _consume(stream: Any) -> tuple[int, float | None, str]:
    """A streamed response's events: (output tokens, the first text's time, the response's id)."""
    first: float | None = None
    final: Any = None
    async for event in stream:
        if event.type == "response.output_text.delta":
            if first is None and event.delta:
                first = time.perf_counter()
        elif event.type in ("response.completed", "response.incomplete"):
            final = event.response
        elif event.type in ("error", "response.failed"):
            raise RuntimeError(f"the gateway's stream failed: {event}")
    assert final is not None and final.usage is not None  # noqa: PT018
    return int(final.usage.output_tokens), first, str(final.id)


@contextlib.asynccontextmanager
async def chains(oa: openai.AsyncOpenAI, streams: int) -> AsyncIterator[list[str]]:
    """``streams`` Responses chains, each opened with a short streamed turn (untimed; it also warms the client's
    event models); the block's list follows their heads, and every head is deleted when the block ends (DELETE
    ENDs the chain's open chat on the server: rounds do not pile conversations up against its cap)."""
    heads: list[str] = []

    async def one(i: int) -> str:
        stream = await oa.responses.create(
            model=MODEL, instructions=SYSTEM, input=question(i), max_output_tokens=4, temperature=0, stream=True
        )
        return (await _consume(stream))[2]

    try:
        opened = await asyncio.gather(*(one(i) for i in range(streams)), return_exceptions=True)
        heads += [h for h in opened if isinstance(h, str)]
        for h in opened:
            if isinstance(h, BaseException):
                raise h
        yield heads
    finally:
        failed = [
            e
            for e in await asyncio.gather(*(oa.responses.delete(h) for h in heads), return_exceptions=True)
            if isinstance(e, BaseException)
        ]
        if failed:
            print(f"  {len(failed)} of {len(heads)} chains not deleted: {failed[0]!r}", file=sys.stderr)


def responses_turn(oa: openai.AsyncOpenAI, fixed: Fixed) -> StreamTurn:
    """One streamed ``/v1/responses`` turn continuing ``head``, with the OpenAI client."""

    async def turn(head: str) -> tuple[int, float | None, str]:
        stream = await oa.responses.create(
            model=MODEL, input="Go on.", previous_response_id=head, max_output_tokens=fixed.tokens, temperature=0,
            stream=True, **fixed.gateway(),
        )  # fmt: skip
        return await _consume(stream)

    return turn


async def gateway_many(oa: openai.AsyncOpenAI, streams: int, turns: int, fixed: Fixed) -> Many:
    async with chains(oa, streams) as heads:
        return await _timed_streams(heads, turns, responses_turn(oa, fixed), GW_OPENAI)


async def gateway_raw_many(
    oa: openai.AsyncOpenAI, http: httpx.AsyncClient, streams: int, turns: int, fixed: Fixed
) -> Many:
    async def turn(head: str) -> tuple[int, float | None, str]:
        body = {
            "model": MODEL, "input": "Go on.", "previous_response_id": head, "max_output_tokens": fixed.tokens,
            "temperature": 0, "stream": True, **fixed.gateway().get("extra_body", {}),
        }  # fmt: skip
        first: float | None = None
        final: dict[str, Any] | None = None
        last_event = ""
        async with http.stream("POST", "/v1/responses", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if line.startswith("event: "):
                    last_event = line[7:]
                    if last_event == "response.output_text.delta" and first is None:
                        first = time.perf_counter()
                elif line.startswith("data: ") and last_event in ("response.completed", "response.incomplete"):
                    final = json.loads(line[6:])["response"]
                elif line.startswith("data: ") and last_event in ("error", "response.failed"):
                    raise RuntimeError(f"the gateway's stream failed: {line}")
        assert final is not None
        return int(final["usage"]["output_tokens"]), first, str(final["id"])

    async with chains(oa, streams) as heads:
        return await _timed_streams(heads, turns, turn, GW_RAW)


def worker_command(base_url: str, streams: int, turns: int, fixed: Fixed) -> list[str]:
    return [
        sys.executable, str(Path(__file__).resolve()), "--worker", base_url, "--streams", str(streams),
        "--stream-turns", str(turns), "--stream-tokens", str(fixed.tokens),
        *(["--worker-min-tokens"] if fixed.min_tokens else []),
    ]  # fmt: skip


async def gateway_worker_many(base_url: str, streams: int, turns: int, fixed: Fixed) -> Many:
    """The in-process row's streams, run by this script's ``--worker`` mode in a second process: it opens its
    chains, prints ``ready``, runs the timed turns on ``go``, prints one JSON line, then deletes its chains and
    exits. This process's CPU is taken from ``go`` to that line (the gateway and the SDK serving the worker)."""
    proc = await asyncio.create_subprocess_exec(
        *worker_command(base_url, streams, turns, fixed), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE
    )
    assert proc.stdin is not None and proc.stdout is not None  # noqa: PT018
    try:
        ready = await proc.stdout.readline()
        if ready.strip() != b"ready":
            raise RuntimeError(f"the worker did not start (said {ready!r}, exit status {await proc.wait()})")
        cpu0, server0 = time.process_time(), cpu_of(SERVER_PIDS)
        proc.stdin.write(b"go\n")
        await proc.stdin.drain()
        line = await proc.stdout.readline()
        cpu, server = time.process_time() - cpu0, cpu_of(SERVER_PIDS) - server0
        if not line:
            raise RuntimeError(f"the worker failed (exit status {await proc.wait()})")
        got = json.loads(line)
        if rc := await proc.wait():  # after it has deleted its chains
            raise RuntimeError(f"the worker exited with status {rc}")
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    return Many(
        contender=GW_WORKER, tokens=int(got["tokens"]), wall_s=float(got["wall_s"]), cpu_s=cpu, server_cpu_s=server,
        ttfts_s=tuple(float(t) for t in got["ttfts_s"]), client_cpu_s=float(got["cpu_s"]),
    )  # fmt: skip


async def worker(args: argparse.Namespace) -> int:
    """``--worker URL``: the other-process row's client (see :func:`gateway_worker_many`)."""
    fixed = Fixed(tokens=args.stream_tokens, min_tokens=args.worker_min_tokens)
    async with (
        openai.AsyncOpenAI(base_url=args.worker, api_key="x", max_retries=0, timeout=300) as oa,
        chains(oa, args.streams) as heads,
    ):
        print("ready", flush=True)
        if (await asyncio.to_thread(sys.stdin.readline)).strip() != "go":
            return 1
        many = await _timed_streams(heads, args.stream_turns, responses_turn(oa, fixed), GW_WORKER)
        print(
            json.dumps({"tokens": many.tokens, "wall_s": many.wall_s, "ttfts_s": many.ttfts_s, "cpu_s": many.cpu_s}),
            flush=True,
        )
    return 0


async def sdk_many(client: Client, streams: int, turns: int, fixed: Fixed) -> Many:
    async with contextlib.AsyncExitStack() as stack:
        chats = [
            await stack.enter_async_context(client.chat(MODEL, system=SYSTEM, temperature=0)) for _ in range(streams)
        ]
        await asyncio.gather(*(c.ask(question(i), max_tokens=4) for i, c in enumerate(chats)))

        async def turn(chat: Any) -> tuple[int, float | None, Any]:
            first: float | None = None
            pieces = chat.send("Go on.", **fixed.sdk())
            async with contextlib.aclosing(pieces):
                async for _ in pieces:
                    if first is None:
                        first = time.perf_counter()
            assert chat.last_reply is not None
            return chat.last_reply.tokens, first, chat

        return await _timed_streams(list(chats), turns, turn, SDK_MANY)


# --- the run ----------------------------------------------------------------------------------------------------


async def takes_min_tokens(oa: openai.AsyncOpenAI) -> tuple[bool, str]:
    """Whether the gateway accepts ``min_tokens`` (``extra_body``) on both endpoints, and what it said."""
    said = []
    try:
        r = await oa.responses.create(model=MODEL, input="hi", max_output_tokens=2, extra_body={"min_tokens": 2})
        await oa.responses.delete(r.id)  # its chain's chat
        await oa.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, extra_body={"min_tokens": 2}
        )
    except openai.BadRequestError as err:
        said.append(f"{err.status_code}: {err.message}")
        return False, "; ".join(said)
    return True, "accepted"


def med(values: Sequence[float]) -> float:
    return statistics.median(values) if values else 0.0


def verdict(met: bool) -> str:
    return "met" if met else "NOT met"


def md_table(header: Sequence[str], rows: Sequence[Sequence[str]], right_from: int = 1) -> str:
    lines = ["| " + " | ".join(header) + " |"]
    lines.append("|" + "|".join("---" if i < right_from else "---:" for i in range(len(header))) + "|")
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def ttft_report(turns: list[Turn], last: int, rounds: int, fixed: Fixed) -> tuple[str, bool]:
    by: dict[tuple[str, int], list[Turn]] = {}
    for t in turns:
        by.setdefault((t.contender, t.index), []).append(t)
    lengths = {c: [t.reply_tokens for t in turns if t.contender == c] for c in TTFT_CONTENDERS}
    ttft = {c: med([t.ttft_s for t in by[(c, last)]]) for c in TTFT_CONTENDERS}
    sdk = ttft[SDK]
    rows = []
    for c in TTFT_CONTENDERS:
        end, one = by[(c, last)], by[(c, 1)]
        fb = [t.first_byte_s for t in end if t.first_byte_s is not None]
        sizes = [t.request_bytes for t in end if t.request_bytes is not None]
        rows.append([
            c,
            f"{med([t.ttft_s for t in one]) * 1e3:.1f}",
            f"**{ttft[c] * 1e3:.1f}**",
            f"**{ttft[c] / sdk:.2f}x**" if sdk > 0 else "-",
            f"{med(fb) * 1e3:.1f}" if fb else "-",
            f"{med([t.prompt for t in end]):.0f}",
            f"{med([t.prefilled for t in end]):.0f}",
            f"{med([t.prompt - t.prefilled for t in end]):.0f}",
            f"{med(sizes):,.0f}" if sizes else "-",
            f"{med(lengths[c]):.0f} ({min(lengths[c])}-{max(lengths[c])})",
        ])  # fmt: skip
    header = ["contender", "TTFT turn 1, ms", f"TTFT turn {last}, ms", "vs SDK", "first byte, ms", "prompt",
              "prefilled", "cached", "request bytes", "reply tokens (range)"]  # fmt: skip
    ok = sdk > 0 and ttft[RESPONSES] <= 1.2 * sdk
    sdk_own = med([t.sdk_ttft_s for t in by[(SDK, last)] if t.sdk_ttft_s is not None])
    lines = [
        f"## Time to first token at turn {last} (one conversation at a time; medians of {rounds} conversations per "
        f"contender, order rotating; replies greedy, max {fixed.tokens} tokens"
        + (", min_tokens too" if fixed.min_tokens else "")
        + ")\n",
        md_table(header, rows),
        "",
        f"- **Goal: (a) Responses' TTFT at turn {last} within 1.2x of the SDK's: {ttft[RESPONSES] * 1e3:.1f} vs "
        f"{sdk * 1e3:.1f} ms = {ttft[RESPONSES] / sdk:.3f}x, {verdict(ok)}.**",
        f"- (b) resending the history: {ttft[COMPLETIONS] * 1e3:.1f} ms, {ttft[COMPLETIONS] / sdk:.2f}x the SDK's, "
        f"{ttft[COMPLETIONS] / ttft[RESPONSES]:.2f}x (a)'s.",
        f"- (c)'s own ChatReply.time_to_first_token_s at turn {last}: {sdk_own * 1e3:.1f} ms (the table's SDK TTFT "
        "is timed around send(), as the other rows are).",
    ]
    for c in TTFT_CONTENDERS:
        end = by[(c, last)]
        values = ", ".join(f"{t.ttft_s * 1e3:.1f}" for t in end)
        bytes_at = ", ".join(f"{t.first_byte_s * 1e3:.1f}" for t in end if t.first_byte_s is not None)
        lines.append(
            f"- {c}, turn {last} per round: TTFT {values} ms" + (f"; first byte {bytes_at} ms" if bytes_at else "")
        )
    return "\n".join(lines), ok


def many_report(runs: list[Many], streams: int, turns: int, rounds: int, fixed: Fixed) -> tuple[str, bool, bool]:
    by: dict[str, list[Many]] = {}
    for r in runs:
        by.setdefault(r.contender, []).append(r)
    tps = {c: med([r.tokens_per_s for r in by[c]]) for c in MANY_CONTENDERS}
    sdk = tps[SDK_MANY]
    rows = []
    for c in MANY_CONTENDERS:
        rs = by[c]
        client_cpu = [r.client_cpu_s / r.tokens * 1e6 for r in rs if r.client_cpu_s is not None and r.tokens]
        rows.append([
            c, str(streams), f"{med([r.tokens for r in rs]):,.0f}", f"{med([r.wall_s for r in rs]):.2f}",
            f"**{tps[c]:,.0f}**", f"**{tps[c] / sdk:.2f}x**" if sdk > 0 else "-",
            f"{med([med(r.ttfts_s) for r in rs]) * 1e3:.0f}",
            f"{med([r.cpu_s / r.tokens * 1e6 for r in rs if r.tokens]):.0f}",
            f"{med(client_cpu):.0f}" if client_cpu else "-",
            f"{med([r.server_cpu_s / r.tokens * 1e6 for r in rs if r.tokens]):.0f}",
        ])  # fmt: skip
    ok = sdk > 0 and tps[GW_OPENAI] >= 0.8 * sdk
    ok_worker = sdk > 0 and tps[GW_WORKER] >= 0.8 * sdk
    header = ["contender", "streams", "tokens", "wall s", "tokens/s", "vs SDK", "TTFT p50, ms",
              "gateway process CPU, ms / 1k tokens", "client process CPU, ms / 1k", "server CPU, ms / 1k"]  # fmt: skip
    lines = [
        f"## Tokens/s at {streams} streams at once (medians of {rounds} rounds, contenders rotating; each stream "
        f"{turns} turn(s) in a row of max {fixed.tokens} tokens"
        + (", min_tokens too" if fixed.min_tokens else "")
        + ")\n",
        md_table(header, rows),
        "",
        f"- **Goal: the gateway (AsyncOpenAI) >= 0.8x the SDK's tokens/s at {streams} streams. The client in this "
        f"process: {tps[GW_OPENAI]:,.0f} vs {sdk:,.0f} = {tps[GW_OPENAI] / sdk:.3f}x, {verdict(ok)}. The client in "
        f"another process: {tps[GW_WORKER]:,.0f} = {tps[GW_WORKER] / sdk:.3f}x, {verdict(ok_worker)}.**",
        f"- raw httpx2 in this process (no OpenAI client parsing): {tps[GW_RAW]:,.0f} = {tps[GW_RAW] / sdk:.2f}x.",
    ]
    # Each round runs every contender once: a round's ratio to its own SDK run is less exposed to the machine's load
    # drifting from round to round than the ratio of medians.
    paired = []
    for c in MANY_CONTENDERS[:-1]:
        ratios = [r.tokens_per_s / b.tokens_per_s for r, b in zip(by[c], by[SDK_MANY], strict=True) if b.tokens_per_s]
        paired.append(f"{c} {med(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})" if ratios else f"{c} -")
    lines.append("- Per round, over that round's SDK run (median, range): " + "; ".join(paired) + ".")
    for c in MANY_CONTENDERS:
        values = ", ".join(f"{r.tokens_per_s:,.0f}" for r in by[c])
        lines.append(f"- {c} per round: {values} tokens/s")
    return "\n".join(lines), ok, ok_worker


async def gateway_counts(http: httpx.AsyncClient) -> dict[str, float]:
    """The gateway's live chains, the chains it closed to make room, and its replays (from ``/metrics``)."""
    text = (await http.get("/metrics")).text
    counts = {"live chains": 0.0, "closed for room": 0.0, "replays": 0.0}
    names = {
        "tnc_openai_live_chains": "live chains",
        "tnc_openai_chains_closed_for_room_total": "closed for room",
        "tnc_openai_replays_total": "replays",
    }
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        key = names.get(name.partition("{")[0])
        if key is not None:
            counts[key] += float(value)
    return counts


def counted(counts: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.0f}" for k, v in counts.items())


def wiring(gateway: OpenAIGateway) -> str:
    """How the gateway's connections are served: TCP_NODELAY on its listener (accepted connections inherit it on
    Linux; asyncio also sets it for a listener made with proto IPPROTO_TCP) and uvicorn's HTTP protocol."""
    sock, server = gateway._socket, gateway._server  # the gateway exposes neither; a benchmark looks
    assert sock is not None and server is not None  # noqa: PT018
    nodelay = sock.proto == socket.IPPROTO_TCP or bool(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
    protocol = getattr(server.config, "http_protocol_class", None)
    return f"TCP_NODELAY {'yes' if nodelay else 'NO'}, uvicorn HTTP protocol {getattr(protocol, '__name__', '?')}"


def rotate(items: Sequence[str], r: int) -> list[str]:
    k = r % len(items)
    return [*items[k:], *items[:k]]


async def main(args: argparse.Namespace) -> int:
    load_start = os.getloadavg()
    started = time.perf_counter()
    turns: list[Turn] = []
    many: list[Many] = []
    async with contextlib.AsyncExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-openai-")))
        shutil.copytree(ROOT / "server_models" / MODEL, work / MODEL)
        t = time.perf_counter()
        server = await stack.enter_async_context(LocalTriton(work, auto_complete_config=False))
        client = await stack.enter_async_context(Client(server.grpc_url, timeout_s=300))
        gateway = await stack.enter_async_context(OpenAIGateway(client, port=0))
        print(f"server {server.grpc_url}, gateway {gateway.base_url} up in {time.perf_counter() - t:.1f} s; "
              f"{wiring(gateway)}", file=sys.stderr)  # fmt: skip
        transport = TimingTransport()
        http = await stack.enter_async_context(httpx.AsyncClient(transport=transport, timeout=300))
        oa = openai.AsyncOpenAI(base_url=gateway.base_url, api_key="x", http_client=http, max_retries=0)
        # The tokens/s rows' client: the OpenAI client's own default HTTP client, as the worker's.
        oa_many = await stack.enter_async_context(
            openai.AsyncOpenAI(base_url=gateway.base_url, api_key="x", max_retries=0, timeout=300)
        )
        raw = await stack.enter_async_context(
            httpx.AsyncClient(base_url=gateway.url, timeout=300, limits=openai.DEFAULT_CONNECTION_LIMITS)
        )

        min_ok, said = await takes_min_tokens(oa)
        print(f"min_tokens through the gateway: {said}", file=sys.stderr)
        fixed = Fixed(tokens=args.tokens, min_tokens=min_ok)
        fixed_many = Fixed(tokens=args.stream_tokens, min_tokens=min_ok)

        async def conversation(contender: str, tag: int, n: int) -> list[Turn]:
            if contender == RESPONSES:
                return await responses_conversation(oa, transport, n, fixed, tag)
            if contender == COMPLETIONS:
                return await completions_conversation(oa, transport, n, fixed, tag)
            return await sdk_conversation(client, n, fixed, tag)

        async def streams(contender: str, n: int, k: int, fix: Fixed) -> Many:
            if contender == GW_OPENAI:
                return await gateway_many(oa_many, n, k, fix)
            if contender == GW_WORKER:
                return await gateway_worker_many(gateway.base_url, n, k, fix)
            if contender == GW_RAW:
                return await gateway_raw_many(oa_many, raw, n, k, fix)
            return await sdk_many(client, n, k, fix)

        # Warm-up: every path once (first calls pay lazy initialisation: the client's model fetch, the gateway's
        # catalog and connections, the stub's first passes, the OpenAI client's first models, the worker's imports).
        for i, c in enumerate(TTFT_CONTENDERS):
            await conversation(c, 900 + i, 2)
        for c in MANY_CONTENDERS:
            await streams(c, min(args.streams, 4), 1, Fixed(tokens=4, min_tokens=min_ok))
        SERVER_PIDS[:] = server.processes()  # tritonserver and the model's stub, up by now

        for r in range(args.ttft_rounds):
            for k, c in enumerate(rotate(TTFT_CONTENDERS, r)):
                turns += await conversation(c, 100 + len(TTFT_CONTENDERS) * r + k, args.turns)
            print(f"  round {r + 1}: TTFT at turn {args.turns}: " + ", ".join(
                f"{t.contender.split(' ')[0]} {t.ttft_s * 1e3:.1f} ms"
                for t in turns[-len(TTFT_CONTENDERS) * args.turns :] if t.index == args.turns
            ) + f"; {counted(await gateway_counts(raw))}", file=sys.stderr)  # fmt: skip
        for r in range(args.rounds):
            for c in rotate(MANY_CONTENDERS, r):
                many.append(await streams(c, args.streams, args.stream_turns, fixed_many))
            print(f"  round {r + 1}: tokens/s at {args.streams}: " + ", ".join(
                f"{m.contender} {m.tokens_per_s:,.0f}" for m in many[-len(MANY_CONTENDERS) :]
            ) + f"; {counted(await gateway_counts(raw))}", file=sys.stderr)  # fmt: skip
        counts = await gateway_counts(raw)
        gateway_wiring = wiring(gateway)

    text1, _ = ttft_report(turns, args.turns, args.ttft_rounds, fixed)
    text2, _, _ = many_report(many, args.streams, args.stream_turns, args.rounds, fixed_many)
    print(text1 + "\n\n" + text2 + "\n")
    print(f"- min_tokens through the gateway (extra_body): {said}")
    print(f"- the gateway's connections: {gateway_wiring}")
    print(f"- the gateway after the run (every conversation and round deletes its chains): {counted(counts)}")
    print(
        f"\nRun: `{' '.join(['.venv/bin/python', 'bench/openai_gateway.py', *sys.argv[1:]])}` on {platform.node()}, "
        f"Python {platform.python_version()}, openai {openai.__version__}, {os.cpu_count()} CPUs, load average "
        f"{load_start[0]:.2f} at the start and {os.getloadavg()[0]:.2f} at the end; "
        f"{time.perf_counter() - started:.0f} s in all."
    )
    if args.quick:
        print("(--quick: a smoke run; the numbers are not meaningful)")
    return 0  # a benchmark reports its verdicts; it does not fail on them


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=None, help="tokens/s rounds, contenders rotating (default 5; "
                   "--quick 1)")  # fmt: skip
    p.add_argument("--ttft-rounds", type=int, default=None, help="TTFT rounds: conversations per contender, "
                   "contenders rotating (default 9: one turn per conversation is timed; --quick 1)")  # fmt: skip
    p.add_argument("--turns", type=int, default=None, help="turns per conversation, the last timed (default 10; "
                   "--quick 3)")  # fmt: skip
    p.add_argument("--tokens", type=int, default=None, help="max tokens per reply in the TTFT conversations "
                   "(default 16; --quick 4)")  # fmt: skip
    p.add_argument("--streams", type=int, default=None, help="conversations at once (default 32; --quick 8)")
    p.add_argument("--stream-tokens", type=int, default=None, help="max tokens per stream's turn (default 128; "
                   "--quick 8)")  # fmt: skip
    p.add_argument("--stream-turns", type=int, default=None, help="timed turns in a row per stream (default 3; "
                   "--quick 1)")  # fmt: skip
    p.add_argument("--quick", action="store_true", help="a smoke run: --rounds 1 --ttft-rounds 1 --turns 3 "
                   "--tokens 4 --streams 8 --stream-tokens 8 --stream-turns 1")  # fmt: skip
    # The other-process row's client: this script run again against the gateway's base URL (see gateway_worker_many).
    p.add_argument("--worker", metavar="URL", default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker-min-tokens", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    defaults = {"rounds": (5, 1), "ttft_rounds": (9, 1), "turns": (10, 3), "tokens": (16, 4), "streams": (32, 8),
                "stream_tokens": (128, 8), "stream_turns": (3, 1)}  # fmt: skip
    for name, (full, quick) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    return args


if __name__ == "__main__":
    arguments = parse()
    sys.exit(asyncio.run(worker(arguments) if arguments.worker else main(arguments)))
