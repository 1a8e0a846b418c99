"""The benchmark scripts run end to end (smoke runs; their numbers are not asserted, only their shape)."""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from triton_npu_client import LocalTriton

ROOT = Path(__file__).resolve().parent.parent
PLAIN = "tritonclient.grpc.aio loop"
PERF_ANALYZER = "perf_analyzer (C++)"
THIS_CLIENT = (
    "this client (model.infer, default)",
    "this client (model.infer, no coalescing)",
    "this client (prebuilt request, no coalescing)",
)
THIS_CLIENT_SESSIONS = ("this client (streaming sessions, seq_stats_stream)", "this client (unary sessions)")


def _run(args: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout_s, check=False
    )


def test_client_vs_tritonclient_quick_on_its_own_server(tmp_path: Path) -> None:
    """--quick starts its own server and prints a row per contender and concurrency with positive throughput.

    One concurrency (every contender's code path is the same at 1 and at 4; the suite's time is not)."""
    out = tmp_path / "rows.json"
    args = ["bench/client_vs_tritonclient.py", "--quick", "--concurrency", "4", "--seconds", "0.5", "--json", str(out)]
    proc = _run(args, timeout_s=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    cells = {(r["contender"], r["concurrency"]) for r in rows}
    assert cells == {(c, 4) for c in (PLAIN, PERF_ANALYZER, *THIS_CLIENT)}
    assert all(r["infer_s"] > 0 and r["errors"] == 0 and r["avg_batch"] >= 1.0 for r in rows)
    # The printed table has the same rows, and says how it was run.
    table_rows = [line for line in proc.stdout.splitlines() if line.startswith(f"| {PLAIN}")]
    assert len(table_rows) == 1
    assert proc.stdout.startswith("python bench/client_vs_tritonclient.py --quick --concurrency 4 --seconds 0.5")


def test_sequences_quick(triton_server: LocalTriton, tmp_path: Path) -> None:
    """The sequence benchmark runs the plain loop, this client's sessions and perf_analyzer on seq_stats_oldest."""
    out = tmp_path / "rows.json"
    url = f"127.0.0.1:{triton_server.grpc_port}"
    args = ["bench/sequences.py", "--quick", "--seconds", "0.5", "--url", url, "--json", str(out)]
    proc = _run(args, timeout_s=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    expected = {(c, 16) for c in (PLAIN, PERF_ANALYZER, *THIS_CLIENT_SESSIONS)}
    assert {(r["contender"], r["concurrency"]) for r in rows} == expected
    bad = [r for r in rows if not (r["infer_s"] > 0 and r["errors"] == 0 and r["failure"] is None)]
    assert bad == [], proc.stderr[-3000:]
    # Sequences from 16 concurrent clients really batch on the server (oldest strategy).
    assert all(r["avg_batch"] > 1.0 for r in rows)


def test_table_prints_crashed_rows_without_ratios() -> None:
    """A failed contender's row reads "crashed", and no ratio is computed against or from it."""
    sys.path.insert(0, str(ROOT / "bench"))  # bench/ is a folder of scripts, not a package
    try:
        common = importlib.import_module("common")
    finally:
        sys.path.remove(str(ROOT / "bench"))
    Run, median_run, table = common.Run, common.median_run, common.table
    ok = Run(contender=PLAIN, concurrency=16, requests=100, seconds=1.0, latencies_s=(0.01,) * 100)
    crashed = Run.crashed("this client (streaming sessions)", 16, "ConnectError('stream broke')")
    # One crashed repeat makes the cell crashed: a median must not hide a failure.
    assert median_run([ok, crashed, ok]).failure is not None
    lines = table([ok, crashed]).splitlines()
    cells = [c.strip() for c in lines[3].strip("|").split("|")]
    assert cells[:3] == ["this client (streaming sessions)", "16", "crashed"]
    assert set(cells[3:]) == {"-"}
    assert [c.strip() for c in lines[2].strip("|").split("|")][-2] == "1.00x"


def test_chat_perf_analyzer_quick(triton_server: LocalTriton, tmp_path: Path) -> None:
    """perf_analyzer drives chat at concurrency 1 and 4: turns stream every token, no errors, commands printed."""
    out = tmp_path / "rows.json"
    url = f"127.0.0.1:{triton_server.grpc_port}"
    proc = _run(["bench/chat_perf_analyzer.py", "--quick", "--url", url, "--json", str(out)], timeout_s=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["concurrency"] for r in rows] == [1, 4]
    assert all(r["failure"] is None and r["errors"] == 0 and r["turns_s"] > 0 for r in rows)
    # --quick asks for 8 tokens per turn, one response each: perf_analyzer counted every streamed response.
    assert all(r["responses_per_turn"] == pytest.approx(8.0, rel=1e-3) for r in rows)
    assert all(r["first_p50_ms"] > 0 for r in rows)
    assert proc.stdout.count("--streaming") == 2
    assert sum(line.startswith("| 1 |") or line.startswith("| 4 |") for line in proc.stdout.splitlines()) == 2


def _device_check(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "bench/chat_device_check.py", *args],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=600,
        check=False,
    )  # fmt: skip


def test_chat_device_check_on_cpu() -> None:
    """On a CPU-only machine the chat device check picks the CPU, says it is a smoke check, passes its checks on
    the GPT-2 demo and a tiny Llama (paged cache, batched decode) and names the device."""
    proc = _device_check("--conversations", "3", "--tokens", "5", "--max-ctx", "256", "--families", "llama")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].endswith("-> cpu")
    assert "a smoke check" in lines[1]
    sections = [i for i, line in enumerate(lines) if line.startswith("== ")]
    assert [lines[i].split()[1] for i in sections] == ["GPT2", "Llama"]
    for at in sections:
        assert re.fullmatch(r"weights: \d+ tensors on cpu", lines[at + 1])
        # Per kv head, three conversations' blocks of 16 positions (256 each), keys and values of every layer.
        assert re.fullmatch(r"KV cache blocks \[\d+, 48, 16, \d+\] per layer: \d+ tensors on cpu", lines[at + 2])
    wanted = "engine on cpu (ref) vs argmax of a plain batched forward: equal (3 conversations x 5 tokens)"
    assert lines.count(wanted) == 2
    rows = [lines[i + 1].split() for i, line in enumerate(lines) if line.startswith("device ")]
    assert [row[:2] for row in rows] == [["cpu", "3"], ["cpu", "3"]]
    assert all(float(cell.replace(",", "")) > 0 for row in rows for cell in row[2:6])
    assert lines[-1] == "OK"


