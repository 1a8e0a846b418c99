"""`triton-npu score` under chaos: the job SIGKILLed at random moments, its server SIGKILLed and restarted, random bad
rows and random bad paths; afterwards the output holds every good row exactly once, in order, and the errors file
every bad row once, and the input is untouched.

Seeded: the seed is printed; ``TNC_CHAOS_SEED`` sets the first seed and ``TNC_CHAOS_RUNS`` how many consecutive seeds
run (CI runs one, the fixed default). N seeds from 100::

    TNC_CHAOS_SEED=100 TNC_CHAOS_RUNS=20 .venv/bin/pytest -q -s -n 0 tests/test_score_chaos.py

The server is the module's own LocalTriton (only ``score_probe``: Y = 3 * X[0], each request sleeps max(X[1]) ms, a
negative X[0] fails the request) so that it can be killed and restarted on the same ports while a job runs.
"""

from __future__ import annotations

import collections
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import attrs
import pytest

from triton_npu_client import LocalTriton

pytestmark = pytest.mark.slow

FIRST_SEED = int(os.environ.get("TNC_CHAOS_SEED", "20261201"))
RUNS = int(os.environ.get("TNC_CHAOS_RUNS", "1"))
MAX_LINE = 2000
DEADLINE_S = 180.0  # a bound on waiting for a job's progress, never a synchronisation delay

# The error class each kind of bad row must be recorded with.
BAD_KINDS = {
    "unparsable": "RowParseError",
    "too long": "RowParseError",
    "wrong shape": "InputShapeError",
    "missing input": "RowParseError",  # the reader finds no input's key in the line
    "refused by the model": "InternalServerError",
}


class ChaosServer:
    """A LocalTriton that can be SIGKILLed and started again on the same ports."""

    def __init__(self) -> None:
        self.server = LocalTriton(model_control_mode="explicit", load_models=["score_probe"])
        self.server.start()
        self.ports = (self.server.http_port, self.server.grpc_port, self.server.metrics_port)

    @property
    def url(self) -> str:
        return f"grpc://127.0.0.1:{self.ports[1]}"

    def kill(self) -> None:
        assert self.server.pid is not None
        os.killpg(self.server.pid, signal.SIGKILL)
        self.server.stop()
        # A server that died "on its own" keeps its log for a post-mortem; this death was planned.
        if self.server.log_path is not None:
            shutil.rmtree(self.server.log_path.parent, ignore_errors=True)

    def restart(self) -> None:
        http, grpc, metrics = self.ports
        self.server = LocalTriton(model_control_mode="explicit", load_models=["score_probe"], http_port=http,
                                  grpc_port=grpc, metrics_port=metrics)
        self.server.start()

    def stop(self) -> None:
        self.server.stop()


@pytest.fixture(scope="module")
def chaos_server() -> Iterator[ChaosServer]:
    server = ChaosServer()
    try:
        yield server
    finally:
        server.stop()


@attrs.define
class Dataset:
    lines: list[str]
    good: list[int] = attrs.Factory(list)  # row indices
    bad: dict[int, str] = attrs.Factory(dict)  # row index -> kind


def make_dataset(rng: random.Random) -> Dataset:
    """JSONL rows, a random share of them bad in random ways, and some blank lines (which are no rows)."""
    data = Dataset([])
    row = 0
    for _ in range(rng.randint(500, 800)):
        if rng.random() < 0.03:
            data.lines.append("")
            continue
        delay = rng.uniform(0, 40)  # ms a request sleeps: a job lasts a second or two, long enough to be hit
        if rng.random() < 0.08:
            kind = rng.choice(sorted(BAD_KINDS))
            data.bad[row] = kind
            data.lines.append({
                "unparsable": '{"X": [1.0, ',
                "too long": json.dumps({"X": [float(row), delay], "pad": "x" * (MAX_LINE + rng.randint(1, 5000))}),
                "wrong shape": json.dumps({"X": [float(row), delay, 1.0]}),
                "missing input": json.dumps({"Z": [float(row), delay]}),
                "refused by the model": json.dumps({"X": [-1.0 - row, delay]}),
            }[kind])
        else:
            data.good.append(row)
            data.lines.append(json.dumps({"X": [float(row), delay]}))
        row += 1
    return data


def command(url: str, source: Path, output: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "triton_npu_client", "score", "--url", url, "--model", "score_probe",
        "--input", str(source), "--output", str(output), "--concurrency", "3", "--batch-size", "8",
        "--commit-every", "0.05", "--no-progress", "--max-line-bytes", str(MAX_LINE),
        # A job that finished before its kill is re-run later: its checkpoint must say it is this job's.
        "--keep-checkpoint", *extra,
    ]


def committed_rows(output: Path) -> int:
    try:
        return int(json.loads(output.with_name(output.name + ".checkpoint.json").read_text())["rows"])
    except (FileNotFoundError, ValueError, KeyError):
        return 0


def wait_until(proc: subprocess.Popen[bytes], ready: Callable[[], bool]) -> bool:
    """Poll ``ready`` while the job runs; whether it became true (False: the job ended first)."""
    deadline = time.monotonic() + DEADLINE_S
    while proc.poll() is None:
        if ready():
            return True
        assert time.monotonic() < deadline, "the job made no progress"
        time.sleep(0.003)  # polling the job's files: the moment to act, not a race to wait out
    return False


def passed(output: Path, target: int) -> Callable[[], bool]:
    return lambda: committed_rows(output) >= target


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and not p.is_symlink()}


