"""Check the server toolkit on an accelerator: device choice, state on the device, batched steps vs CPU.

Run from the repository root with only torch and numpy installed (no tritonclient, no Triton)::

    PYTHONPATH=. python bench/device_check.py [--sequences 10000] [--steps 50] [--batch 1024]

It picks the device the way a model instance would (NPU, else CUDA, else CPU), asserts the state
tensors live there, runs the same random interleaved steps on that device, on CPU (torch) and in numpy
(NumpyMoments, what CPU-only instances use), compares the statistics (allclose), prints a table
(device, sequences, steps/s) and exits non-zero on a mismatch.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
import time
import types
from pathlib import Path
from typing import Any

import numpy as np
import torch


def import_toolkit() -> Any:
    """``triton_npu_client.server`` without running the client package's ``__init__`` (no tritonclient here)."""
    if "triton_npu_client" not in sys.modules:
        spec = importlib.util.find_spec("triton_npu_client")
        locations = list(spec.submodule_search_locations or []) if spec else []
        if not locations:  # not installed and not on PYTHONPATH: fall back to this checkout
            locations = [str(Path(__file__).resolve().parent.parent / "triton_npu_client")]
        parent = types.ModuleType("triton_npu_client")
        parent.__path__ = locations
        sys.modules["triton_npu_client"] = parent
    return importlib.import_module("triton_npu_client.server")


def run(
    tk: Any, device: torch.device | None, *, sequences: int, steps: int, batch: int, dim: int, seed: int
) -> tuple[Any, float, int]:
    """Drive SequenceSlots + RunningMoments (NumpyMoments when ``device`` is None) like an execute loop.

    Returns (final state on host, seconds, steps).
    """
    rng = np.random.default_rng(seed)
    slots = tk.SequenceSlots(capacity=sequences, idle_timeout_s=1e9)
    if device is None:
        moments = tk.NumpyMoments(capacity=sequences, dim=dim)
    else:
        moments = tk.RunningMoments(capacity=sequences, dim=dim, device=device)
        assert moments.mean.device == device, f"state on {moments.mean.device}, expected {device}"
    done = np.zeros(sequences, dtype=np.int64)
    total = 0
    elapsed = 0.0
    for _ in range(steps * sequences // batch):
        chosen = rng.choice(sequences, size=batch, replace=False)
        controls = [tk.SequenceControls(correlation_id=int(i) + 1, start=bool(done[i] == 0)) for i in chosen]
        x = torch.from_numpy(rng.normal(size=(batch, dim)).astype(np.float32))
        t0 = time.perf_counter()
        plan = slots.plan(controls)
        if device is None:
            _, mean, _ = moments.step(np.array(plan.slots), x.numpy(), np.array(plan.fresh))
        else:
            idx = torch.tensor(plan.slots, dtype=torch.int64, device=device)
            fresh = torch.tensor(plan.fresh, dtype=torch.bool, device=device)
            _, mean, _ = moments.step(idx, x.to(device), fresh)
        tk.to_host(mean)  # the model copies outputs back to host on every execute
        elapsed += time.perf_counter() - t0
        done[chosen] += 1
        total += batch
    order = np.array([slots.slot_of(i + 1) if (i + 1) in slots else -1 for i in range(sequences)])
    live = order >= 0
    state = {
        "count": tk.to_host(moments.count)[order[live]],
        "mean": tk.to_host(moments.mean)[order[live]],
        "var": (tk.to_host(moments.m2) / np.maximum(tk.to_host(moments.count), 1)[:, None])[order[live]],
    }
    return state, elapsed, total


def compare(name: str, got: Any, ref: Any) -> bool:
    """Print and return whether ``got`` matches the torch-CPU reference ``ref`` (allclose per statistic)."""
    ok = True
    for key in ("count", "mean", "var"):
        same = bool(np.allclose(got[key], ref[key], rtol=1e-4, atol=1e-4))
        worst = float(np.max(np.abs(got[key] - ref[key]))) if got[key].size else 0.0
        print(f"{name:8s} {key:5s} allclose={same} max|diff|={worst:.3g}")
        ok &= same
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=10_000)
    parser.add_argument("--steps", type=int, default=50, help="average steps per sequence")
    parser.add_argument("--batch", type=int, default=1024, help="requests per execute")
    parser.add_argument("--dim", type=int, default=4)
    args = parser.parse_args()

    tk = import_toolkit()
    assert "tritonclient" not in sys.modules, "the toolkit pulled in tritonclient"
    available = tk.probe_accelerators()
    choice = tk.choose_device(available=available, instance=0)
    device = tk.activate(choice, cpu_threads=None)
    print(f"accelerators: {available}; chosen: {choice} -> {device}")
    if torch.cuda.is_available() and choice.kind != "cuda" and available.npu == 0:
        print("FAIL: CUDA is available but device choice did not pick it")
        return 1

    kw = dict(sequences=args.sequences, steps=args.steps, batch=args.batch, dim=args.dim, seed=1)
    rows = []
    ref, t_cpu, n_cpu = run(tk, torch.device("cpu"), **kw)
    rows.append(("cpu", args.sequences, n_cpu / t_cpu))
    ok = True
    got, t_np, n_np = run(tk, None, **kw)
    rows.append(("numpy", args.sequences, n_np / t_np))
    ok &= compare("numpy", got, ref)
    if device.type != "cpu":
        run(tk, device, **{**kw, "steps": 2})  # warm-up: kernels, allocator
        got, t_dev, n_dev = run(tk, device, **kw)
        if device.type == "cuda":
            torch.cuda.synchronize()
        rows.append((str(device), args.sequences, n_dev / t_dev))
        ok &= compare(str(device), got, ref)
    print(f"\n{'device':10s} {'sequences':>10s} {'steps/s':>14s}   (batch {args.batch}, dim {args.dim})")
    for name, seqs, rate in rows:
        print(f"{name:10s} {seqs:>10d} {rate:>14,.0f}")
    print("OK" if ok else "FAIL: device or numpy results differ from torch CPU")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
