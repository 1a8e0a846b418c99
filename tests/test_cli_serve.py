"""`triton-npu serve` as a user runs it: every flag explained, Triton's ports, each mistake one line before any server
starts, a line per model as it loads, ``--models`` loading only those, and a signal at any moment ending it within
5 s with the shell's code (130 for Ctrl-C, 143 for SIGTERM) and nothing of the server left.

"No server started" is observed, not inferred: ``$TRITONSERVER`` points to a tripwire script that records each start
in a marker file (the control test shows it fires when the command does start a server). The servers that do start
run on a repository of one or two tiny Python models, on free ports.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from _procs import living
from test_local import GOOD_MODEL, SLOW_LOAD_MODEL, SLOW_UNLOAD_MODEL, _write_model

from triton_npu_client import cli
from triton_npu_client._local._server import temp_folder_prefix
from triton_npu_client.cli import _serve

# A safety net only: each wait ends as soon as the line it waits for is printed.
WAIT_S = 120.0
# What the issue promises: a signal at any moment ends the command within this long.
STOP_WITHIN_S = 5.0
FREE_PORTS = ["--http-port", "0", "--grpc-port", "0", "--metrics-port", "0"]
TRIPWIRE = """#!/bin/sh
echo started >> "$TNC_TEST_TRIPWIRE"
exit 1
"""


def serve_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "triton_npu_client", "serve", *args]


@pytest.fixture
def tripwire(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """$TRITONSERVER (for the command run here) is a script that records each start in the marker file returned, and
    then fails."""
    binary = tmp_path / "bin" / "tritonserver"
    binary.parent.mkdir()
    binary.write_text(TRIPWIRE)
    binary.chmod(0o755)
    marker = tmp_path / "tritonserver-started"
    monkeypatch.setenv("TRITONSERVER", str(binary))
    monkeypatch.setenv("TNC_TEST_TRIPWIRE", str(marker))
    return marker


def run_here(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """``triton-npu serve args`` in this process (its mistakes need no interpreter of their own): status, out, err."""
    code = cli.main(["serve", *args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """Two tiny Python models, echo and other."""
    repository = tmp_path / "repo"
    for name in ("echo", "other"):
        _write_model(repository, name, GOOD_MODEL)
    return repository


def _serve_parser() -> argparse.ArgumentParser:
    parser = cli._parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    serve: argparse.ArgumentParser = sub.choices["serve"]
    return serve


def test_every_flag_has_help_and_the_ports_are_tritons() -> None:
    serve = _serve_parser()
    undocumented = [a.option_strings for a in serve._actions if a.option_strings and not (a.help or "").strip()]
    assert undocumented == []
    ns = serve.parse_args([])
    assert (ns.http_port, ns.grpc_port, ns.metrics_port) == ("8000", "8001", "8002")
    # The checkpoint folder has one name in both verbs; serve keeps its old one as an alias.
    assert serve.parse_args(["--chat", "D"]).checkpoint == serve.parse_args(["--checkpoint", "D"]).checkpoint == "D"


def test_the_tripwire_fires_when_serve_starts_a_server(
    tripwire: Path, repo: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The control for the tests below: a good command does start a server, and the tripwire sees it."""
    code, _, err = run_here(capsys, "--model-repository", str(repo), "--models", "echo", *FREE_PORTS)
    assert tripwire.exists(), err
    assert code == 2, err
    assert "exited during startup" in err


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


