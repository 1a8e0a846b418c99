"""bench/chat.py's peer: llama.cpp's ``llama-server`` on the same checkpoint, side by side with our ``chat`` model.

``bench/chat.py --peer llama-server=PATH [--threads 1,2]`` calls :func:`compare` after its own tables. Nothing here
is imported by the package or the test suite's servers; llama.cpp is never needed to run the tests (the suite tests
only the pure functions: :func:`parse_peer`, :func:`parse_threads`, :func:`converter_command` (and the shim, on a
fake converter tree), :func:`server_command`, :func:`fit`, :func:`agreeing`, :func:`goals`, :func:`table`).

What it does, per ``--threads`` value N:

1. **The same checkpoint as GGUF.** The checkpoint folder (``--llama``'s random Llama, written again from the same
   seed, or ``--checkpoint``, or the GPT-2 demo) is converted once with llama.cpp's own converter,
   ``convert_hf_to_gguf.py --outtype f32``, found beside the llama-server binary (in the source tree it was built
   in). That converter refuses a byte-level BPE whose pre-tokenizer hash it does not know, and ours is random: it
   is run through :data:`_SHIM`, which wraps the converter's ``TextModel.get_vocab_base_pre`` at run time so that
   an *unrecognised* hash maps to ``gpt-2`` (the GPT-2 regex our ByteLevel pre-tokenizer uses); a known one is left
   as the converter decides. The converter's files are not copied or changed.
2. **Both servers at once.** Our ``chat`` and ``chat_stateless`` (bench/chat.py's ``checkpoint_repository``, with
   ``cpu_threads`` N in both configs) on a LocalTriton, and ``llama-server --parallel <--chats> --ctx-size
   <--chats * 1280> --cont-batching --threads N --threads-batch N`` on 127.0.0.1 (a free port), each
   conversation's context as our ``max_ctx`` (1,280), its KV cache float32 as ours (llama.cpp's default is f16),
   the rest its defaults. Both keep what they computed: ours registers a conversation's full 16-position blocks
   under their token prefix and keeps them after the conversation ends (until the memory is wanted); llama.cpp
   keeps a slot's cache, ``cache_prompt`` reuses its longest common prefix with a prompt, and its host-memory
   prompt cache gives back a slot it gave up when a prompt would keep less than half of the slot. A first turn
   whose system prompt an earlier conversation had is then partly computed on ours (all but the blocks of the
   system prompt), and on llama.cpp as far as its caches reach: the report says how many positions each computed.
3. **The same work.** Every prompt llama-server gets is the list of token ids our own chat template and tokenizer
   render for the conversation (``CheckpointTokenizer.render``), so both prefill the same positions; replies are
   greedy (``temperature`` 0, only the ``top_k`` 1 sampler), exactly ``--tokens`` long (``n_predict`` with
   ``ignore_eos``, and our end-of-turn ids biased off as our MIN_TOKENS masks them). A reply goes into the next
   turn's messages as our server keeps its own (its bytes, decoded with errors="replace"), and the whole
   conversation is rendered again, as our server renders it. Each round's conversations are new ones (the
   questions rotated: see ``compare_at``), so neither cache holds one from an earlier round.
4. **The measurements**, each a mirror of what bench/chat.py measures on ours (and, for ours, that very function),
   medians of ``--repeats`` rounds, the contenders alternating which goes first, measurement by measurement:

   - one conversation's ms per token (``per_token_latency``, 16 tokens of history: the time between the first and
     the last token seen by the client over the steps between) and its tokens/s (``aggregate`` with one
     conversation: generated tokens over the turn's wall time);
   - TTFT of a short first turn (``ttft_at_turn`` with one turn: its system prompt and first question, the same
     every round; llama.cpp: slot 0, whatever it held);
   - TTFT at turn ``--turns`` with the history kept (``ttft_at_turn``'s kept conversation; llama.cpp: the same
     slot pinned with ``id_slot`` every turn, ``cache_prompt`` true, so only what differs from the slot's cache is
     computed);
   - ``--chats`` conversations' tokens/s (``aggregate``: each opened with a one-token first turn, then all generate
     ``--tokens`` tokens at once, slot i for conversation i), and the server's CPU seconds per 1,000 of those
     tokens, from /proc/<pid>/stat: ours the Python stub plus tritonserver, llama.cpp the llama-server process.

   Before the rounds, one greedy reply on each (16 tokens to the same prompt) says how many leading tokens agree:
   a check that the GGUF computes what the checkpoint does.

Every process started here (the converter, llama-server, our server) is stopped on the way out, on an exception
or Ctrl-C too. Only 127.0.0.1 is contacted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import attrs

PEER_KINDS = ("llama-server",)
CONVERTER = "convert_hf_to_gguf.py"
#: The pre-tokenizer an unrecognised byte-level BPE is registered as: llama.cpp's name for the GPT-2 regex, which is
#: what a Hugging Face ByteLevel pre-tokenizer with use_regex (every checkpoint tests/_checkpoints.py writes) applies.
PRE_TOKENIZER = "gpt-2"
#: The conversation's context on both sides: bench/chat.py's MAX_CTX, the served `chat` model's max_ctx.
CTX_PER_CONVERSATION = 1280
#: llama-server's KV cache element type: float32, as our CPU instance holds its cache (llama.cpp's default is f16).
KV_TYPE = "f32"
#: bench/chat.py's ttft_at_turn's system message (its conversation is mirrored message for message).
SYSTEM = "You are Emma Woodhouse, answering a friend at Hartfield."
AGREE_TOKENS = 16
START_TIMEOUT_S = 300.0

# Run as ``python -c _SHIM CONVERTER PRE_TOKENIZER ARGS...``: the converter, with its pre-tokenizer lookup wrapped so
# that an unrecognised hash (the lookup raises NotImplementedError) becomes PRE_TOKENIZER. Its own gguf-py must come
# first on PYTHONPATH (converter_env), since conversion.base imports gguf before the script would put it there.
_SHIM = """\
import os, runpy, sys
converter, name = sys.argv[1], sys.argv[2]
sys.argv = [converter, *sys.argv[3:]]
sys.path.insert(0, os.path.dirname(converter))
from conversion.base import TextModel
known = TextModel.get_vocab_base_pre
def get_vocab_base_pre(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError as err:
        if "pre-tokenizer was not recognized" not in str(err):
            raise
        print(f"bench/peer_llamacpp.py: unrecognised pre-tokenizer registered as {name!r}", file=sys.stderr)
        return name
TextModel.get_vocab_base_pre = get_vocab_base_pre
runpy.run_path(converter, run_name="__main__")
"""


# -- the command line ------------------------------------------------------------------------------------------


@attrs.frozen
class Peer:
    kind: str
    path: Path


def parse_peer(value: str) -> Peer:
    """``llama-server=PATH`` -> Peer (the path made absolute; not checked here: the run says if it is missing)."""
    kind, sep, path = value.partition("=")
    if kind not in PEER_KINDS or not sep or not path.strip():
        raise argparse.ArgumentTypeError(f"expected {' or '.join(k + '=PATH' for k in PEER_KINDS)}, got {value!r}")
    return Peer(kind, Path(path).expanduser().resolve())


def parse_threads(value: str) -> tuple[int, ...]:
    """``1,2`` -> (1, 2): the thread counts the comparison runs at, each a positive integer, none twice."""
    try:
        counts = tuple(int(part) for part in value.split(","))
    except ValueError:
        counts = ()
    if not counts or any(n < 1 for n in counts) or len(set(counts)) != len(counts):
        raise argparse.ArgumentTypeError(f"expected positive thread counts separated by commas, got {value!r}")
    return counts


# -- the GGUF --------------------------------------------------------------------------------------------------


def find_converter(server: Path) -> Path:
    """llama.cpp's convert_hf_to_gguf.py in a folder above the llama-server binary (its source tree's build/bin)."""
    for folder in server.resolve().parents:
        if (folder / CONVERTER).is_file() and (folder / "gguf-py").is_dir():
            return folder / CONVERTER
    raise FileNotFoundError(f"no {CONVERTER} (and gguf-py) in a folder above {server}: build llama-server in its tree")


def converter_command(
    converter: Path,
    checkpoint: Path,
    outfile: Path,
    *,
    python: str = sys.executable,
    pre_tokenizer: str = PRE_TOKENIZER,
) -> list[str]:
    """The command converting ``checkpoint`` to a float32 GGUF at ``outfile`` with llama.cpp's converter."""
    return [
        python, "-c", _SHIM, str(converter), pre_tokenizer,
        str(checkpoint), "--outtype", "f32", "--outfile", str(outfile),
    ]  # fmt: skip


