"""``triton-npu chat``: an interactive chat in the terminal, replies streamed as they are generated.

One line of input is one user message. The reply goes to stdout piece by piece; the prompt, a short stats
line after each reply (tokens, tokens/s, time to the first token) and notices go to stderr, so stdout holds
only the replies. Without ``--url`` an embedded ``tritonserver`` serving the packaged model is started for the
session and stopped at the end; with ``--checkpoint DIR`` it serves a chat model generated from that Hugging Face
checkpoint folder instead (see :func:`add_checkpoint_arguments`, shared with ``triton-npu serve --checkpoint``).
A banner on stderr says which model the chat reached; a model the server lacks is answered with the chat models it
has. A line that starts with ``/`` is a command, never sent (``//text`` sends ``/text``): ``/help``, ``/reset`` (a
new conversation; the old one is ended on the server), ``/system TEXT`` (a new one with that system message),
``/stats`` (the last reply's figures and the conversation's), ``/result TEXT`` and ``/quit``.

Tools: ``--tools FILE`` (a JSON array of OpenAI tool definitions) lets the model call them, ``--tool-choice`` says
whether it may (``auto``, ``none``), must (``required``) or must call one function (its name). A reply's calls are
shown on stdout after its text, one line each, ``→ NAME(ARGUMENTS)  [ID]``; ``/result TEXT`` answers the oldest call
not yet answered, and once every call of the reply has its result they are sent together as the next turn (until
then a line is refused: the model waits for the results).

Keys and exit status:

- **Ctrl-C during a reply** cancels that turn: the server rolls it back (it is dropped from the history) and
  the prompt returns.
- **Ctrl-C at the prompt** (or while starting) exits with status 130, the shell's code for SIGINT.
- **EOF** (Ctrl-D, or the end of piped input) exits with status 0.
- An error the SDK raises is printed as one line; it ends the command with status 2 when the conversation
  cannot go on (lost, connection gone), else the prompt returns.

Input is read by a thread, so waiting for a line never blocks the event loop (the reply keeps streaming while
the next line is typed).
"""

from __future__ import annotations

import argparse
import asyncio
import codecs
import contextlib
import io
import os
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, TextIO

from .._errors import ModelNotFoundError, TritonError, UsageError
from .._local import (
    CHAT_CPU_THREADS_AUTO,
    CHAT_DEVICES,
    CHAT_DTYPES,
    CHAT_MODEL_TYPES,
    LocalTriton,
    chat_model_repository,
    default_model_repository,
)
from ._urls import URL_HELP, add_url_argument, checked_urls

if TYPE_CHECKING:
    from .._client import Client
    from .._sessions import ChatMessage, ChatReply, ChatSession, ToolCall

__all__ = ["CHECKPOINT_FLAG", "add_arguments", "add_checkpoint_arguments", "checkpoint_repository", "run"]

EXIT_INTERRUPTED: Final = 130

_PROMPT: Final = "> "


# The options that shape a model generated from a checkpoint, by the flag that names them (argparse dest).
_CHECKPOINT_OPTIONS: Final = {
    "--name": "chat_name",
    "--max-ctx": "max_ctx",
    "--dtype": "dtype",
    "--device": "device",
    "--max-cache-mb": "max_cache_mb",
    "--cpu-threads": "cpu_threads",
}


#: The flag naming a checkpoint folder, the same in every verb (``serve`` also takes its old name, ``--chat``).
CHECKPOINT_FLAG: Final = "--checkpoint"


