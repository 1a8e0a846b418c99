"""The benchmark scripts run end to end (smoke runs; their numbers are not asserted, only their shape)."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

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
    """--quick starts its own server and prints a row per contender and concurrency with positive throughput."""
    out = tmp_path / "rows.json"
    proc = _run(["bench/client_vs_tritonclient.py", "--quick", "--json", str(out)], timeout_s=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    cells = {(r["contender"], r["concurrency"]) for r in rows}
    assert cells == {(c, n) for c in (PLAIN, PERF_ANALYZER, *THIS_CLIENT) for n in (1, 4)}
    assert all(r["infer_s"] > 0 and r["errors"] == 0 and r["avg_batch"] >= 1.0 for r in rows)
    # The printed table has the same rows, and says how it was run.
    table_rows = [line for line in proc.stdout.splitlines() if line.startswith(f"| {PLAIN}")]
    assert len(table_rows) == 2
    assert proc.stdout.startswith("python bench/client_vs_tritonclient.py --quick")


def test_sequences_quick(triton_server: LocalTriton, tmp_path: Path) -> None:
    """The sequence benchmark runs the plain loop, this client's sessions and perf_analyzer on seq_stats_oldest."""
    out = tmp_path / "rows.json"
    url = f"127.0.0.1:{triton_server.grpc_port}"
    proc = _run(["bench/sequences.py", "--quick", "--url", url, "--json", str(out)], timeout_s=180)
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
