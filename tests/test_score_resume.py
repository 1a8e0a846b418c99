"""`triton-npu score` SIGKILLed at random points and re-run: the output equals an uninterrupted run, byte for byte.

The job runs as a real subprocess against the session's server (``score_probe``: requests sleep a few ms, so the job
lasts a second or two), committing every 50 ms; the test kills it when its output file has grown past a random
share of the final size, so kills land before, between and just after commits.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from triton_npu_client import LocalTriton

pytestmark = pytest.mark.slow


def command(server: LocalTriton, source: Path, output: Path) -> list[str]:
    return [
        sys.executable, "-m", "triton_npu_client", "score", "--url", server.grpc_url, "--model", "score_probe",
        "--input", str(source), "--output", str(output), "--concurrency", "4", "--batch-size", "8",
        "--commit-every", "0.05", "--no-progress", "--max-failed", "100%",  # the bad rows are on purpose
        "--keep-checkpoint",  # a run that finished before its kill leaves a job the next runs recognise
    ]


def write_source(path: Path, n: int) -> None:
    rng = random.Random(7)
    lines = []
    for i in range(n):
        if i % 97 == 13:
            lines.append("{broken")  # a parse error: an error row
        elif i % 89 == 5:
            lines.append(json.dumps({"X": [-1.0, 1.0]}))  # refused by the model: an error row
        else:
            lines.append(json.dumps({"X": [float(i), rng.uniform(0, 25)]}))
    path.write_text("\n".join(lines) + "\n")


def size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def test_killed_at_random_points_the_rerun_equals_an_uninterrupted_run(
    triton_server: LocalTriton, tmp_path: Path
) -> None:
    source = tmp_path / "rows.jsonl"
    write_source(source, 1200)
    reference = tmp_path / "reference.jsonl"
    subprocess.run(command(triton_server, source, reference), check=True, capture_output=True, timeout=300)
    final_size = size(reference)
    ref_errors = Path(f"{reference}.errors.jsonl").read_bytes()
    assert final_size > 0
    assert ref_errors

    output = tmp_path / "out.jsonl"
    rng = random.Random(int.from_bytes(os.urandom(4), "big"))
    points = sorted(rng.uniform(0.02, 0.97) for _ in range(6))
    killed = 0
    resumed_sizes = []
    for share in points:
        proc = subprocess.Popen(command(triton_server, source, output), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)
        deadline = time.monotonic() + 120
        while size(output) < share * final_size and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.002)  # polling the file's size: the kill point, not a race to wait out
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
        if proc.returncode == -signal.SIGKILL:
            killed += 1
        resumed_sizes.append(size(output))
    assert killed >= 5, f"only {killed} of {len(points)} runs were killed before finishing"
    done = subprocess.run(command(triton_server, source, output), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert output.read_bytes() == reference.read_bytes()
    assert Path(f"{output}.errors.jsonl").read_bytes() == ref_errors
    # The kills really interrupted a growing file, and later runs resumed rather than started over.
    assert max(resumed_sizes) > 0
    assert "resumed after" in done.stdout


def test_cli_without_url_starts_its_own_server_and_writes_npy(tmp_path: Path) -> None:
    """CSV in, .npy out, through an embedded server holding only the model; the summary goes to stdout."""
    source = tmp_path / "rows.csv"
    source.write_text("X\n" + "".join(f'"[{i}.0, 0.0]"\n' for i in range(30)) + '"[-1.0, 0.0]"\n')
    output = tmp_path / "y.npy"
    done = subprocess.run(
        [sys.executable, "-m", "triton_npu_client", "score", "--model", "score_probe", "--input", str(source),
         "--output", str(output), "--batch-size", "4", "--max-failed", "1"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "30 ok, 1 failed" in done.stdout
    y = np.load(output)
    assert y.shape == (31, 1)
    np.testing.assert_array_equal(y[:30, 0], 3.0 * np.arange(30, dtype=np.float32))
    assert np.isnan(y[30, 0])  # the refused row keeps its place, as NaN
    errors = [json.loads(line) for line in Path(f"{output}.errors.jsonl").read_text().splitlines()]
    assert [e["row"] for e in errors] == [30]


def test_cli_unknown_model_is_one_line_exit_18(tmp_path: Path) -> None:
    (tmp_path / "x.jsonl").write_text('{"X": [1.0, 0.0]}\n')
    done = subprocess.run(
        [sys.executable, "-m", "triton_npu_client", "score", "--model", "no_such_model", "--input",
         str(tmp_path / "x.jsonl"), "--output", str(tmp_path / "y.jsonl")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 18
    assert len(done.stderr.splitlines()) == 1
    assert "no_such_model" in done.stderr
    assert "Traceback" not in done.stderr