def converter_env(converter: Path, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment: the converter's own gguf-py first on PYTHONPATH, then whatever PYTHONPATH was (where, say,
    sentencepiece is: the converter imports it even for a tokenizer.json checkpoint)."""
    env = dict(os.environ if environ is None else environ)
    paths = [str(converter.parent / "gguf-py"), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


async def convert(converter: Path, checkpoint: Path, outfile: Path) -> Path:
    """Convert ``checkpoint`` to ``outfile`` (GGUF, float32); RuntimeError with the converter's output if it fails."""
    proc = await asyncio.create_subprocess_exec(
        *converter_command(converter, checkpoint, outfile), env=converter_env(converter),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    try:
        out, _ = await proc.communicate()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    if proc.returncode != 0 or not outfile.is_file():  # noqa: ASYNC240  (one stat, after the converter is done)
        raise RuntimeError(f"{converter} failed ({proc.returncode}):\n{out.decode(errors='replace')[-3000:]}")
    return outfile


# -- llama-server ----------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def server_command(
    binary: Path, gguf: Path, *, port: int, slots: int, threads: int, no_webui: bool = True
) -> list[str]:
    """llama-server serving ``gguf`` on 127.0.0.1:``port`` with ``slots`` slots of CTX_PER_CONVERSATION positions;
    everything else its defaults (prompt caching on, its host-memory prompt cache too: ours keeps freed prefix
    blocks registered, and a server of either kind reuses what it computed)."""
    command = [
        str(binary), "--model", str(gguf), "--host", "127.0.0.1", "--port", str(port),
        "--parallel", str(slots), "--ctx-size", str(slots * CTX_PER_CONVERSATION), "--cont-batching",
        "--threads", str(threads), "--threads-batch", str(threads),
        "--cache-type-k", KV_TYPE, "--cache-type-v", KV_TYPE,
    ]  # fmt: skip
    return [*command, "--no-webui"] if no_webui else command


