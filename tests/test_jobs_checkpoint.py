"""ResumableOutput: a job killed (SIGKILL) at random points and re-run writes every row exactly once, in order."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from triton_npu_client._jobs import CheckpointMismatch, ResumableOutput

ROWS = 3000
DEADLINE_S = 120.0  # a bound on waiting for the worker's progress, never a synchronisation delay

# A job: row i gives {"i": i, "square": i * i}; every 13th row is "bad" and goes to the errors file. It commits
# every 7 rows and writes each line in two parts, so that a kill can land between commits and inside a line.
WORKER = '''
import json, sys
from triton_npu_client._jobs import ResumableOutput

out, err, rows = sys.argv[1], sys.argv[2], int(sys.argv[3])
job = ResumableOutput(out, errors_path=err, fingerprint="squares-v1")
start = job.open()
for i in range(start, rows):
    if i % 13 == 0:
        job.write_error(json.dumps({"i": i, "error": "bad row"}).encode() + b"\\n")
    else:
        line = json.dumps({"i": i, "square": i * i}).encode() + b"\\n"
        job.write(line[: len(line) // 2])
        job.write(line[len(line) // 2 :])
    if (i + 1) % 7 == 0:
        job.commit(i + 1)
job.commit(rows)
job.close()
'''


def expected(rows: int) -> tuple[list[dict[str, int]], list[dict[str, object]]]:
    good = [{"i": i, "square": i * i} for i in range(rows) if i % 13]
    bad: list[dict[str, object]] = [{"i": i, "error": "bad row"} for i in range(rows) if i % 13 == 0]
    return good, bad


def _checkpoint_rows(path: Path) -> int:
    try:
        return int(json.loads(path.read_text())["rows"])
    except (FileNotFoundError, json.JSONDecodeError):
        return 0


def test_killed_at_random_points_every_row_lands_exactly_once(tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out, err = tmp_path / "out.jsonl", tmp_path / "errors.jsonl"
    checkpoint = tmp_path / "out.jsonl.checkpoint.json"
    rng = random.Random(2026)
    # Far from the end: a fast worker must still be running when its kill point comes.
    targets = sorted(rng.sample(range(50, ROWS // 2), 6))
    kills = 0
    for target in targets:
        proc = subprocess.Popen([sys.executable, str(script), str(out), str(err), str(ROWS)])
        try:
            deadline = time.monotonic() + DEADLINE_S
            # Wait for the worker to pass the target row (polling its progress), then kill it without warning.
            while _checkpoint_rows(checkpoint) < target and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.001)
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                kills += 1
        finally:
            proc.wait()
    assert kills >= 5, f"only {kills} of {len(targets)} runs were still going when their kill point came"
    assert not json.loads(checkpoint.read_text())["complete"]
    final = subprocess.run([sys.executable, str(script), str(out), str(err), str(ROWS)], check=False, timeout=120)
    assert final.returncode == 0
    good, bad = expected(ROWS)
    assert [json.loads(line) for line in out.read_text().splitlines()] == good
    assert [json.loads(line) for line in err.read_text().splitlines()] == bad
    state = json.loads(checkpoint.read_text())
    assert (state["rows"], state["complete"]) == (ROWS, True)
    assert (state["out_bytes"], state["err_bytes"]) == (os.path.getsize(out), os.path.getsize(err))


def test_an_uncommitted_tail_is_cut_back_and_redone(tmp_path: Path) -> None:
    out = tmp_path / "out.txt"
    job = ResumableOutput(out, fingerprint="f")
    assert job.open() == 0
    job.write(b"a\n")
    job.commit(1)
    job.write(b"b\n")  # never committed: a crash here loses it
    job.abandon()
    assert out.read_bytes() == b"a\nb\n"
    again = ResumableOutput(out, fingerprint="f")
    assert again.open() == 1
    assert out.read_bytes() == b"a\n"
    again.write(b"b\n")
    again.commit(2)
    again.close()
    assert again.complete
    assert out.read_bytes() == b"a\nb\n"


def test_close_refuses_uncommitted_rows_and_an_exception_leaves_the_job_resumable(tmp_path: Path) -> None:
    out = tmp_path / "out.txt"
    job = ResumableOutput(out, fingerprint="f")
    job.open()
    job.write(b"x\n")
    with pytest.raises(RuntimeError, match="commit them before close"):
        job.close()
    job.commit(1)
    job.close()
    def fails_after_a_write() -> None:
        with ResumableOutput(out, fingerprint="f") as resumed:
            assert resumed.rows_done == 1
            resumed.write(b"y\n")
            raise ZeroDivisionError

    with pytest.raises(ZeroDivisionError):
        fails_after_a_write()
    check = ResumableOutput(out, fingerprint="f")
    assert check.open() == 1
    assert out.read_bytes() == b"x\n"  # the row written before the exception was cut back
    check.abandon()


def test_another_jobs_checkpoint_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "out.txt"
    with ResumableOutput(out, fingerprint="job-a") as job:
        job.write(b"a\n")
        job.commit(1)
    with pytest.raises(CheckpointMismatch, match="fingerprint 'job-a'"):
        ResumableOutput(out, fingerprint="job-b").open()