def add_checkpoint_arguments(
    p: argparse.ArgumentParser, flag: str = CHECKPOINT_FLAG, *, aliases: tuple[str, ...] = ()
) -> None:
    """``--checkpoint DIR`` (a Hugging Face checkpoint folder to serve as a chat model; ``aliases``: other names of
    the flag, kept for scripts that use them) and the options of that model.

    The values land in ``ns.checkpoint``, ``ns.chat_name``, ``ns.max_ctx``, ``ns.dtype``, ``ns.device``,
    ``ns.max_cache_mb`` and ``ns.cpu_threads`` (text, checked by :func:`checkpoint_repository`); all None when not
    given.
    """
    p.add_argument(
        flag,
        *aliases,
        dest="checkpoint",
        metavar="DIR",
        default=None,
        help=(
            "serve the chat model of this Hugging Face checkpoint folder (config.json with model_type "
            f"{', '.join(CHAT_MODEL_TYPES)}; tokenizer.json; tokenizer_config.json with a chat_template; "
            "model.safetensors or a sharded index)" + (f"; also {', '.join(aliases)}" if aliases else "")
        ),
    )
    p.add_argument(
        "--name", dest="chat_name", default=None, help=f"the model's name (default: DIR's name); needs {flag}"
    )
    p.add_argument(
        "--max-ctx",
        type=int,
        default=None,
        help=f"positions per conversation, at most the checkpoint's (default: the checkpoint's); needs {flag}",
    )
    p.add_argument(
        "--dtype",
        default=None,
        metavar="|".join(CHAT_DTYPES),
        help=f"weights and KV cache (default auto: float32 on CPU, the checkpoint's on an accelerator); needs {flag}",
    )
    p.add_argument(
        "--device", default=None, metavar="|".join(CHAT_DEVICES), help=f"the device (default auto); needs {flag}"
    )
    p.add_argument(
        "--max-cache-mb",
        type=float,
        default=None,
        help=f"KV-cache cap in MiB (default: the packaged model's); needs {flag}",
    )
    p.add_argument(
        "--cpu-threads",
        default=None,
        metavar=f"N|{CHAT_CPU_THREADS_AUTO}",
        help=(
            f"torch threads of a CPU instance (default {CHAT_CPU_THREADS_AUTO}: one fewer than the cores the "
            f"server's process may run on, counted when the model loads); needs {flag}"
        ),
    )


def checkpoint_repository(
    ns: argparse.Namespace, flag: str, *, prefix: str
) -> contextlib.AbstractContextManager[tuple[Path, str]] | None:
    """The temporary repository serving ``ns.checkpoint``, entered as (repository, model name); None without ``flag``.

    Checkpoint-only options given without ``flag`` are refused now; the folder and the options when it is entered,
    before it creates anything (enter it before starting a server). :class:`UsageError` (one line) says what is
    wrong.
    """
    if ns.checkpoint is None:
        for option, dest in _CHECKPOINT_OPTIONS.items():
            if getattr(ns, dest) is not None:
                raise UsageError(f"{option} shapes the model generated from a checkpoint: it needs {flag} DIR")
        return None
    return chat_model_repository(
        ns.checkpoint,
        cpu_threads=_cpu_threads(ns.cpu_threads),
        name=ns.chat_name,
        max_ctx=ns.max_ctx,
        dtype="auto" if ns.dtype is None else ns.dtype,
        device="auto" if ns.device is None else ns.device,
        max_cache_mb=ns.max_cache_mb,
        prefix=prefix,
    )


