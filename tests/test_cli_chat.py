"""`triton-npu chat` and examples/chat_concurrent.py as a user runs them: subprocesses against the session server.

The replies the command prints are compared with replies the SDK gets from the same server for the same
conversation (greedy, or sampled with the same seed), never with hard-coded text.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from triton_npu_client import ChatReply, Client, LocalTriton
from triton_npu_client._local._server import temp_folder_prefix

ROOT = Path(__file__).resolve().parent.parent
MODEL = "chat"
STATS = re.compile(r"^\[(\d+) tokens, [\d.]+ tokens/s, first token (\d+ ms|-)(, [^\]]+)?\]$", re.M)
# A safety net only: each wait below ends as soon as the output it waits for appears.
WAIT_S = 240.0


def chat_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "triton_npu_client", "chat", *args]


class Output:
    """A running command's stdout and stderr, read as they come (never by sleeping)."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        assert proc.stderr is not None
        self.proc = proc
        self.out = b""
        self.err = b""
        self._selector = selectors.DefaultSelector()
        self._selector.register(proc.stdout, selectors.EVENT_READ, "out")
        self._selector.register(proc.stderr, selectors.EVENT_READ, "err")

    def until(self, done: Callable[[Output], bool], what: str) -> None:
        """Read until ``done(self)``; fail (showing what came) if the command closes its output first."""
        deadline = time.monotonic() + WAIT_S
        while not done(self):
            left = deadline - time.monotonic()
            assert left > 0, f"no {what} in time: out={self.out!r} err={self.err!r}"
            assert self._selector.get_map(), f"output closed before {what}: out={self.out!r} err={self.err!r}"
            for key, _ in self._selector.select(left):
                data = os.read(key.fd, 65536)
                if not data:
                    self._selector.unregister(key.fileobj)
                elif key.data == "out":
                    self.out += data
                else:
                    self.err += data

    def finish(self) -> int:
        """Read to the end of both streams and return the exit status."""
        self.until(lambda o: not o._selector.get_map(), "end of output")
        return self.proc.wait(timeout=WAIT_S)

    def write(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line.encode())
        self.proc.stdin.flush()

    def close_input(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()


@contextlib.contextmanager
def running(*args: str) -> Iterator[Output]:
    with subprocess.Popen(
        chat_command(*args), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    ) as proc:
        try:
            yield Output(proc)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


async def sdk_replies(url: str, questions: list[str], **options: object) -> list[ChatReply]:
    """The replies a fresh chat gets for ``questions``, asked in order."""
    async with Client(url, timeout_s=120) as client, client.chat(MODEL, **options) as chat:  # type: ignore[arg-type]
        return [await chat.ask(q) for q in questions]


async def live_conversations(url: str) -> int:
    """Conversations the chat model holds, not counting the probe that asks."""
    async with Client(url) as client:
        model = await client.model(MODEL)
        async with model.sequence() as probe:
            results = [
                r async for r in probe.stream(ROLE=np.array(["user"], object), TEXT=np.array([b"hi"], object),
                                              MAX_TOKENS=np.array([1], np.int32))
            ]
    return int(results[-1]["LIVE"].reshape(-1)[0]) - 1


def test_piped_lines_get_their_replies(triton_server: LocalTriton) -> None:
    """Two piped lines: stdout holds exactly the two replies the SDK gets with the same options (sampled, seeded);
    one stats line each; EOF exits 0."""
    url = triton_server.grpc_url
    options = ["--url", url, "--system", "You are terse.", "--max-tokens", "12", "--temperature", "0.8", "--seed", "3"]
    live_before = asyncio.run(live_conversations(url))
    with running(*options) as cli:
        cli.write("Good morning.\n\nWhere is the garden?\n")  # the blank line is not a turn
        cli.close_input()
        code = cli.finish()
    assert code == 0, cli.err
    questions = ["Good morning.", "Where is the garden?"]
    expected = asyncio.run(sdk_replies(url, questions, system="You are terse.", max_tokens=12, temperature=0.8, seed=3))
    assert cli.out.decode() == "".join(f"{r.text}\n" for r in expected)
    stats = STATS.findall(cli.err.decode())
    assert [int(tokens) for tokens, _, _ in stats] == [r.tokens for r in expected]
    assert asyncio.run(live_conversations(url)) == live_before  # the conversation was ended on exit


def test_ctrl_c_cancels_the_streaming_turn_and_the_chat_goes_on(triton_server: LocalTriton) -> None:
    """Ctrl-C while a reply streams cancels that turn (reported, dropped from the history); the next line gets
    the reply a chat without the cancelled turn gets; EOF then exits 0."""
    url = triton_server.grpc_url
    long_question, next_question = "Tell me a very long story.", "What is your name?"
    # Every reply is 300 tokens long: the turn is still streaming when Ctrl-C comes after its first piece.
    lengths = {"min_tokens": 300, "max_tokens": 300}
    options = ["--url", url, "--min-tokens", "300", "--max-tokens", "300"]
    with running(*options) as cli:
        cli.write(long_question + "\n")
        cli.until(lambda o: len(o.out) > 0, "first piece of the reply")
        cli.proc.send_signal(signal.SIGINT)
        cli.until(lambda o: b"turn cancelled" in o.err, "cancellation notice")
        assert b"dropped from the history" in cli.err
        partial = cli.out.decode()
        cli.write(next_question + "\n")
        cli.until(lambda o: STATS.search(o.err.decode()) is not None, "stats line of the next turn")
        cli.close_input()
        code = cli.finish()
    assert code == 0, cli.err
    assert partial.endswith("\n")
    partial = partial[:-1]
    # What streamed before Ctrl-C is the start of the full reply, and not all of it.
    (long_reply,) = asyncio.run(sdk_replies(url, [long_question], **lengths))
    assert 0 < len(partial) < len(long_reply.text)
    assert long_reply.text.startswith(partial)
    # The server rolled the cancelled turn back: the next reply is what a chat without it gets.
    (expected,) = asyncio.run(sdk_replies(url, [next_question], **lengths))
    assert cli.out.decode() == f"{partial}\n{expected.text}\n"
    assert [int(tokens) for tokens, _, _ in STATS.findall(cli.err.decode())] == [300]


def test_ctrl_c_at_the_prompt_exits_130(triton_server: LocalTriton) -> None:
    """Ctrl-C while waiting for a line exits at once with 130 (input still open) and ends the conversation."""
    url = triton_server.grpc_url
    live_before = asyncio.run(live_conversations(url))
    with running("--url", url, "--max-tokens", "4") as cli:
        cli.write("Hello.\n")
        cli.until(lambda o: STATS.search(o.err.decode()) is not None, "stats line")
        cli.proc.send_signal(signal.SIGINT)
        code = cli.finish()
    assert code == 130
    assert b"Traceback" not in cli.err
    assert asyncio.run(live_conversations(url)) == live_before


def test_sdk_errors_become_one_line_and_exit_2(triton_server: LocalTriton) -> None:
    """An HTTP URL, an unknown model and a bad option: one clear line on stderr each, exit status 2."""
    cases = [
        (["--url", triton_server.http_url], "serves only over the gRPC stream"),
        (["--url", triton_server.grpc_url, "--model", "no_such_model"], "no_such_model"),
        # Refused before any server would start (no --url).
        (["--max-tokens", "0"], "chat option 'max_tokens': expected an int >= 1, given 0"),
    ]
    for args, needle in cases:
        done = subprocess.run(chat_command(*args), input=b"Hello.\n", capture_output=True, timeout=WAIT_S)
        err = done.stderr.decode()
        assert done.returncode == 2, err
        assert err.startswith("triton-npu chat: ")
        assert needle in err
        assert err.count("\n") == 1
        assert done.stdout == b""


def test_without_url_an_embedded_server_serves_the_chat(triton_server: LocalTriton, tmp_path: Path) -> None:
    """No --url: the command starts its own server on the packaged chat model, answers, stops it, cleans up."""
    with subprocess.Popen(
        chat_command("--max-tokens", "8"),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path,
    ) as proc:
        try:
            out, err = proc.communicate(b"Good morning.\n", timeout=WAIT_S)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert proc.returncode == 0, err[-3000:]
    assert b"starting tritonserver" in err
    (expected,) = asyncio.run(sdk_replies(triton_server.grpc_url, ["Good morning."], max_tokens=8))
    assert out.decode() == expected.text + "\n"
    prefixes = (temp_folder_prefix(proc.pid), f"triton-npu-chat-{proc.pid}-")
    assert [p.name for p in Path(tempfile.gettempdir()).iterdir() if p.name.startswith(prefixes)] == []


def test_chat_concurrent_example(triton_server: LocalTriton) -> None:
    """examples/chat_concurrent.py against the session server: every chat completes its turns; the per-chat
    token counts add up to the aggregate."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "chat_concurrent.py"), "--url", triton_server.grpc_url,
         "--chats", "3", "--turns", "2", "--max-tokens", "8"],
        capture_output=True, text=True, timeout=WAIT_S,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    per_chat = re.findall(r"^chat (\d+): 2 turns, (\d+) tokens in [\d.]+ s, [\d.]+ tokens/s", done.stdout, re.M)
    assert [int(k) for k, _ in per_chat] == [0, 1, 2]
    total = re.search(r"^all: 3 chats, 6/6 turns, (\d+) tokens in [\d.]+ s, [\d.]+ tokens/s aggregate$",
                      done.stdout, re.M)
    assert total is not None, done.stdout
    assert int(total.group(1)) == sum(int(t) for _, t in per_chat) > 0
