"""The step loop's opt-in timing trace (``server/_timing.py``), its ``overlap_sends`` switch, and the host settings a
chat instance takes (``cpu_threads``, glibc's thresholds): pure unit tests, fake senders, no Triton.

The trace's marks are what bench/chat_ttft.py reads; that benchmark runs them inside a real Triton (test_bench.py).
The threaded test waits for events, never for time.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from test_server_toolkit_generate import DEADLINE_S, FINAL, FakeClock, FakeSender, Job, Model

from triton_npu_client.server import StepLoop
from triton_npu_client.server._device import cpu_instances, cpu_thread_count
from triton_npu_client.server._timing import TRACE_ENV, StepTrace

# Every request record's marks, in the order a request reaches them.
ORDER = ["taken", "admit_start", "admit_end", "step_end", "queued", "send_start", "send_end", "final_end"]


def records(path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return [r for r in lines if r["kind"] == "request"], [r for r in lines if r["kind"] == "pass"]


def test_without_the_variable_nothing_is_traced(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TRACE_ENV, raising=False)
    assert StepTrace.from_env("m_0_0") is None
    monkeypatch.setenv(TRACE_ENV, "")
    assert StepTrace.from_env("m_0_0") is None


def test_a_request_is_marked_in_order_and_written_at_its_final(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Driven pass by pass (no send thread): each request's record holds every mark once, in the order of its way
    through the loop, and is written when its FINAL has gone; each pass that worked is one line, written when the
    loop has nothing running."""
    path = tmp_path / "trace.jsonl"
    monkeypatch.setenv(TRACE_ENV, str(path))
    trace = StepTrace.from_env("m_0_0")
    assert trace is not None
    model = Model()
    loop: StepLoop[Job] = StepLoop(
        step=model.step, admit=model.admit, on_exit=model.on_exit, final_flag=FINAL,
        error_response=lambda m: ("error", m), clock=FakeClock(), start=False, trace=trace,
    )  # fmt: skip
    senders = {key: FakeSender() for key in (7, 8)}
    for key, sender in senders.items():
        trace.request(sender, key, execute=trace.clock(), parsed=trace.clock())
        assert loop.submit(key, sender, Job(3 if key == 7 else 1)) is None
        trace.mark(sender, "submitted")
    passes = 0
    while not all(s.final.is_set() for s in senders.values()):
        loop.run_pass()
        passes += 1
        if passes == 1:
            # Key 8's one piece ended it in the first pass; key 7 still runs, so no pass line is out yet.
            done, pass_lines = records(path)
            assert [r["key"] for r in done] == [8]
            assert pass_lines == []
    done, pass_lines = records(path)
    assert sorted(r["key"] for r in done) == [7, 8]
    for record in done:
        assert record["instance"] == "m_0_0"
        assert record["pid"] == os.getpid()
        times = [record["execute"], record["parsed"], record["submitted"], *(record[m] for m in ORDER)]
        assert times == sorted(times), record
    assert [r["serial"] for r in sorted(done, key=lambda r: r["key"])] == [1, 2]
    # Both were admitted in the first pass, and stepped in it; then key 7 alone.
    assert [(p["admitted"], p["stepped"]) for p in pass_lines] == [(2, 2), (0, 1), (0, 1)]
    assert all(p["end"] >= p["start"] and p["cpu_s"] >= 0 for p in pass_lines)


def test_the_send_thread_marks_the_first_response(tmp_path: Path) -> None:
    """With the send thread, ``send_start``/``send_end`` are the first response's; the record is written after
    the FINAL, from the send thread."""
    path = tmp_path / "trace.jsonl"
    trace = StepTrace(str(path), instance="m_0_1")
    model = Model()
    loop: StepLoop[Job] = StepLoop(
        step=model.step, admit=model.admit, on_exit=model.on_exit, final_flag=FINAL,
        error_response=lambda m: ("error", m), trace=trace,
    )  # fmt: skip
    sender = FakeSender()
    try:
        trace.request(sender, 3, execute=trace.clock(), parsed=trace.clock())
        assert loop.submit(3, sender, Job(4)) is None
        assert sender.final.wait(DEADLINE_S)
    finally:
        loop.close(timeout_s=DEADLINE_S)
    (record,), _ = records(path)
    assert record["key"] == 3
    assert record["step_end"] <= record["send_start"] <= record["send_end"] <= record["final_end"]
    assert sender.responses[0] == (3, 1)