def _cpu_threads(given: str | None) -> int | str:
    """``--cpu-threads`` as :func:`chat_model_repository` takes it: ``"auto"`` (also when not given) or an int.

    Parsed here rather than by argparse, whose refusal is a usage paragraph: a mistake is one line, like the others.
    """
    if given is None or given.strip().lower() == CHAT_CPU_THREADS_AUTO:
        return CHAT_CPU_THREADS_AUTO
    try:
        return int(given.strip(), 10)
    except ValueError:
        raise UsageError(
            f"cpu_threads (--cpu-threads): expected {CHAT_CPU_THREADS_AUTO!r} or a positive integer, given {given!r}"
        ) from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_url_argument(p, help=URL_HELP + " (neither given: start an embedded server)")
    p.add_argument("--model", default=None, help="chat model name (default: chat; with --checkpoint see --name)")
    p.add_argument("--system", default=None, help="system message sent with the first turn")
    p.add_argument(
        "--max-tokens", type=int, default=None,
        help="most tokens per reply (0: no cap, to the end of the context; default: the model's)",
    )  # fmt: skip
    p.add_argument(
        "--min-tokens", type=int, default=None, help="the reply may not end before this many tokens (default 0)"
    )
    p.add_argument("--temperature", type=float, default=None, help="sampling temperature (default 0: greedy)")
    p.add_argument(
        "--top-p", type=float, default=None, help="nucleus sampling: the smallest set of tokens this likely, in (0, 1]"
    )
    p.add_argument("--top-k", type=int, default=None, help="sample among the k likeliest tokens (default 0: off)")
    p.add_argument(
        "--stop",
        action="append",
        default=None,
        metavar="TEXT",
        help="a string the reply ends before (repeatable: each one ends it)",
    )
    p.add_argument("--seed", type=int, default=None, help="sampling seed (same seed, same reply)")
    p.add_argument(
        "--tools", default=None, metavar="FILE",
        help='tools the model may call: a JSON file holding a list of {"type": "function", "function": {"name", '
        '"description", "parameters"}} (answer a call with /result TEXT)',
    )  # fmt: skip
    p.add_argument(
        "--tool-choice", default=None, metavar="auto|none|required|NAME",
        help="whether the model may call the tools (auto, the default), must not (none), must call (required) or "
        "must call the function NAME; needs --tools",
    )  # fmt: skip
    p.add_argument("--startup-timeout", type=float, default=120.0, help="seconds to wait for the embedded server")
    add_checkpoint_arguments(p)


class _Interrupt:
    """Put in the line queue by Ctrl-C at the prompt."""


_INTERRUPT: Final = _Interrupt()
Line = str | None | _Interrupt  # None: end of input


class _Keys:
    """Where a Ctrl-C goes: the turn streaming now, else the prompt, else (while starting) the whole command."""

    def __init__(self, main: asyncio.Task[int], lines: asyncio.Queue[Line]) -> None:
        self.main = main
        self.lines = lines
        self.turn: asyncio.Task[ChatReply] | None = None
        self.at_prompt = False
        self.interrupted = False

    def on_sigint(self) -> None:
        if self.turn is not None and not self.turn.done():
            self.turn.cancel()
        elif self.at_prompt:
            self.interrupted = True  # checked before any line already queued
            self.lines.put_nowait(_INTERRUPT)
        else:
            self.main.cancel()


def _read_lines(fd: int, loop: asyncio.AbstractEventLoop, lines: asyncio.Queue[Line]) -> None:
    """Read ``fd`` to its end in this (daemon) thread, handing each line to the loop; ``None`` at the end."""

    def put(item: Line) -> bool:
        try:
            loop.call_soon_threadsafe(lines.put_nowait, item)
        except RuntimeError:  # the loop has closed: nobody reads any more
            return False
        return True

    # os.read, not sys.stdin: a thread blocked inside the buffered reader holds its lock, which the interpreter
    # may need at exit.
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    pending = ""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            chunk = b""
        if not chunk:
            break
        pending += decoder.decode(chunk)
        *complete, pending = pending.split("\n")
        for line in complete:
            if not put(line):
                return
    pending += decoder.decode(b"", final=True)
    if pending and not put(pending):
        return
    put(None)


def _stats(reply: ChatReply) -> str:
    ttft = "-" if reply.time_to_first_token_s is None else f"{reply.time_to_first_token_s * 1000:.0f} ms"
    parts = [f"{reply.tokens} tokens", f"{reply.tokens_per_s:.1f} tokens/s", f"first token {ttft}"]
    if reply.finish_reason != "stop":
        parts.append(f"finished: {reply.finish_reason}")
    if reply.dropped:
        parts.append(f"{reply.dropped} oldest messages dropped")
    return "[" + ", ".join(parts) + "]"