MISTAKES: list[tuple[str, Callable[[Path, int], list[str]], str]] = [
    ("unknown model", lambda r, p: ["--models", "echo,nope", *FREE_PORTS],
     "--models: no model 'nope' in REPO (models there: echo, other)"),
    ("no model named", lambda r, p: ["--models", " , ", *FREE_PORTS], "--models: expected model names"),
    ("models without explicit", lambda r, p: ["--models", "echo", "--model-control-mode", "poll", *FREE_PORTS],
     "--models loads only those models, which needs --model-control-mode explicit (given poll)"),
    ("port taken", lambda r, p: ["--http-port", "0", "--grpc-port", str(p), "--metrics-port", "0"],
     "--grpc-port PORT: the port is in use on 127.0.0.1"),
    ("port not a number", lambda r, p: ["--http-port", "eighty", "--grpc-port", "0", "--metrics-port", "0"],
     "--http-port: expected a port number in 0..65535 (0: any free port), given 'eighty'"),
    ("port out of range", lambda r, p: ["--metrics-port", "70000", "--http-port", "0", "--grpc-port", "0"],
     "--metrics-port: expected a port number in 0..65535"),
    ("same port twice", lambda r, p: ["--http-port", "9100", "--grpc-port", "9100", "--metrics-port", "0"],
     "--http-port and --grpc-port are both 9100"),
    ("no such repository", lambda r, p: ["--model-repository", str(r / "nowhere"), *FREE_PORTS],
     "--model-repository REPO/nowhere: no such folder"),
    ("no checkpoint folder", lambda r, p: ["--checkpoint", str(r / "nowhere"), *FREE_PORTS],
     "checkpoint REPO/nowhere: no such folder"),
    ("no checkpoint folder, old flag", lambda r, p: ["--chat", str(r / "nowhere"), *FREE_PORTS],
     "checkpoint REPO/nowhere: no such folder"),
    ("checkpoint option alone", lambda r, p: ["--max-ctx", "64", *FREE_PORTS],
     "--max-ctx shapes the model generated from a checkpoint: it needs --checkpoint DIR"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "args", "needle"), MISTAKES, ids=[m[0] for m in MISTAKES])
def test_each_mistake_is_one_line_and_exit_2_before_any_server(
    tripwire: Path, repo: Path, taken_port: int, capsys: pytest.CaptureFixture[str], case: str,
    args: Callable[[Path, int], list[str]], needle: str,
) -> None:  # fmt: skip
    argv = args(repo, taken_port)
    if "--model-repository" not in argv:
        argv = ["--model-repository", str(repo), *argv]
    code, out, err = run_here(capsys, *argv)
    assert not tripwire.exists(), f"a server was started: {err}"
    assert (code, out) == (2, ""), err
    assert err.startswith("triton-npu serve: ")
    assert err.count("\n") == 1, err
    assert needle.replace("REPO", str(repo)).replace("PORT", str(taken_port)) in err


def test_from_the_shell_a_mistake_is_one_line(tripwire: Path, repo: Path) -> None:
    """The installed command as a user runs it (its own interpreter): one line, exit 2, no server."""
    done = subprocess.run(serve_command("--model-repository", str(repo), "--models", "nope", *FREE_PORTS),
                          capture_output=True, text=True, timeout=WAIT_S)  # fmt: skip
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == f"triton-npu serve: --models: no model 'nope' in {repo} (models there: echo, other)\n"
    assert not tripwire.exists()