class RecordingOutbox:
    """Stands in for the send thread: records how far each pass waits for it to drain."""

    def __init__(self) -> None:
        self.limits: list[int] = []

    def wait_below(self, limit: int) -> None:
        self.limits.append(limit)

    def put_many(self, items: Any) -> None:
        for stream, response, flags in items:
            stream.sender.send(response, flags=flags)

    def put(self, stream: Any, response: Any, flags: int) -> None:
        stream.sender.send(response, flags=flags)

    def close(self, timeout_s: float) -> None:
        pass


@pytest.mark.parametrize(("overlap", "expected"), [(True, [1, 3, 3]), (False, [1, 1, 1])])
def test_without_overlap_a_pass_waits_for_the_send_thread_to_be_idle(overlap: bool, expected: list[int]) -> None:
    """``overlap_sends=False``: every pass first waits until nothing is queued (limit 1), so the send thread touches
    no Python while the pass computes; by default a pass may start with up to a pass of responses still queued."""
    model = Model()
    loop: StepLoop[Job] = StepLoop(
        step=model.step, admit=model.admit, on_exit=model.on_exit, final_flag=FINAL,
        error_response=lambda m: ("error", m), clock=FakeClock(), start=False, overlap_sends=overlap,
    )  # fmt: skip
    outbox = RecordingOutbox()
    loop._outbox = outbox  # type: ignore[assignment]  # the loop's send thread, replaced by the recorder
    senders = [FakeSender(), FakeSender()]
    for key, sender in enumerate(senders, start=1):
        assert loop.submit(key, sender, Job(3)) is None
    for _ in range(3):
        loop.run_pass()
    assert outbox.limits == expected
    assert [s.responses for s in senders] == [[(1, 1), (1, 2), (1, 3)], [(2, 1), (2, 2), (2, 3)]]


# -- cpu_threads and the host allocator -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "instances", "cores", "expected"),
    [
        ("auto", 1, 2, 1),  # one core is left to Triton's threads, the send thread and a local client
        (None, 1, 8, 7),
        ("AUTO ", 2, 9, 4),  # two instances of the model share the cores
        ("auto", 3, 2, 1),  # never fewer than one
        ("auto", 1, 1, 1),
        ("3", 1, 2, 3),  # a number is taken as it is, even above the cores
        (" 1", 4, 64, 1),
    ],
)
def test_cpu_thread_count(value: str | None, instances: int, cores: int, expected: int) -> None:
    assert cpu_thread_count(value, instances=instances, cores=cores) == expected


def test_auto_counts_the_cores_this_process_may_run_on() -> None:
    assert cpu_thread_count("auto") == max(len(os.sched_getaffinity(0)) - 1, 1)


@pytest.mark.parametrize("value", ["0", "-2", "two", "1.5", ""])
def test_a_bad_cpu_threads_parameter_is_refused(value: str) -> None:
    if value == "":
        assert cpu_thread_count(value, cores=3) == 2  # empty is "not given": auto
        return
    with pytest.raises(ValueError, match="parameter cpu_threads must be 'auto' or a positive integer"):
        cpu_thread_count(value)


def test_cpu_instances_counts_the_host_groups() -> None:
    assert cpu_instances({}) == 1
    assert cpu_instances({"instance_group": [{"kind": "KIND_CPU", "count": 3}]}) == 3
    groups = [{"kind": "KIND_CPU", "count": 2}, {"kind": "KIND_GPU", "count": 4}, {"kind": "KIND_MODEL"}]
    assert cpu_instances({"instance_group": groups}) == 3


def test_glibc_takes_the_fixed_thresholds() -> None:
    """mallopt accepts both values on this (glibc) machine: a threshold above glibc's limit would be refused.

    In a fresh interpreter: mallopt is not thread-safe, and this process has gRPC threads that allocate.
    """
    import subprocess
    import sys

    code = (
        "from triton_npu_client.server._device import keep_freed_memory\n"
        "print(keep_freed_memory(), keep_freed_memory())\n"  # and again: a second model in the same process
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", "True"]
