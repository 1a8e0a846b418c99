"""Running a user's script as ``python script.py`` would, for the tests of the README and the examples."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from triton_npu_client import default_model_repository
from triton_npu_client._local._server import temp_folder_prefix

# Runs a script as ``python script.py`` would, with LocalTriton's default repository narrowed to the folder in
# argv[1]: a server on all of server_models/ loads every model (several GPT-2 and MiniLM loads among them), which
# costs a script that uses two of them most of its run. The script's text is untouched.
_NARROWED = """
import runpy, sys
from pathlib import Path
import triton_npu_client._local._server as server
repository = Path(sys.argv[1])
server.default_model_repository = lambda: repository
sys.argv = sys.argv[2:]
sys.path.insert(0, str(Path(sys.argv[0]).resolve().parent))
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def repository_of(folder: Path, models: Sequence[str]) -> Path:
    """A model repository in ``folder`` holding links to these server_models/ models only."""
    folder.mkdir()
    for name in models:
        (folder / name).symlink_to(default_model_repository() / name, target_is_directory=True)
    return folder


def run_script(
    script: Path, cwd: Path, models: Sequence[str], *, env: Mapping[str, str] | None = None, timeout_s: float = 300
) -> tuple[int, str, str]:
    """Run ``script`` with this interpreter in ``cwd``, its LocalTriton() serving only ``models`` and ``env`` added
    to the environment; check it left no LocalTriton temp folder; return (code, out, err)."""
    repository = repository_of(cwd / "models", models)
    with subprocess.Popen(
        [sys.executable, "-c", _NARROWED, str(repository), str(script)],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    ) as proc:
        try:
            # A safety net only: each script starts at most one server and sends a handful of requests.
            out, err = proc.communicate(timeout=timeout_s)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    prefix = temp_folder_prefix(proc.pid)
    left = [p.name for p in Path(tempfile.gettempdir()).iterdir() if p.name.startswith(prefix)]
    assert left == [], f"{script.name} left temp folders behind: {left}"
    return proc.returncode, out, err
