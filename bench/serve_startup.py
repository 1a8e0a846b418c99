"""How long `triton-npu serve` takes to be ready and to stop, and what one stateful stub costs in memory.

    python bench/serve_startup.py [--runs 2] [--model-repository server_models]

Starts the CLI as a user would, times start -> the "Press Ctrl-C" line and SIGINT -> exit, and reads the
resident memory (VmRSS) of each seq_stats stub from /proc while the server is up. Prints one row per run.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time
from pathlib import Path


def stub_rss_mib(server_pid: int) -> dict[str, float]:
    """VmRSS of each Python-backend stub whose parent is ``server_pid``, by instance name."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            status = (entry / "status").read_text()
        except OSError:
            continue
        if not argv[0].endswith(b"triton_python_backend_stub") or f"PPid:\t{server_pid}\n" not in status:
            continue
        rss_kb = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))
        found[argv[8].decode()] = rss_kb / 1024  # argv[8]: the instance name, e.g. seq_stats_oldest_0_0
    return found


def one_run(repository: str | None) -> tuple[float, float, int, dict[str, float]]:
    args = [sys.executable, "-m", "triton_npu_client", "serve"]
    if repository:
        args += ["--model-repository", repository]
    started = time.monotonic()
    with subprocess.Popen(args, stdout=subprocess.PIPE, text=True) as proc:
        assert proc.stdout is not None
        pid = 0
        for line in proc.stdout:
            if line.startswith("tritonserver ready (pid"):
                pid = int(line.split("pid ")[1].split(",")[0])
            if "Ctrl-C" in line:
                break
        ready_s = time.monotonic() - started
        rss = stub_rss_mib(pid)
        stopping = time.monotonic()
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=60)
        return ready_s, time.monotonic() - stopping, code, rss


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--model-repository", default=None)
    ns = parser.parse_args()
    print(f"python bench/serve_startup.py --runs {ns.runs}\n")
    print("| run | ready s | SIGINT -> exit s | exit code | seq_stats stub RSS MiB |")
    print("|---|---|---|---|---|")
    for run in range(1, ns.runs + 1):
        ready_s, stop_s, code, rss = one_run(ns.model_repository)
        stubs = [f"{v:.0f}" for k, v in sorted(rss.items()) if k.startswith("seq_stats")]
        print(f"| {run} | {ready_s:.2f} | {stop_s:.2f} | {code} | {', '.join(stubs)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
