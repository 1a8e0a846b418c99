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
import pytest

from triton_npu_client import ChatReply, Client, LocalTriton
from triton_npu_client._local._server import temp_folder_prefix
from triton_npu_client.cli import main as cli_main

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


TRIPWIRE = """#!/bin/sh
echo started >> "$TNC_TEST_TRIPWIRE"
exit 1
"""


def test_sdk_errors_become_one_line_and_exit_2(triton_server: LocalTriton) -> None:
    """An HTTP URL and an unknown model (the line names the chat models the server has): one clear line on stderr
    each, exit status 2."""
    cases = [
        (["--url", triton_server.http_url], "serves only over the gRPC stream"),
        (["--url", triton_server.grpc_url, "--model", "no_such_model"],
         f"model 'no_such_model' not found at {triton_server.grpc_url}; chat models here: "),
    ]  # fmt: skip
    for args, needle in cases:
        done = subprocess.run(chat_command(*args), input=b"Hello.\n", capture_output=True, timeout=WAIT_S)
        err = done.stderr.decode()
        assert done.returncode == 2, err
        assert err.startswith("triton-npu chat: ")
        assert needle in err
        assert err.count("\n") == 1
        assert done.stdout == b""
        if "chat models here" in needle:
            listed = err.split("chat models here: ")[1].removesuffix(" (pass --model NAME)\n").split(", ")
            # The session's chat models, not its other ones (a stateless chat twin is no chat model).
            assert "chat" in listed
            assert not {"chat_stateless", "scale_fp32", "minilm"} & set(listed), listed