def _read_tools(path: str) -> list[Any]:
    """``--tools FILE``'s JSON, read before anything starts (the tools themselves are checked as ChatOptions checks
    them); :class:`UsageError` (one line) when the file cannot be read or is not a JSON array."""
    import json

    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise UsageError(f"--tools {path}: cannot read the file ({err})") from None
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as err:
        raise UsageError(f"--tools {path}: not JSON ({err})") from None
    if not isinstance(value, list):
        raise UsageError(f"--tools {path}: expected a JSON array of tools, given a JSON {type(value).__name__}")
    return value


def _tool_choice(given: str | None) -> str | dict[str, Any] | None:
    """``--tool-choice`` as the SDK takes it: one of the three words, else the name of the function to call."""
    if given is None or given in ("auto", "none", "required"):
        return given
    return {"type": "function", "function": {"name": given}}


def _call_line(call: ToolCall) -> str:
    return f"\u2192 {call.name}({call.arguments})  [{call.id}]"


def _dim(text: str, stream: TextIO) -> str:
    return f"\x1b[2m{text}\x1b[0m" if stream.isatty() else text


# Control characters a model may emit (ESC would start a terminal escape sequence) are shown as U+FFFD on a
# terminal; newline and tab stay. Piped output is left exactly as the model made it.
_CONTROLS: Final = {c: "\ufffd" for c in [*range(0x20), 0x7F, *range(0x80, 0xA0)] if c not in (0x09, 0x0A)}


async def _turn(chat: ChatSession, message: str | tuple[ChatMessage, ...], out: TextIO) -> ChatReply:
    terminal = out.isatty()
    shown = False
    async with contextlib.aclosing(chat.send(message)) as pieces:
        async for piece in pieces:
            out.write(piece.translate(_CONTROLS) if terminal else piece)
            out.flush()
            shown = True
    reply = chat.last_reply
    assert reply is not None  # the loop completed, so the turn was recorded
    if reply.tool_calls:
        # On stdout with the text: the calls are the reply (a script reading the replies reads them too).
        lines = "\n".join(_call_line(c) for c in reply.tool_calls)
        out.write(("\n" if shown else "") + (lines.translate(_CONTROLS) if terminal else lines))
        out.flush()
    return reply


_HELP: Final = """commands (a line that starts with / is a command; start it with // to send it as a message):
  /help          this list
  /reset         a new conversation (the system message stays)
  /system TEXT   a new conversation with TEXT as its system message (/system alone shows the one now)
  /stats         the last reply's figures (tokens, tokens/s, first token, ...) and the conversation's
  /result TEXT   the result of the oldest tool call not answered yet (with --tools); once every call of the
                 reply has one, they are sent as the next turn
  /quit          leave (so do Ctrl-D and the end of piped input)
Ctrl-C during a reply cancels it (dropped from the history); at the prompt it leaves with status 130."""


