"""The README's main job and the examples run against a real server and print what they claim."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_quickstart_main_job() -> None:
    """examples/quickstart.py (the README's main job) starts its own server, gets right answers, stops it."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "quickstart.py")], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "scale_fp32([0.0, 1.0, 2.0, 3.0]) = [0.0, 2.0, 4.0, 6.0]" in proc.stdout
    assert "refused before sending: input 'INPUT0': expected FP32, given float64" in proc.stdout
    assert "mean after 3 steps = [3.0, 4.0, 5.0, 6.0]" in proc.stdout
    assert proc.stdout.rstrip().endswith("server stopped")
