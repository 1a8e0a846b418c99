"""The built wheel, installed the way a user installs it (not editable), serves the bundled models."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import triton_npu_client

ROOT = Path(__file__).resolve().parent.parent
# What a build needs from a checkout; the copy keeps build/ and *.egg-info out of the working tree.
BUILD_INPUTS = ("pyproject.toml", "setup.py", "README.md", "triton_npu_client", "server_models")

# Runs with only the installed wheel importable as triton_npu_client (cwd is not the checkout).
PROBE = """
import json, sys, urllib.request
from pathlib import Path
import triton_npu_client
from triton_npu_client import LocalTriton, default_model_repository

repo = default_model_repository()
facts = {
    "package": triton_npu_client.__file__,
    "models": str(repo),
    # pip byte-compiles every .py it installs, model.py files included: those caches are not shipped files.
    "files": sorted(
        str(p.relative_to(repo)) for p in repo.rglob("*") if p.is_file() and "__pycache__" not in p.parts
    ),
}
with LocalTriton() as server:
    facts["served"] = str(server.model_repository)
    with urllib.request.urlopen(f"{server.http_url}/v2/models/scale_fp32/ready", timeout=10) as resp:
        facts["scale_fp32_ready"] = resp.status
    request = urllib.request.Request(f"{server.http_url}/v2/repository/index", data=b"{}", method="POST")
    with urllib.request.urlopen(request, timeout=10) as resp:
        facts["index"] = {m["name"]: m.get("state") for m in json.loads(resp.read())}
facts["left"] = server.processes()
facts["folder_left"] = server.log_path.parent.exists()
print(json.dumps(facts))
"""


def _model_files(repo: Path) -> list[str]:
    return sorted(str(p.relative_to(repo)) for p in repo.rglob("*") if p.is_file() and "__pycache__" not in p.parts)


def _run(cmd: list[str], *, cwd: Path | None = None, pythonpath: Path | None = None) -> str:
    """Run ``cmd`` offline with only ``pythonpath`` added to the import path; return its stdout."""
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INDEX="1")
    env.pop("PYTHONPATH", None)
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def test_wheel_install_serves_the_bundled_models(tmp_path: Path) -> None:
    """Built and installed with pip (not editable), LocalTriton() with no argument serves the shipped models."""
    src = tmp_path / "src"
    for name in BUILD_INPUTS:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            src.mkdir(exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    python = sys.executable
    _run([python, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"), str(src)])
    [wheel] = (tmp_path / "dist").glob("triton_npu_client-*.whl")
    site = tmp_path / "site"
    _run([python, "-m", "pip", "install", "--no-deps", "--target", str(site), str(wheel)])

    out = _run([python, "-c", PROBE], cwd=tmp_path, pythonpath=site)
    facts = json.loads(out.strip().splitlines()[-1])

    assert Path(facts["package"]).is_relative_to(site)
    shipped = Path(facts["models"])
    assert shipped == site / "triton_npu_client" / "server_models"
    assert Path(facts["served"]) == shipped
    # Every file of every model folder in the checkout, and nothing else.
    assert facts["files"] == _model_files(ROOT / "server_models")
    source_models = sorted(p.parent.name for p in (ROOT / "server_models").glob("*/config.pbtxt"))
    assert sorted(facts["index"]) == source_models
    assert set(facts["index"].values()) == {"READY"}
    assert facts["scale_fp32_ready"] == 200
    assert facts["left"] == []
    assert facts["folder_left"] is False

    # The wheel's console script runs from the installed copy too.
    script = site / "bin" / "triton-npu"
    version = _run([str(script), "--version"], cwd=tmp_path, pythonpath=site)
    assert version.split() == ["triton-npu", triton_npu_client.__version__]
