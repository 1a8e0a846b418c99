"""bench/chat_ttft.py, bench/chat_stub.py and bench/chat_threads.py run end to end on servers of their own (smoke runs:
the numbers are not asserted, only the tables' shape and that each figure is a number where one is promised)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STAGES = [
    "client → execute", "parse + template", "wait for the loop", "cancel check", "admit + prefill",
    "first step (sample + next token's forward)", "send queue", "send() → client",
]  # fmt: skip


def _run(args: list[str], timeout_s: float) -> str:
    proc = subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout_s, check=False
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_ttft_stages_come_from_the_servers_trace() -> None:
    """Both checkpoints get a table for turn 1 and the last turn; every stage is a figure, and those the server's
    marks bound from both sides (execute to the first response's send) are not negative."""
    out = _run(["bench/chat_ttft.py", "--quick"], timeout_s=600)
    tables = re.findall(r"^### (.+?): turn 1 .*? and turn 3 ", out, re.M)
    assert tables == ["GPT-2 demo", "tiny Llama (demo shape)"]
    for stage in STAGES:
        rows = re.findall(rf"^\| {re.escape(stage)} \| (-?[\d.]+) \| -?\d+% \| (-?[\d.]+) \| -?\d+% \|$", out, re.M)
        assert len(rows) == 2, stage
        if stage not in ("client → execute", "send() → client"):  # the two that compare the client's clock
            assert all(float(v) >= 0 for row in rows for v in row), (stage, rows)
    ttft = re.findall(r"^\| TTFT as the client saw it \(median\) \| ([\d.]+) \| \| ([\d.]+) \| \|$", out, re.M)
    assert len(ttft) == 2
    assert all(float(v) > 0 for row in ttft for v in row)


def test_stub_bench_reads_the_decode_thread_of_each_contender() -> None:
    out = _run(["bench/chat_stub.py", "--quick"], timeout_s=900)
    rows = re.findall(r"^\| ((?:in process|stub)[^|]*) \| ([\d.]+) \| ([\d.]+)x \|", out, re.M)
    labels = [label for label, _, _ in rows]
    assert labels[:4] == ["in process, on this thread", "in process, loop thread",
                          "in process, loop thread, 0.27 ms sends", "stub"]  # fmt: skip
    assert {"stub, glibc defaults", "stub, no overlap"} <= set(labels)
    assert all(float(cpu) > 0 for _, cpu, _ in rows)
    assert "bench/chat.py's engine-alone figure for the same turns" in out


def test_threads_bench_has_a_row_per_thread_count_and_policy() -> None:
    out = _run(["bench/chat_threads.py", "--quick"], timeout_s=600)
    rows = re.findall(r"^\| GPT-2 demo \| (\d) \| (unset|PASSIVE) \| ([\d.]+) \|", out, re.M)
    assert sorted((t, p) for t, p, _ in rows) == [("1", "PASSIVE"), ("1", "unset"), ("2", "PASSIVE"), ("2", "unset")]
    assert all(float(ms) > 0 for _, _, ms in rows)