def bad_path_attempt(rng: random.Random, folder: Path, source: Path, output: Path, url: str) -> tuple[str, int]:
    """Run the CLI with a random path mistake; assert it was refused in one line and changed nothing."""
    other = folder / "other.jsonl"
    mistakes: dict[str, tuple[list[str], int]] = {
        "output is the input": (command(url, source, source), 14),
        "errors file is the input": (command(url, source, output, "--errors", str(source)), 14),
        "errors file is the output": (command(url, source, output, "--errors", str(output)), 14),
        "output links to the input": (command(url, source, folder / "link.jsonl", "--overwrite"), 14),
        "unknown output suffix": (command(url, source, folder / "out.xlsx"), 13),
        "missing input": (command(url, folder / "typo.jsonl", output), 10),
        "someone else's output": (command(url, source, other), 15),
    }
    if output.with_name(output.name + ".checkpoint.json").exists():
        mistakes["other options, same output"] = (command(url, source, output, "--concurrency", "2",
                                                          "--batch-size", "4"), 16)
    name = rng.choice(sorted(mistakes))
    args, code = mistakes[name]
    (folder / "link.jsonl").unlink(missing_ok=True)
    (folder / "link.jsonl").symlink_to(source)
    other.write_text("someone else's results\n")
    before = snapshot(folder)
    done = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert done.returncode == code, (name, done.stderr)
    assert len(done.stderr.splitlines()) == 1, (name, done.stderr)
    assert snapshot(folder) == before, f"{name}: the refused run changed files"
    return name, code


def check_final(data: Dataset, output: Path, errors: Path) -> None:
    written = [json.loads(line) for line in output.read_text().splitlines()]
    assert [w["row"] for w in written] == data.good, "the output does not hold every good row once, in order"
    assert all(w["Y"] == [3.0 * w["row"]] for w in written)
    failed = [json.loads(line) for line in errors.read_text().splitlines()]
    assert [f["row"] for f in failed] == sorted(data.bad), "the errors file does not hold every bad row once"
    for f in failed:
        assert f["error"] == BAD_KINDS[data.bad[f["row"]]], f


def one_run(seed: int, server: ChaosServer, folder: Path) -> collections.Counter[str]:
    rng = random.Random(seed)
    data = make_dataset(rng)
    source = folder / "rows.jsonl"
    source.write_text("\n".join(data.lines) + "\n")
    original = source.read_bytes()
    output = folder / "scores.jsonl"
    actions: collections.Counter[str] = collections.Counter()
    # Every run kills the server once (a restart costs seconds), at a random moment among random job kills.
    steps = ["kill job"] * rng.randint(3, 6) + ["bad path"] * rng.randint(2, 4) + ["kill server"]
    rng.shuffle(steps)
    total = len(data.lines)
    for step in steps:
        if step == "bad path":
            name, _ = bad_path_attempt(rng, folder, source, output, server.url)
            actions[f"bad path: {name}"] += 1
            continue
        proc = subprocess.Popen(command(server.url, source, output), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            # A random moment: the job barely started, or its checkpoint has passed a random row. The server dies
            # only mid-job (after this run committed a row): a job that cannot reach its server at the start
            # fails at once (exit 20), by design, so that a wrong --url does not hang.
            start = committed_rows(output)
            if step == "kill job":
                target = 0 if rng.random() < 0.15 else rng.randint(start, start + (total - start) * 4 // 5)
            else:
                target = rng.randint(start + 1, max(start + 1, total))
            reached = wait_until(proc, output.exists if target == 0 else passed(output, target))
            if step == "kill job":
                if reached:
                    proc.send_signal(signal.SIGKILL)
                    actions["job killed"] += 1
                else:
                    actions["job finished before its kill"] += 1
            else:
                if reached:
                    server.kill()
                    # The job keeps retrying while the server is down; a restart on the same ports lets it go on.
                    server.restart()
                    actions["server killed and restarted mid-job"] += 1
                else:
                    server.kill()
                    server.restart()
                    actions["server killed and restarted after the job finished"] += 1
            _, err = proc.communicate(timeout=DEADLINE_S)
            assert proc.returncode in (-signal.SIGKILL, 3), (proc.returncode, err.decode())
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert source.read_bytes() == original
    done = subprocess.run(command(server.url, source, output), capture_output=True, text=True, timeout=DEADLINE_S)
    # Bad rows on purpose, and the default --max-failed 0: the finished job says so.
    assert done.returncode == 3, done.stderr
    assert f"{len(data.bad):,} of {len(data.good) + len(data.bad):,} rows failed" in done.stderr
    check_final(data, output, Path(f"{output}.errors.jsonl"))
    assert source.read_bytes() == original
    actions["rows"] = len(data.good) + len(data.bad)
    actions["bad rows"] = len(data.bad)
    return actions


def test_score_survives_chaos(chaos_server: ChaosServer, tmp_path: Path) -> None:
    for seed in range(FIRST_SEED, FIRST_SEED + RUNS):
        folder = tmp_path / f"seed-{seed}"
        folder.mkdir()
        print(f"\nscore chaos seed {seed} (re-run: TNC_CHAOS_SEED={seed} TNC_CHAOS_RUNS=1)", flush=True)
        actions = one_run(seed, chaos_server, folder)
        print(f"seed {seed}: ok; " + ", ".join(f"{k}: {v}" for k, v in sorted(actions.items())), flush=True)
        shutil.rmtree(folder)