def test_bad_options_are_one_line_before_any_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Bad options: one line and exit 2, before any server starts. Without --url the command would start one, and
    $TRITONSERVER is a tripwire that records any start (the control at the end shows it fires). Run in this process:
    a mistake needs no interpreter of its own."""
    tripwire = tmp_path / "tritonserver"
    tripwire.write_text(TRIPWIRE)
    tripwire.chmod(0o755)
    marker = tmp_path / "started"
    monkeypatch.setenv("TRITONSERVER", str(tripwire))
    monkeypatch.setenv("TNC_TEST_TRIPWIRE", str(marker))
    cases = [
        (["--max-tokens", "-1"], "chat option 'max_tokens': expected an int >= 1, or 0 for no cap"),
        (["--top-p", "0"], "chat option 'top_p'"),
        (["--top-p", "1.5"], "chat option 'top_p'"),
        (["--top-k", "-1"], "chat option 'top_k'"),
        (["--temperature", "-1"], "chat option 'temperature'"),
        (["--stop", ""], "chat option 'stop'"),
        (["--min-tokens", "9", "--max-tokens", "3"], "chat option 'min_tokens'"),
        (["--cpu-threads", "2"], "--cpu-threads shapes the model generated from a checkpoint: it needs --checkpoint"),
    ]  # fmt: skip
    for args, needle in cases:
        code = cli_main(["chat", *args])
        out, err = capsys.readouterr()
        assert (code, out) == (2, ""), err
        assert err.startswith("triton-npu chat: ")
        assert needle in err
        assert err.count("\n") == 1
    assert not marker.exists(), "a server was started for a mistake"
    # The control: a good command does start a server, and the tripwire sees it.
    assert cli_main(["chat", "--max-tokens", "4"]) == 2
    assert "exited during startup" in capsys.readouterr().err
    assert marker.exists()


def _stats_block(err: str) -> list[tuple[int, float, int, int, int]]:
    """Each /stats answer: (last reply's tokens, its tokens/s, conversation turns, tokens held, session replies)."""
    return [
        (int(m[0]), float(m[1]), int(m[2]), int(m[3]), int(m[4]))
        for m in re.findall(
            r"^last reply: (\d+) tokens in [\d.]+ s \(([\d.]+) tokens/s\), first token (?:\d+ ms|-), finished: \w+; "
            r"input \d+ tokens \(\d+ prefilled\)\nconversation: (\d+) turns, (\d+) tokens held by the server\n"
            r"session: (\d+) replies, \d+ tokens$",
            err, re.M,
        )
    ]


def test_commands_help_reset_system_stats_and_quit(triton_server: LocalTriton) -> None:
    """A banner; /help lists the commands; /stats gives the last reply's figures; /reset begins a new conversation
    (the next reply is a fresh chat's, not the second turn's); /system TEXT begins one with that system message;
    an unknown command is refused without reaching the model; // sends a line beginning with /; /quit leaves with
    status 0 while the input is still open. Every conversation begun is ended on the server."""
    url = triton_server.grpc_url
    greeting, question = "Good morning.", "Where is the garden?"
    live_before = asyncio.run(live_conversations(url))
    with running("--url", url, "--max-tokens", "8") as cli:
        cli.until(lambda o: b"/help lists the commands" in o.err, "banner")
        assert f"chatting with model 'chat' at {url}".encode() in cli.err
        cli.write("/help\n")
        cli.until(lambda o: b"commands (a line that starts with /" in o.err, "help")
        for command in ("/reset", "/system TEXT", "/stats", "/quit"):
            assert command.encode() in cli.err
        cli.write(f"{greeting}\n/stats\n/reset\n{greeting}\n/stats\n/system You are terse.\n{question}\n/system\n"
                  "/bogus\n//quit\n/stats\n")  # fmt: skip
        cli.until(lambda o: len(_stats_block(o.err.decode())) == 3, "the third /stats")
        cli.write("/quit\n")  # the input stays open: only /quit ends the command
        code = cli.finish()
    assert code == 0, cli.err
    err = cli.err.decode()
    (first,) = asyncio.run(sdk_replies(url, [greeting], max_tokens=8))
    second_turn = asyncio.run(sdk_replies(url, [greeting, greeting], max_tokens=8))[1]
    # So the conversation /stats shows after /reset tells a fresh chat from a second turn (whose text may be the same).
    assert second_turn.context_tokens != first.context_tokens
    terse = asyncio.run(sdk_replies(url, [question, "/quit"], system="You are terse.", max_tokens=8))
    assert cli.out.decode() == f"{first.text}\n{first.text}\n{terse[0].text}\n{terse[1].text}\n"
    assert "[new conversation]" in err
    assert "[new conversation with this system message]" in err
    assert "[system message: 'You are terse.']" in err
    assert "triton-npu chat: unknown command '/bogus': /help lists the commands" in err
    after_first, after_reset, after_terse = _stats_block(err)
    assert after_first[0] == first.tokens
    assert after_first[2:] == (1, first.context_tokens, 1)
    assert after_reset[2:] == (1, first.context_tokens, 2)  # one turn of a fresh conversation, not a second turn
    assert after_terse[0] == terse[1].tokens
    assert after_terse[2:] == (2, terse[1].context_tokens, 4)
    assert [int(t) for t, _, _ in STATS.findall(err)] == [first.tokens, first.tokens, *(r.tokens for r in terse)]
    assert asyncio.run(live_conversations(url)) == live_before  # the conversations /reset and /system left ended


def test_sampling_flags_reach_the_model(triton_server: LocalTriton) -> None:
    """--temperature, --top-p, --top-k, --seed, --max-tokens and --stop (twice) give the reply the SDK gets with the
    same options; the stop string is one the unstopped reply holds, so the reply is cut before it."""
    url = triton_server.grpc_url
    question = "Tell me about the sea."
    sampled = {"temperature": 0.9, "top_p": 0.9, "top_k": 20, "seed": 7, "max_tokens": 24}
    (unstopped,) = asyncio.run(sdk_replies(url, [question], **sampled))
    assert len(unstopped.text) > 8, unstopped.text
    stop = unstopped.text[len(unstopped.text) // 2 :][:3]
    (expected,) = asyncio.run(sdk_replies(url, [question], stop=["never in a reply", stop], **sampled))
    assert expected.finish_reason == "stop_string"
    assert len(expected.text) < len(unstopped.text)
    flags = ["--temperature", "0.9", "--top-p", "0.9", "--top-k", "20", "--seed", "7", "--max-tokens", "24",
             "--stop", "never in a reply", "--stop", stop]  # fmt: skip
    with running("--url", url, *flags) as cli:
        cli.write(question + "\n")
        cli.close_input()
        code = cli.finish()
    assert code == 0, cli.err
    assert cli.out.decode() == expected.text + "\n"
    assert "finished: stop_string" in cli.err.decode()


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