class Serving:
    """A running `triton-npu serve`: its stdout read line by line as it comes."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.lines: list[str] = []

    def until(self, pattern: str) -> re.Match[str]:
        """Read until a line matches ``pattern``; fail (showing what came) if the output ends first."""
        assert self.proc.stdout is not None
        compiled = re.compile(pattern)
        for line in self.proc.stdout:
            self.lines.append(line)
            found = compiled.search(line)
            if found is not None:
                return found
        raise AssertionError(f"no line like {pattern!r}: {''.join(self.lines)}")

    def stop_with(self, signum: signal.Signals) -> tuple[int, float, str]:
        """Send ``signum``; the exit status, the seconds until the command exited, the rest of its output."""
        sent = time.monotonic()
        self.proc.send_signal(signum)
        code = self.proc.wait(timeout=WAIT_S)
        took = time.monotonic() - sent
        assert self.proc.stdout is not None
        assert self.proc.stderr is not None
        self.lines.extend(self.proc.stdout)
        return code, took, self.proc.stderr.read()


@contextlib.contextmanager
def serving(*args: str) -> Iterator[Serving]:
    with subprocess.Popen(serve_command(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        try:
            yield Serving(proc)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _temp_folders_of(pid: int) -> list[str]:
    prefixes = (temp_folder_prefix(pid), f"triton-npu-serve-{pid}-")
    return [p.name for p in Path(tempfile.gettempdir()).iterdir() if p.name.startswith(prefixes)]


def test_models_loads_only_those_reports_each_and_ctrl_c_exits_130(repo: Path) -> None:
    """`--models echo` on a repository of two: a line says echo loaded (with its time) before the banner, the server
    holds echo READY and not other; Ctrl-C while serving exits 130 within 5 s, leaving no process and no folder."""
    with serving("--model-repository", str(repo), "--models", "echo", *FREE_PORTS) as s:
        first = s.until(r"^starting tritonserver on (.+) \((\d+) models?\) \.\.\.$")
        assert (first.group(1), first.group(2)) == (str(repo.resolve()), "1")
        loaded = s.until(r"^  loaded   (\S+) \(version (\d+)\) in (\d+\.\d) s$")
        assert (loaded.group(1), loaded.group(2)) == ("echo", "1")
        url = s.until(r"^  HTTP     (\S+)$").group(1)
        s.until(r"^Press Ctrl-C to stop\.$")
        request = urllib.request.Request(f"{url}/v2/repository/index", data=b"{}", method="POST")
        with urllib.request.urlopen(request, timeout=30) as resp:
            index = {m["name"]: m.get("state", "") for m in json.loads(resp.read())}
        code, took, err = s.stop_with(signal.SIGINT)
    print(f"SIGINT while serving: exit {code} after {took:.2f} s")
    assert code == 130, err
    assert took < STOP_WITHIN_S, took
    assert index == {"echo": "READY", "other": ""}  # other: in the repository, never loaded
    text = "".join(s.lines)
    assert text.index("  loaded   echo") < text.index("tritonserver ready")
    assert "loaded   other" not in text
    assert living(str(repo)) == []
    assert _temp_folders_of(s.proc.pid) == []


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["INT", "TERM"])
def test_a_signal_during_the_start_stops_within_5_s(tmp_path: Path, signum: signal.Signals, code: int) -> None:
    """A signal while the models load (echo has loaded, slow's initialize sleeps for minutes, the server ignores
    SIGTERM until it is done): the command kills the server at once and exits with the signal's code within 5 s;
    no process of the server, no stub, no temp folder remains."""
    repository = tmp_path / "repo"
    _write_model(repository, "echo", GOOD_MODEL)
    _write_model(repository, "slow", SLOW_LOAD_MODEL)
    with serving("--model-repository", str(repository), *FREE_PORTS) as s:
        s.until(r"^  loaded   echo ")
        assert any(b"slow/1/model.py" in Path(f"/proc/{pid}/cmdline").read_bytes()
                   for pid in living(str(repository))), "slow's stub is not loading"  # fmt: skip
        got, took, err = s.stop_with(signum)
    print(f"{signum.name} during the start: exit {got} after {took:.2f} s")
    assert got == code, err
    assert took < STOP_WITHIN_S, took
    assert "Traceback" not in err
    assert "tritonserver ready" not in "".join(s.lines)
    assert living(str(repository)) == []
    assert _temp_folders_of(s.proc.pid) == []


def test_a_second_ctrl_c_kills_a_server_that_takes_its_time_to_stop(tmp_path: Path) -> None:
    """A model whose finalize sleeps for minutes and a grace of a minute: after the first Ctrl-C the command waits
    (it says it is stopping); the second kills the server at once, and the command exits 130 within 5 s of it."""
    repository = tmp_path / "repo"
    _write_model(repository, "lingers", SLOW_UNLOAD_MODEL)
    with serving("--model-repository", str(repository), "--stop-grace", "60", *FREE_PORTS) as s:
        s.until(r"^Press Ctrl-C to stop\.$")
        s.proc.send_signal(signal.SIGINT)
        s.until(r"^stopping tritonserver \.\.\.$")
        assert s.proc.poll() is None  # waiting for finalize, which sleeps
        code, took, err = s.stop_with(signal.SIGINT)
    print(f"the second SIGINT: exit {code} after {took:.2f} s")
    assert code == 130, err
    assert took < STOP_WITHIN_S, took
    assert living(str(repository)) == []
    assert _temp_folders_of(s.proc.pid) == []


def test_a_signal_before_the_server_exists_exits_with_its_code(monkeypatch: pytest.MonkeyPatch, repo: Path) -> None:
    """A signal that comes while the command is still checking its arguments: no server is started at all."""
    started: list[object] = []

    class Refuse:
        def __init__(self, *args: object, **kwargs: object) -> None:
            os.kill(os.getpid(), signal.SIGTERM)  # arrives before the server would be started

        def check_ports(self) -> None:
            pass

        def start(self, **kwargs: object) -> None:
            started.append(kwargs)

        def stop(self) -> None:
            pass

    monkeypatch.setattr(_serve, "LocalTriton", Refuse)
    assert cli.main(["serve", "--model-repository", str(repo), *FREE_PORTS]) == 143
    assert started == []