def test_chat_device_check_fails_for_an_absent_device() -> None:
    """Forcing a device this machine lacks is a failed check with a reason, never a silent fallback to CPU."""
    proc = _device_check("--device", "npu", "--conversations", "1", "--tokens", "1")
    assert proc.returncode == 2
    assert proc.stdout.startswith("FAIL: device 'npu' was forced")


def test_chat_bench_quick(triton_server: LocalTriton) -> None:
    """bench/chat.py prints its three server tables and the engine-alone table, with a ratio against each goal."""
    proc = _run(
        ["bench/chat.py", "--url", triton_server.grpc_url, "--repeats", "1", "--tokens", "8", "--chats", "4",
         "--turns", "3", "--no-cache"],
        timeout_s=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    for goal in ("goal <= 1.3x", "goal >= 8x", "goal >= 5x"):
        assert re.search(rf"\*\*[\d.]+x[^*]*\*\* \({goal}: (met|NOT met)\)", out), goal
    assert "## The engine alone, in process" in out
    # Every measured figure is a positive number.
    figures = [float(m) for m in re.findall(r"\| ([\d.]+) \| [\d., ]+ \|", out)]
    assert len(figures) >= 6
    assert all(f > 0 for f in figures)


def test_score_bench_quick(triton_server: LocalTriton) -> None:
    """bench/score.py --quick prints its three tables with positive figures (numbers not asserted)."""
    args = ["bench/score.py", "--quick", "--models", "scale_fp32", "--url", triton_server.grpc_url]
    proc = _run(args, timeout_s=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    row = re.search(r"^\| scale_fp32 \| 64 \| 2,000 \| ([\d,]+) \(2\) \| ([\d,]+) \| \*\*([\d.]+)x\*\*", out, re.M)
    assert row is not None, out
    assert all(float(v.replace(",", "")) > 0 for v in row.groups())
    for fmt in ("npy",):
        assert re.search(rf"^\| \.{fmt} \| now \| [\d.]+ MiB \| [\d.]+ MiB \| \*\*[\d.]+x\*\* \|$", out, re.M), out
    assert re.search(r"^\| 4 \| [\d,.]+ \| [\d,.]+ \| [\d,]+ \| [\d,]+ \| \*\*[\d.]+x\*\* \|$", out, re.M), out


def test_chat_cache_bench_figures_and_verdicts(tmp_path: Path) -> None:
    """bench/chat_cache.py without a server: the slot formula is b1a3b0a's, the length mix has its mean, the
    generated entries take the parameters, and a ratio under its goal reads NOT met (bench/chat.py --no-cache
    keeps its own smoke run off these sections: a full run starts a server of four chat models)."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        cc = importlib.import_module("chat_cache")
    finally:
        sys.path.remove(str(ROOT / "bench"))
    import numpy as np

    from triton_npu_client import write_chat_model

    # b1a3b0a's kv_bytes_per_position for GPT-2: 2 * n_layer * n_embd * element size (float32).
    assert cc.kv_bytes_per_position(cc.DEMO) == 2 * 4 * 192 * 4
    # 128 MiB of 1,536-position slots of 6,144 bytes a position: 14 conversations; max_sequences caps too.
    assert cc.slot_capacity(128, 1536, 6144, 1024) == 14
    assert cc.slot_capacity(128, 1536, 6144, 3) == 3
    lengths = cc.length_mix(4000, np.random.default_rng(0), 4096)
    assert min(lengths) >= cc.MIN_TOKENS
    assert max(lengths) <= 4096
    assert 180 <= sum(lengths) / len(lengths) <= 220

    name = write_chat_model(tmp_path, cc.DEMO, name="entry", max_cache_mb=64)
    config = tmp_path / name / "config.pbtxt"
    cc.set_parameters(config, share_prefixes="false", evict_min_idle_ms="-1")
    text = config.read_text()
    assert 'parameters { key: "evict_min_idle_ms" value: { string_value: "-1" } }' in text
    assert 'parameters { key: "share_prefixes" value: { string_value: "false" } }' in text
    assert text.count('key: "evict_min_idle_ms"') == 1

    subject = cc.Subject(
        label="demo", folder=cc.DEMO, max_ctx=1536, cache_mb=128, bytes_per_position=6144, max_sequences=1024,
        shared="on", unshared="off",
    )  # fmt: skip
    held = cc.Capacity(
        held=50, live=50, kv_bytes=1, positions=10_000, lengths=[200] * 50, cut_short=0, refused=cc.FULL + ": more"
    )
    fast, slow = cc.Opening(ttft_s=0.1, prompt_tokens=30), cc.Opening(ttft_s=0.4, prompt_tokens=530)
    ttft = cc.Ttft(shared=[cc.Round([fast, fast], 0.1)], unshared=[cc.Round([slow, slow], 0.4)], system_tokens=500)
    res = cc.Results([subject], capacity={"demo": held}, ttft={"demo": ttft})
    args = cc.parse(["--quick"])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        cc.print_capacity(res)
        cc.print_ttft(args, res)
    printed = out.getvalue()
    assert "demo: paged vs the slot design: **3.6x** (goal >= 4x: NOT met)" in printed
    assert "demo: shared vs not: **4.0x faster** (goal >= 5x: NOT met); by the stub's CPU: 4.0x" in printed