class _Conversation:
    """The conversation going on, and how to begin a new one (``/reset``, ``/system``): a new chat on the model,
    the old one ended on the server."""

    def __init__(self, open_chat: Callable[[str | None], ChatSession], system: str | None) -> None:
        self._open = open_chat
        self.system = system
        self._chat: ChatSession | None = None
        self.last_reply: ChatReply | None = None
        self.replies = 0
        self.tokens = 0
        # The last reply's calls, and the results given so far (/result), oldest first: sent once all are in.
        self.calls: tuple[ToolCall, ...] = ()
        self.results: list[ChatMessage] = []

    @property
    def chat(self) -> ChatSession:
        assert self._chat is not None, "the conversation is not open"
        return self._chat

    async def begin(self) -> None:
        """Open a chat (entering it reaches the model: a wrong name or URL raises here)."""
        chat = self._open(self.system)
        self._chat = await chat.__aenter__()

    async def restart(self, system: str | None) -> None:
        await self.aclose()
        self.system = system
        self.calls, self.results = (), []
        await self.begin()

    @property
    def unanswered(self) -> tuple[ToolCall, ...]:
        return self.calls[len(self.results) :]

    async def aclose(self) -> None:
        chat, self._chat = self._chat, None
        if chat is not None:
            await chat.aclose()

    def record(self, reply: ChatReply) -> None:
        self.last_reply = reply
        self.replies += 1
        self.tokens += reply.tokens
        self.calls, self.results = reply.tool_calls, []

    def stats(self) -> str:
        chat = self.chat
        lines = []
        reply = self.last_reply
        if reply is None:
            lines.append("last reply: none yet")
        else:
            ttft = "-" if reply.time_to_first_token_s is None else f"{reply.time_to_first_token_s * 1000:.0f} ms"
            lines.append(
                f"last reply: {reply.tokens} tokens in {reply.elapsed_s:.2f} s ({reply.tokens_per_s:.1f} tokens/s), "
                f"first token {ttft}, finished: {reply.finish_reason}; input {reply.input_tokens} tokens "
                f"({reply.prompt_tokens} prefilled)"
            )
        lines.append(f"conversation: {chat.turns} turns, {chat.context_tokens} tokens held by the server")
        lines.append(f"session: {self.replies} replies, {self.tokens} tokens")
        return "\n".join(lines)


def _note(err: TextIO, text: str) -> None:
    err.write(_dim(text, err) + "\n")
    err.flush()


def _awaiting(talk: _Conversation) -> str:
    waiting = talk.unanswered
    calls = f"{len(waiting)} tool call awaits" if len(waiting) == 1 else f"{len(waiting)} tool calls await"
    return f"{calls} a result: /result TEXT answers {waiting[0].name} [{waiting[0].id}]"


def _result(rest: str, talk: _Conversation, err: TextIO) -> tuple[ChatMessage, ...] | None:
    """``/result TEXT``: the messages to send once every call has its result (None until then)."""
    from .._sessions import ChatMessage

    waiting = talk.unanswered
    if not waiting:
        err.write("triton-npu chat: no tool call awaits a result (/result answers the calls of the last reply)\n")
        err.flush()
        return None
    talk.results.append(ChatMessage.tool_result(waiting[0], rest))
    if talk.unanswered:
        _note(err, f"[result of {waiting[0].name} [{waiting[0].id}] kept; {_awaiting(talk)}]")
        return None
    return tuple(talk.results)


async def _command(line: str, talk: _Conversation, err: TextIO) -> bool | tuple[ChatMessage, ...]:
    """Run the command ``line`` (it starts with /); False for /quit; the messages to send for the last /result."""
    name, _, rest = line.strip().partition(" ")
    rest = rest.strip()
    if name in ("/quit", "/exit"):
        return False
    if name == "/help":
        _note(err, _HELP)
    elif name == "/reset":
        await talk.restart(talk.system)
        _note(err, "[new conversation]")
    elif name == "/system":
        if not rest:
            _note(err, f"[system message: {talk.system!r}]" if talk.system is not None else "[no system message]")
        else:
            await talk.restart(rest)
            _note(err, "[new conversation with this system message]")
    elif name == "/stats":
        _note(err, talk.stats())
    elif name == "/result":
        results = _result(rest, talk, err)
        if results is not None:
            return results
    else:
        err.write(f"triton-npu chat: unknown command {name!r}: /help lists the commands (// sends a line "
                  "beginning with /)\n")  # fmt: skip
        err.flush()
    return True