@attrs.frozen
class PeerTurn:
    tokens: int  # tokens generated (its tokens_predicted)
    ttft_s: float  # request to the first token (see LlamaServer.complete)
    first_to_last_s: float  # the first token to the last
    prompt_n: int  # positions llama-server computed for the prompt (its timings.prompt_n)


class LlamaServer:
    """llama-server as an async context manager: started on a free loopback port, ready when /health says so,
    stopped (SIGTERM, then SIGKILL after 10 s) on the way out."""

    def __init__(self, binary: Path, gguf: Path, *, slots: int, threads: int, log: Path) -> None:
        self.binary, self.gguf, self.slots, self.threads, self.log = binary, gguf, slots, threads, log
        self.port = 0
        self.proc: asyncio.subprocess.Process | None = None
        self._session: Any = None
        self._stop_ids: list[int] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    async def __aenter__(self) -> LlamaServer:
        import aiohttp  # tritonclient[http]'s own dependency: nothing new for the package

        help_text = await _output(str(self.binary), "--help")
        self.port = free_port()
        command = server_command(
            self.binary, self.gguf, port=self.port, slots=self.slots, threads=self.threads,
            no_webui="--no-webui" in help_text,
        )  # fmt: skip
        # If this process dies without its finally blocks (SIGKILL), the kernel kills llama-server too: setpriv
        # execs it with a parent-death signal (the main thread forks it: the signal follows the forking thread).
        setpriv = shutil.which("setpriv")
        if setpriv is not None and threading.current_thread() is threading.main_thread():
            command = [setpriv, "--pdeathsig", "KILL", "--", *command]
        with self.log.open("wb") as log:
            self.proc = await asyncio.create_subprocess_exec(
                *command, stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=asyncio.subprocess.STDOUT
            )
        try:
            # A connection per request: llama-server closes a connection after a streamed response (while its
            # headers say keep-alive), and a POST on a pooled connection it closed fails. Loopback: ~0.1 ms.
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(force_close=True), timeout=aiohttp.ClientTimeout(total=None)
            )
            await self._ready()
        except BaseException:
            await self.__aexit__(None, None, None)
            raise
        return self

    async def _ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.returncode is not None:
                raise RuntimeError(f"llama-server exited ({self.proc.returncode}):\n{self._log_tail()}")
            with contextlib.suppress(OSError):
                async with self._session.get(f"{self.url}/health") as resp:
                    if resp.status == 200:
                        return
            await asyncio.sleep(0.2)
        raise RuntimeError(f"llama-server not ready in {START_TIMEOUT_S:.0f} s:\n{self._log_tail()}")

    def _log_tail(self) -> str:
        with contextlib.suppress(OSError):
            return self.log.read_text(errors="replace")[-3000:]
        return ""

    async def __aexit__(self, *exc: object) -> None:
        try:
            if self._session is not None:
                await self._session.close()
        finally:
            proc, self.proc = self.proc, None
            if proc is not None and proc.returncode is None:
                proc.terminate()
                try:
                    await asyncio.wait_for(proc.wait(), 10)
                except TimeoutError:
                    pass
                finally:
                    if proc.returncode is None:  # it would not stop, or we were cancelled while it stopped
                        proc.kill()
                        await proc.wait()

    def stop_ids(self, ids: Sequence[int]) -> None:
        """The ids biased off every reply (ours' end-of-turn ids, which our MIN_TOKENS masks)."""
        self._stop_ids = sorted(ids)

    def _payload(self, prompt: Sequence[int], tokens: int, slot: int, *, stream: bool) -> dict[str, Any]:
        """A greedy completion of exactly ``tokens`` tokens of the token-id ``prompt`` in ``slot``, its cache kept."""
        return {
            "prompt": list(prompt), "n_predict": tokens, "ignore_eos": True, "temperature": 0.0,
            "samplers": ["top_k"], "top_k": 1, "logit_bias": [[i, False] for i in self._stop_ids],
            "cache_prompt": True, "id_slot": slot, "stream": stream, "return_tokens": not stream,
        }  # fmt: skip

    async def complete(self, prompt: Sequence[int], tokens: int, slot: int) -> PeerTurn:
        """The completion streamed, timed as bench/chat.py's ``timed`` times ours: the first token, the last.

        A token whose bytes end inside a UTF-8 character gets no event of its own (llama-server sends its text with
        the next token's), so each event's tokens_predicted says which token it is: the decode steps are timed from
        the first event to the final one (sent as the last token is done), over the tokens between, and when the
        first event is token k > 1, the first token is taken to have come k - 1 steps before it, at that rate."""
        start = time.perf_counter()
        first = end = None
        first_token = 0
        event: dict[str, Any] = {}
        async with self._session.post(
            f"{self.url}/completion", json=self._payload(prompt, tokens, slot, stream=True)
        ) as resp:
            if resp.status != 200:
                raise RuntimeError(f"llama-server /completion: {resp.status} {await resp.text()}")
            # Server-sent events, split here (a line reader has a length limit, and the last event holds the prompt).
            pending = b""
            async for chunk in resp.content.iter_any():
                now = time.perf_counter()
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    if not line.startswith(b"data: "):
                        continue  # the blank lines between events
                    event = json.loads(line[6:])
                    if "error" in event:
                        raise RuntimeError(f"llama-server /completion: {event['error']}")
                    if first is None:
                        first, first_token = now, int(event.get("tokens_predicted", 1))
                    end = now
        made = int(event.get("tokens_predicted", -1))
        if first is None or end is None or not event.get("stop") or made != tokens:
            raise RuntimeError(f"llama-server made {made} tokens, not {tokens}: {event}")
        step = (end - first) / max(made - first_token, 1)
        return PeerTurn(
            tokens=made, ttft_s=first - start - (first_token - 1) * step,
            first_to_last_s=(end - first) + (first_token - 1) * step,
            prompt_n=int(event.get("timings", {}).get("prompt_n", -1)),
        )  # fmt: skip

    async def complete_ids(self, prompt: Sequence[int], tokens: int, slot: int) -> tuple[list[int], int]:
        """The same completion, not streamed: (every generated id, positions computed for the prompt)."""
        async with self._session.post(
            f"{self.url}/completion", json=self._payload(prompt, tokens, slot, stream=False)
        ) as resp:
            if resp.status != 200:
                raise RuntimeError(f"llama-server /completion: {resp.status} {await resp.text()}")
            body = await resp.json()
        return [int(i) for i in body["tokens"]], int(body.get("timings", {}).get("prompt_n", -1))


