"""Every python block of the README, saved as a file and run exactly as written, does what its comments say.

Blocks that reach a server read its URL from ``TRITON_URL`` (``TRITON_URLS`` for the fleet's list), as a user
would: here it is the session's server. Blocks that start a server of their own (the tour, ``LocalTriton``) get a
repository narrowed to the models they use. Each runs in a fresh interpreter, in a temporary folder for any file
it writes. A block without an entry in ``EXPECTED`` fails the suite: a new block is run, never skipped.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import attrs
import numpy as np
import pytest
from _scripts import run_script

from triton_npu_client import LocalTriton

ROOT = Path(__file__).resolve().parent.parent


def python_blocks() -> list[tuple[str, str]]:
    """(the heading above it, its text) for each python block of the README, in order."""
    heading = ""
    blocks: list[tuple[str, str]] = []
    text = (ROOT / "README.md").read_text()
    for match in re.finditer(r"^(#{1,6}) ([^\n]+)$|^```python\n(.*?)^```$", text, re.M | re.S):
        if match.group(2) is not None:
            heading = match.group(2).strip()
        else:
            blocks.append((heading, match.group(3)))
    return blocks


@attrs.frozen
class Expected:
    """How a block runs (the models of a server it starts itself) and what its output must show."""

    check: Callable[[list[str], Path], None]
    models: tuple[str, ...] = ()
    gateway: bool = False  # the block talks to `triton-npu openai`, started here on the session's server
    # Run this many times in a row in the same folder, each run checked: a block that writes files must not trip
    # over its own last run's (the scoring block once failed its second run on its own checkpoint).
    runs: int = 1


def _tour(lines: list[str], _cwd: Path) -> None:
    assert lines[0] == "<ModelSpec scale_fp32(INPUT0: FP32[-1]) -> (OUTPUT0: FP32[-1]), max_batch_size=64>"
    assert lines[1] == "[[0. 2. 4. 6.]]"  # 2 * arange(4), batch dimension added
    assert lines[2].startswith("input 'INPUT0': expected FP32, given float64: ")
    assert lines[3] == "[[2. 3. 4. 5.]]"  # mean of [1, 2, 3, 4] and [3, 4, 5, 6]
    assert len(lines) == 4


def _sequence(lines: list[str], _cwd: Path) -> None:
    assert lines == ["[[1]]", "[[2]]", "[[3]]", "[[4]]", "[[5]]"]  # the counter, one response each


def _chat(lines: list[str], _cwd: Path) -> None:
    assert lines[-1] == "3 turns, " + lines[-1].split(" ")[2] + " tokens kept on the server"
    assert int(lines[-1].split(" ")[2]) > 0
    reason = re.search(r" (stop|stop_string|length|context) ([\d.e-]+|None) ([\d.e-]+)$", lines[-3])
    assert reason is not None, lines[-3]  # the reply's text, why it finished, its timings
    # The constrained reply's name (parsed from valid JSON, at most 20 characters), then its tokens' logprobs.
    name, _, logprobs = lines[-2].rpartition(" [")
    assert len(json.loads(name)) <= 20, lines[-2]
    assert all(float(v) <= 0 for v in logprobs.rstrip("]").split(", ")), lines[-2]


def _scoring(lines: list[str], cwd: Path) -> None:
    summaries = [line for line in lines if line.startswith("scored ")]
    assert len(summaries) == 2  # score() and score_sync()
    assert all(re.match(r"scored 3 rows in [\d.]+ s \([\d,]+ rows/s\): 3 ok, 0 failed", s) for s in summaries)
    rows = [line for line in lines if not line.startswith("scored ")]
    assert rows == [f"{i} (384,) None" for i in range(3)]
    first, second = np.load(cwd / "embeddings.npy"), np.load(cwd / "embeddings_sync.npy")
    assert first.shape == (3, 384)
    np.testing.assert_allclose(first, second, atol=1e-5)  # the same sentences, the same embeddings


def _fleet(lines: list[str], _cwd: Path) -> None:
    assert lines[0] == "[[0. 2. 4. 6.]]"
    assert len(lines) == 3  # one line per replica
    assert all(re.match(r"grpc://\S+ healthy \d+ requests$", line) for line in lines[1:]), lines


def _openai(lines: list[str], _cwd: Path) -> None:
    assert len(lines) == 2
    assert lines[0]  # the second reply's text
    floats = lines[1].strip("[]").split(", ")
    assert len(floats) == 3
    assert all(-1 <= float(x) <= 1 for x in floats)  # a unit vector's first three values


def _local(lines: list[str], _cwd: Path) -> None:
    assert len(lines) == 1
    assert re.fullmatch(r"grpc://127\.0\.0\.1:\d+ http://127\.0\.0\.1:\d+", lines[0])


EXPECTED: dict[str, Expected] = {
    "A short tour": Expected(_tour, models=("scale_fp32", "seq_stats_oldest")),
    "Stateful sequences": Expected(_sequence),
    "Chat sessions": Expected(_chat),
    "Batch scoring": Expected(_scoring, runs=2),
    "Several replicas, TLS, traces": Expected(_fleet),
    "The OpenAI API": Expected(_openai, gateway=True),
    "A local Triton in one command": Expected(_local, models=("scale_fp32",)),
}


def test_every_block_is_run() -> None:
    """Each python block sits under its own heading, and each has its expectations here (so each is run)."""
    headings = [heading for heading, _ in python_blocks()]
    assert len(headings) == len(set(headings))
    assert headings == list(EXPECTED)


@pytest.mark.parametrize("heading", list(EXPECTED))
def test_block_runs_as_written(heading: str, triton_server: LocalTriton, tmp_path: Path) -> None:
    """The block under ``heading``, saved as a file, runs to exit code 0 and prints what it claims."""
    block = dict(python_blocks())[heading]
    expected = EXPECTED[heading]
    script = tmp_path / "snippet.py"
    script.write_text(block)
    url = triton_server.grpc_url
    env = {"TRITON_URL": url, "TRITON_URLS": f"{url},{url.replace('127.0.0.1', 'localhost')}"}
    with contextlib.ExitStack() as stack:
        if expected.gateway:
            env["OPENAI_BASE_URL"] = stack.enter_context(_gateway(url))
        for run in range(expected.runs):
            if run:
                shutil.rmtree(tmp_path / "models")  # run_script's narrowed repository, made anew each run
            code, out, err = run_script(script, tmp_path, expected.models, env=env)
            assert code == 0, f"run {run + 1}: {err[-3000:]}"
            expected.check(out.splitlines(), tmp_path)


@contextlib.contextmanager
def _gateway(url: str) -> Iterator[str]:
    """``triton-npu openai --url URL`` on a free port, as a user starts it; its base URL, read from its banner."""
    command = [sys.executable, "-m", "triton_npu_client", "openai", "--url", url, "--port", "0", "--store", "memory"]
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    ) as proc:
        try:
            assert proc.stdout is not None
            banner = proc.stdout.readline()
            assert banner.startswith("OpenAI API on "), banner
            yield banner.split()[-1]
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.communicate(timeout=30)
            finally:
                if proc.poll() is None:
                    proc.kill()