async def _repl(talk: _Conversation, keys: _Keys, out: TextIO, err: TextIO, *, prompt: bool) -> int:
    while True:
        if prompt:
            err.write(_PROMPT)
            err.flush()
        keys.at_prompt = True
        try:
            line = await keys.lines.get()
        finally:
            keys.at_prompt = False
        if keys.interrupted or line is _INTERRUPT:
            err.write("\n")
            return EXIT_INTERRUPTED
        if line is None:
            if prompt:
                err.write("\n")
            return 0
        assert isinstance(line, str)
        if not line.strip():
            continue
        message: str | tuple[ChatMessage, ...] = line
        if line.startswith("//"):
            message = line[1:]
        elif line.startswith("/"):
            done = await _command(line, talk, err)
            if done is False:
                return 0
            if done is True:
                continue
            message = done
        if isinstance(message, str) and talk.unanswered:
            # The model waits for its calls' results: a user message now would leave them unanswered.
            err.write(f"triton-npu chat: {_awaiting(talk)} (or /reset)\n")
            err.flush()
            continue
        chat = talk.chat
        keys.turn = asyncio.get_running_loop().create_task(_turn(chat, message, out))
        try:
            await asyncio.wait([keys.turn])
        finally:
            turn, keys.turn = keys.turn, None
        if turn.cancelled() or turn.exception() is not None:
            talk.results = []  # not sent after all: the calls wait for their results again
        if turn.cancelled():
            out.write("\n")
            out.flush()
            _note(err, "[turn cancelled: dropped from the history]")
            continue
        error = turn.exception()
        if error is None:
            out.write("\n")
            out.flush()
            talk.record(turn.result())
            _note(err, _stats(turn.result()))
            if talk.unanswered:
                _note(err, f"[{_awaiting(talk)}]")
            continue
        out.write("\n")
        out.flush()
        if isinstance(error, TritonError) and chat.is_open:
            err.write(f"triton-npu chat: {error}\n")
            err.flush()
            continue
        raise error


def _shown(url: str | tuple[str, ...]) -> str:
    return url if isinstance(url, str) else ", ".join(url)


async def _chat_models(client: Client) -> list[str]:
    """The READY models of the server that have a chat model's shape (decoupled, sequence batching, ROLE and TEXT
    in, PIECE and FINISH out): what a user who named a missing one may have meant."""
    found: set[str] = set()
    for entry in await client.repository_index():
        if entry.state != "READY" or entry.name in found:
            continue
        try:
            spec = (await client.model(entry.name)).spec
        except TritonError:
            continue  # unloaded meanwhile: not there after all
        names_in = {t.name for t in spec.inputs}
        names_out = {t.name for t in spec.outputs}
        chat_like = {"ROLE", "TEXT"} <= names_in and {"PIECE", "FINISH"} <= names_out
        if spec.decoupled and spec.sequence is not None and chat_like:
            found.add(entry.name)
    return sorted(found)