async def _output(*command: str) -> str:
    proc = await asyncio.create_subprocess_exec(
        *command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    out, _ = await proc.communicate()
    return out.decode(errors="replace")


def cpu_s(pid: int) -> float:
    """utime + stime of process ``pid`` (all its threads), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# -- the peer's measurements: bench/chat.py's, mirrored --------------------------------------------------------


Messages = list[tuple[str, str]]
# What a prompt plus its reply may fill of a slot: llama-server ends a reply once the slot's cache is one position
# short of its context (ours fills max_ctx), so one position less, or its last token would be cut.
_FIT = CTX_PER_CONVERSATION - 1


def fit(messages: Messages, tokens: int, render: Callable[[Messages], Sequence[int]], ctx: int) -> Messages:
    """``messages`` with the fewest oldest ones dropped for its prompt plus ``tokens`` to fit ``ctx``, as our server
    makes room (docs/chat.md, "Context overflow"): the leading system messages stay, and what remains starts at a
    user message. llama-server would refuse the turn instead (its slot is ``ctx`` positions, as our max_ctx)."""
    lead = next((i for i, (role, _) in enumerate(messages) if role != "system"), len(messages))
    for cut in range(lead, len(messages)):
        if cut > lead and messages[cut][0] != "user":
            continue
        kept = [*messages[:lead], *messages[cut:]]
        if len(render(kept)) + tokens <= ctx:
            return kept
    raise RuntimeError(f"the system messages and the last user message with {tokens} tokens do not fit {ctx}")


class PeerSide:
    """The measurements on llama-server, each the mirror of bench/chat.py's function of the same name.

    A turn that is timed is streamed; one whose reply only goes into the history (an opening, the turns before the
    measured one) is not, since only then does llama-server return every generated id (a streamed event carries
    its own token's, and none for a token held back inside a character). The reply goes into the history as our
    server keeps its own: the reply's bytes (our tokenizer's) decoded with errors="replace", so a gibberish reply
    of the random weights re-renders on both sides alike (a reply whose bytes are not valid UTF-8 does not render
    back to the ids generated, and then both rewind to it)."""

    def __init__(self, server: LlamaServer, tokenizer: Any, text_of_tokens: Callable[[int], str], questions: list[str]):
        self.server, self.tok, self.text_of_tokens, self.questions = server, tokenizer, text_of_tokens, questions
        server.stop_ids(tokenizer.stop_ids)
        self.computed: list[int] = []  # positions computed for each turn's prompt, the last ttft_at_turn's

    def render(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        return list(self.tok.render(messages, add_generation_prompt=True))

    async def say(self, messages: Messages, tokens: int, slot: int) -> str:
        """An untimed turn: the reply as text, as our server keeps it in the history."""
        ids, computed = await self.server.complete_ids(self.render(messages), tokens, slot)
        self.computed.append(computed)
        return bytes(self.tok.decode(ids)).decode("utf-8", errors="replace")

    async def per_token_latency(self, history_tokens: int, tokens: int) -> float:
        opening: Messages = [("user", self.text_of_tokens(history_tokens - 4))]
        reply = await self.say(opening, 1, 0)
        turn = await self.server.complete(self.render([*opening, ("assistant", reply), ("user", "Go on.")]), tokens, 0)
        return turn.first_to_last_s / max(turn.tokens - 1, 1)

    async def ttft_at_turn(self, turns: int, tokens: int) -> tuple[float, int]:
        """(TTFT of the last turn, positions llama-server computed for its prompt)."""
        history: Messages = [("system", SYSTEM)]
        self.computed = []
        for i in range(turns - 1):
            history.append(("user", self.questions[i % len(self.questions)]))
            history = fit(history, tokens, self.render, _FIT)
            history.append(("assistant", await self.say(history, tokens, 0)))
        history.append(("user", self.questions[(turns - 1) % len(self.questions)]))
        history = fit(history, tokens, self.render, _FIT)
        turn = await self.server.complete(self.render(history), tokens, 0)
        self.computed.append(turn.prompt_n)
        return turn.ttft_s, turn.prompt_n

    async def aggregate(self, chats: int, tokens: int) -> tuple[float, float, int]:
        """(tokens/s, llama-server CPU seconds, tokens) of ``chats`` conversations generating at once."""
        openings = []
        for i in range(chats):
            opening: Messages = [("user", self.questions[i % len(self.questions)])]
            reply = await self.say(opening, 1, i)
            openings.append([*opening, ("assistant", reply), ("user", "Go on.")])
        before = cpu_s(self.server.pid)
        start = time.perf_counter()
        turns = await asyncio.gather(
            *(self.server.complete(self.render(msgs), tokens, i) for i, msgs in enumerate(openings))
        )
        wall = time.perf_counter() - start
        generated = sum(t.tokens for t in turns)
        return generated / wall, cpu_s(self.server.pid) - before, generated


# -- the comparison --------------------------------------------------------------------------------------------


@attrs.define
class Side:
    """One contender's figures, a value per round."""

    ms_per_token: list[float] = attrs.Factory(list)
    one_tokens_per_s: list[float] = attrs.Factory(list)
    ttft_first_ms: list[float] = attrs.Factory(list)
    ttft_turn_ms: list[float] = attrs.Factory(list)
    many_tokens_per_s: list[float] = attrs.Factory(list)
    cpu_per_1k: list[float] = attrs.Factory(list)  # server CPU seconds per 1,000 tokens at --chats


@attrs.define
class Comparison:
    threads: int
    ours: Side = attrs.Factory(Side)
    peer: Side = attrs.Factory(Side)
    agree: tuple[int, int] = (0, 0)  # (leading tokens of the greedy reply that agree, tokens compared)
    # Positions each side computed, (ours, llama.cpp), for one more new conversation played after the rounds as
    # theirs are: "first" its first turn (the short first turn's prompt), "turn" its last turn.
    computed: dict[str, tuple[int, int]] = attrs.Factory(dict)


@attrs.frozen
class Goals:
    latency: float  # ours / llama.cpp at most: per-token latency and both TTFTs
    throughput: float  # ours / llama.cpp at least: --chats conversations' tokens/s


def goals(shape: str | None, threads: int) -> Goals:
    """Issue 23's goals: per-token latency and TTFT at most 1.0x llama.cpp's on SmolLM2-135M's shape (and any real
    checkpoint: ``shape`` None), 1.5x on the tiny ones (demo, tests, the GPT-2 demo: ``shape`` "gpt2-demo");
    --chats conversations' tokens/s at least 1.0x at two threads or more, 1.5x at one."""
    tiny = shape in ("demo", "tests", "gpt2-demo")
    return Goals(latency=1.5 if tiny else 1.0, throughput=1.5 if threads == 1 else 1.0)


def verdict(value: float, goal: float, *, at_most: bool) -> str:
    if value != value:  # NaN: a figure is missing
        return "NOT met"
    return "met" if (value <= goal if at_most else value >= goal) else "NOT met"


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def table(results: Sequence[Comparison], shape: str | None, chats: int, turns: int) -> str:
    """The side-by-side table (markdown): medians, the rounds in brackets, ours / llama.cpp, the goal, the verdict."""
    med = statistics.median
    lines = [
        "| threads | measurement | ours | llama.cpp | ours / llama.cpp | goal | verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    for res in results:
        goal = goals(shape, res.threads)
        rows: list[tuple[str, str, str, float | None, bool]] = [
            ("one conversation: ms per token", "ms_per_token", "{:.2f}", goal.latency, True),
            ("one conversation: tokens/s (whole turn)", "one_tokens_per_s", "{:.0f}", None, False),
            ("TTFT, a short first turn (ms)", "ttft_first_ms", "{:.1f}", goal.latency, True),
            (f"TTFT at turn {turns}, history kept (ms)", "ttft_turn_ms", "{:.1f}", goal.latency, True),
            (f"{chats} conversations: tokens/s", "many_tokens_per_s", "{:.0f}", goal.throughput, False),
            (f"{chats} conversations: server CPU-s per 1,000 tokens", "cpu_per_1k", "{:.2f}", None, True),
        ]
        for title, field, fmt, target, at_most in rows:
            ours, peer = getattr(res.ours, field), getattr(res.peer, field)
            if not ours or not peer:
                continue
            r = _ratio(med(ours), med(peer))

            def cell(values: list[float], fmt: str = fmt) -> str:
                return f"{fmt.format(med(values))} ({', '.join(fmt.format(v) for v in values)})"

            judged = ("-", "-") if target is None else (
                f"{'<=' if at_most else '>='} {target:.1f}x", verdict(r, target, at_most=at_most)
            )  # fmt: skip
            lines.append(
                f"| {res.threads} | {title} | {cell(ours)} | {cell(peer)} | **{r:.2f}x** | {judged[0]} | {judged[1]} |"
            )
    return "\n".join(lines)


def checkpoint_for(args: argparse.Namespace, bench: ModuleType, work: Path) -> tuple[Path, str | None, str]:
    """(checkpoint folder, shape for the goals, words) of what bench/chat.py measured: its random Llama is written
    again (same shape, same seed: the same files) since bench/chat.py's own copy went with its server."""
    if args.checkpoint is not None:
        return Path(args.checkpoint), None, str(args.checkpoint)
    if args.llama:
        import chat_cache  # bench/chat_cache.py

        shape = args.llama_shape
        folder = chat_cache.write_tiny_llama(work / "llama", shape)
        words = f"a random Llama of bench/chat_cache.py's {shape!r} shape ({chat_cache.describe_shape(shape)})"
        return folder, shape, words
    return Path(bench.CHECKPOINT), "gpt2-demo", "the GPT-2 demo (server_models/chat/demo_gpt2)"


async def _ours_computed(chat: Any, bench: ModuleType, turns: int, tokens: int) -> tuple[int, int]:
    """PROMPT_TOKENS (positions our server prefilled) of the first and the last turn of ttft_at_turn's conversation,
    played again (ttft_at_turn returns times only)."""
    history: Messages = [("system", SYSTEM)]
    computed: list[int] = []
    async with chat.sequence() as seq:
        for i in range(turns):
            question = ("user", bench.QUESTIONS[i % len(bench.QUESTIONS)])
            last: Any = None
            reply = b""
            new = [*history, question] if i == 0 else [question]
            async for last in seq.stream({**bench.messages(*new), **bench.fixed(tokens)}):
                reply += bytes(last["PIECE"][0, 0])
            computed.append(int(last["PROMPT_TOKENS"][0, 0]))
            history += [question, ("assistant", reply.decode("utf-8", errors="replace"))]
    return computed[0], computed[-1]


async def _ours_bytes(twin: Any, bench: ModuleType, question: str, tokens: int) -> bytes:
    reply = b""
    async for result in twin.stream({**bench.messages(("user", question)), **bench.fixed(tokens)}):
        reply += bytes(result["PIECE"][0, 0])
    return reply


def agreeing(ours: bytes, peer_ids: Sequence[int], decode: Callable[[Sequence[int]], bytes]) -> int:
    """How many leading tokens of the peer's reply spell a prefix of ours."""
    n = 0
    while n < len(peer_ids) and ours.startswith(bytes(decode(peer_ids[: n + 1]))):
        n += 1
    return n


async def compare_at(
    args: argparse.Namespace, bench: ModuleType, checkpoint: Path, gguf: Path, threads: int, work: Path
) -> Comparison:
    """Both servers at ``threads`` threads, ``args.repeats`` rounds of every measurement on each."""
    import chat_cache  # bench/chat_cache.py: set_parameters

    from triton_npu_client import Client, LocalTriton, Model
    from triton_npu_client.server import CheckpointTokenizer

    repository = bench.checkpoint_repository(work, checkpoint)
    for name in ("chat", "chat_stateless"):
        chat_cache.set_parameters(repository / name / "config.pbtxt", cpu_threads=str(threads))
    res = Comparison(threads)
    tokenizer = CheckpointTokenizer(checkpoint)
    async with contextlib.AsyncExitStack() as stack:
        server = await stack.enter_async_context(LocalTriton(repository))
        llama = await stack.enter_async_context(
            LlamaServer(args.peer.path, gguf, slots=args.chats, threads=threads, log=work / "llama-server.log")
        )
        procs = bench.Processes.find(server.grpc_url, "chat")
        peer = PeerSide(llama, tokenizer, bench.text_of_tokens, bench.QUESTIONS)

        @contextlib.asynccontextmanager
        async def ours() -> AsyncIterator[tuple[Model, Model]]:
            """(chat, twin) on a client of their own, its channel up (the config fetch) before anything is timed.

            A client per measurement: one left idle while llama-server works for minutes (SmolLM2's shape at one
            thread) had its connection closed by Triton with GOAWAY "too_many_pings" in mid-run."""
            async with Client(server.grpc_url, timeout_s=600) as client:
                yield await client.model("chat"), await client.model("chat_stateless")

        # Warm-ups (first calls pay lazy initialisation on both), then the agreement check.
        async with ours() as (chat, twin):
            await bench.per_token_latency(chat, 16, 8)
            await bench.ttft_at_turn(chat, twin, 2, 8)
            ours_reply = await _ours_bytes(twin, bench, bench.QUESTIONS[0], AGREE_TOKENS)
        await peer.per_token_latency(16, 8)
        await peer.ttft_at_turn(2, 8)
        peer_reply, _ = await llama.complete_ids(peer.render([("user", bench.QUESTIONS[0])]), AGREE_TOKENS, 0)
        res.agree = (agreeing(ours_reply, peer_reply, tokenizer.decode), AGREE_TOKENS)

        async def ours_round(kind: str) -> None:
            side = res.ours
            async with ours() as (chat, twin):
                if kind == "latency":
                    side.ms_per_token.append((await bench.per_token_latency(chat, 16, args.tokens))[0] * 1e3)
                    side.one_tokens_per_s.append((await bench.aggregate(chat, 1, args.tokens)).tokens_per_s)
                elif kind == "ttft":
                    side.ttft_first_ms.append((await bench.ttft_at_turn(chat, twin, 1, args.tokens))[0] * 1e3)
                    turn = await bench.ttft_at_turn(chat, twin, args.turns, args.tokens)
                    side.ttft_turn_ms.append(turn[0] * 1e3)
                else:
                    run = await bench.aggregate(chat, args.chats, args.tokens, procs=procs)
                    side.many_tokens_per_s.append(run.tokens_per_s)
                    if run.cpu:
                        side.cpu_per_1k.append((run.cpu["stub"] + run.cpu["tritonserver"]) / run.tokens * 1e3)

        async def peer_round(kind: str) -> None:
            side = res.peer
            if kind == "latency":
                side.ms_per_token.append(await peer.per_token_latency(16, args.tokens) * 1e3)
                side.one_tokens_per_s.append((await peer.aggregate(1, args.tokens))[0])
            elif kind == "ttft":
                side.ttft_first_ms.append((await peer.ttft_at_turn(1, args.tokens))[0] * 1e3)
                side.ttft_turn_ms.append((await peer.ttft_at_turn(args.turns, args.tokens))[0] * 1e3)
            else:
                rate, cpu, generated = await peer.aggregate(args.chats, args.tokens)
                side.many_tokens_per_s.append(rate)
                side.cpu_per_1k.append(cpu / generated * 1e3)

        def ask(offset: int) -> None:
            """Both sides' questions from ``offset`` on: each round's conversations are new ones. Greedy replies
            repeat, so a conversation played again would be found in either server's cache (ours keeps every full
            block under its token prefix; llama-server's host-memory cache keeps slots it gave up), and turn 10
            would time a cache hit instead of a kept history."""
            bench.QUESTIONS = peer.questions = [*questions[offset:], *questions[:offset]]

        questions = list(bench.QUESTIONS)
        try:
            for r in range(args.repeats):
                ask(r + 1)  # offset 0: the warm-up's
                for kind in ("latency", "ttft", "throughput"):
                    pair = (ours_round, peer_round) if r % 2 == 0 else (peer_round, ours_round)
                    for measure in pair:
                        await measure(kind)
                # The table comes at the end, after every thread count: say how far it is (stderr, not the report).
                print(f"peer: threads {threads}, round {r + 1} of {args.repeats} done", file=sys.stderr, flush=True)
            # The positions each side computes for one more new conversation, the same on both, untimed.
            ask(args.repeats + 1)
            async with ours() as (chat, _):
                ours_first, ours_turn = await _ours_computed(chat, bench, args.turns, args.tokens)
            await peer.ttft_at_turn(args.turns, args.tokens)
        finally:
            bench.QUESTIONS = peer.questions = questions
        res.computed = {"first": (ours_first, peer.computed[0]), "turn": (ours_turn, peer.computed[-1])}
    return res


async def compare(args: argparse.Namespace, bench: ModuleType) -> list[Comparison]:
    """Convert, serve and measure at every ``args.threads``; print the table. ``bench`` is bench/chat.py itself
    (its measurement functions, and its CHECKPOINT, which text_of_tokens reads: the compared one meanwhile)."""
    if args.peer.kind != "llama-server" or not args.peer.path.is_file():
        raise SystemExit(f"--peer: no llama-server at {args.peer.path}")
    converter = find_converter(args.peer.path)
    results: list[Comparison] = []
    measured = bench.CHECKPOINT
    shape: str | None = None
    try:
        with tempfile.TemporaryDirectory(prefix="bench-peer-") as tmp:
            work = Path(tmp)
            checkpoint, shape, words = checkpoint_for(args, bench, work)
            bench.CHECKPOINT = checkpoint
            started = time.perf_counter()
            gguf = await convert(converter, checkpoint, work / "model-f32.gguf")
            print(
                f"## The peer: llama.cpp's llama-server on the same checkpoint\n\nMeasured: {words}; GGUF float32 "
                f"by {converter} in {time.perf_counter() - started:.0f} s ({gguf.stat().st_size / 2**20:.0f} MiB); "
                f"llama-server {args.peer.path}.\n",
                flush=True,
            )
            for threads in args.threads:
                results.append(await compare_at(args, bench, checkpoint, gguf, threads, work / f"threads-{threads}"))
    finally:
        bench.CHECKPOINT = measured
        # What was measured is printed even when a later thread count failed (a run of the SmolLM2 shape is long).
        if results:
            print_results(args, results, shape)
    return results


def print_results(args: argparse.Namespace, results: Sequence[Comparison], shape: str | None) -> None:
    print(table(results, shape, args.chats, args.turns))
    print()
    for res in results:
        print(
            f"threads {res.threads}: greedy replies agree on the first {res.agree[0]} of {res.agree[1]} tokens "
            "(the same prompt on both)"
        )
        if res.computed:
            (ours_first, peer_first), (ours_turn, peer_turn) = res.computed["first"], res.computed["turn"]
            print(
                f"threads {res.threads}: positions computed for the measured prompt: first turn ours {ours_first}, "
                f"llama.cpp {peer_first}; turn {args.turns} ours {ours_turn}, llama.cpp {peer_turn}"
            )
    print(
        f"\nours: the `chat` model (cpu_threads = threads); llama.cpp: llama-server --threads N --threads-batch N "
        f"--parallel {args.chats}, KV cache {KV_TYPE}. Both: the same token ids in, {args.tokens}-token greedy "
        f"replies; medians of {args.repeats} rounds (rounds in brackets), contenders alternating. CPU: ours the "
        "Python stub plus tritonserver, llama.cpp the llama-server process, from /proc.\n"
    )