async def _session(ns: argparse.Namespace, keys: _Keys, out: TextIO, err: TextIO) -> int:
    from .._client import Client
    from .._sessions import ChatOptions

    # Checked first: a bad option must not wait for an embedded server to start.
    if ns.tool_choice is not None and ns.tools is None:
        raise UsageError("--tool-choice says how the model uses its tools: it needs --tools FILE")
    options: dict[str, Any] = {
        "max_tokens": ns.max_tokens, "min_tokens": ns.min_tokens, "temperature": ns.temperature, "top_p": ns.top_p,
        "top_k": ns.top_k, "seed": ns.seed, "stop": ns.stop,
        "tools": None if ns.tools is None else _read_tools(ns.tools), "tool_choice": _tool_choice(ns.tool_choice),
    }  # fmt: skip
    ChatOptions(**options).check_turn()
    urls = checked_urls(ns.url)
    generated = checkpoint_repository(ns, CHECKPOINT_FLAG, prefix=f"triton-npu-chat-{os.getpid()}-")
    if generated is not None and urls is not None:
        raise UsageError("--checkpoint serves the checkpoint on an embedded server: it cannot go with --url")
    if generated is not None and ns.model is not None:
        raise UsageError("--model names a model the server has: with --checkpoint, name the new one with --name")
    model: str = ns.model or "chat"
    async with contextlib.AsyncExitStack() as stack:
        url: str | tuple[str, ...] | None = urls
        if generated is not None:
            # On the loop's thread, like the copy below; the checkpoint is checked before the folder is made.
            repository, model = stack.enter_context(generated)
            err.write(f"starting tritonserver for model {model!r} (checkpoint {ns.checkpoint}) ...\n")
            err.flush()
            # The generated config is complete: Triton's auto-complete pass would only start one more stub.
            server = await stack.enter_async_context(
                LocalTriton(repository, startup_timeout_s=ns.startup_timeout, auto_complete_config=False)
            )
            url = server.grpc_url
        elif url is None:
            packaged = default_model_repository() / model
            if not (packaged / "config.pbtxt").is_file():
                raise UsageError(f"no model {model!r} among the packaged server models: pass --url")
            # A repository holding only this model: the server starts much sooner than on every packaged model.
            folder = tempfile.TemporaryDirectory(prefix=f"triton-npu-chat-{os.getpid()}-")
            repository = Path(stack.enter_context(folder))
            # On the loop's thread on purpose: nothing else runs yet, and a copy in a worker thread could outlive
            # a Ctrl-C and write into the folder as it is removed.
            shutil.copytree(packaged, repository / model)
            err.write(f"starting tritonserver for model {model!r} ...\n")
            err.flush()
            server = await stack.enter_async_context(
                LocalTriton(repository, startup_timeout_s=ns.startup_timeout)
            )  # fmt: skip
            url = server.grpc_url
        client = await stack.enter_async_context(Client(url, timeout_s=30.0))

        def open_chat(system: str | None) -> ChatSession:
            # No deadline on a turn: an interactive reply ends when the model stops or Ctrl-C cancels it.
            return client.chat(model, system=system, timeout_s=None, **options)

        talk = _Conversation(open_chat, ns.system)
        stack.push_async_callback(talk.aclose)
        # Opening the chat fetches the model's config: a wrong URL or model is reported before the first prompt.
        try:
            await talk.begin()
        except ModelNotFoundError:
            there = await _chat_models(client)
            found = f"chat models here: {', '.join(there)} (pass --model NAME)" if there else "no chat model here"
            raise UsageError(f"model {model!r} not found at {_shown(url)}; {found}") from None
        err.write(f"chatting with model {model!r} at {_shown(url)}: /help lists the commands, /quit or Ctrl-D "
                  "leaves\n")  # fmt: skip
        err.flush()
        reader = threading.Thread(
            target=_read_lines,
            args=(sys.stdin.fileno(), asyncio.get_running_loop(), keys.lines),
            name="triton-npu-chat-stdin",
            daemon=True,
        )
        reader.start()
        code = await _repl(talk, keys, out, err, prompt=sys.stdin.isatty())
    return code


async def _main(ns: argparse.Namespace) -> int:
    loop = asyncio.get_running_loop()
    main = asyncio.current_task()
    assert main is not None
    keys = _Keys(main, asyncio.Queue())
    loop.add_signal_handler(signal.SIGINT, keys.on_sigint)
    try:
        return await _session(ns, keys, sys.stdout, sys.stderr)
    except asyncio.CancelledError:
        # Ctrl-C before the prompt (starting the server, connecting): everything above has been closed.
        sys.stderr.write("\n")
        return EXIT_INTERRUPTED
    finally:
        loop.remove_signal_handler(signal.SIGINT)


def run(ns: argparse.Namespace) -> int:
    """``triton-npu chat``: see the module docstring."""
    for stream in (sys.stdout, sys.stderr):
        # Whatever the terminal's encoding, a reply never crashes the command.
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(errors="replace")
    return asyncio.run(_main(ns))
