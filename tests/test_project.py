"""Project-level promises: the public namespace, the README commands, CI."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import triton_npu_client

ROOT = Path(__file__).resolve().parent.parent


def test_all_is_sorted_and_complete() -> None:
    """__all__ is sorted, has no duplicates, and names only things that exist."""
    names = list(triton_npu_client.__all__)
    assert names == sorted(names)
    assert len(set(names)) == len(names)
    missing = [n for n in names if not hasattr(triton_npu_client, n)]
    assert missing == []
    public = {n for n in vars(triton_npu_client) if not n.startswith("_") and n not in {"annotations"}}
    modules = {n for n in public if type(getattr(triton_npu_client, n)).__name__ == "module"}
    assert public - modules - set(names) == set()


def test_ci_runs_the_readme_test_command() -> None:
    """.ci/run runs exactly the README's test command (the second bash block)."""
    blocks = re.findall(r"```bash\n(.*?)\n```", (ROOT / "README.md").read_text(), re.S)
    test_command = blocks[1].strip()
    assert "pytest" in test_command
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert test_command in ci_lines


def test_py_typed_shipped() -> None:
    """The package ships py.typed."""
    assert (Path(triton_npu_client.__file__).parent / "py.typed").is_file()


def test_server_toolkit_import_does_not_load_the_client() -> None:
    """`import triton_npu_client.server` (what model.py does inside the stub) loads no tritonclient or grpc."""
    code = (
        "import sys, triton_npu_client.server\n"
        "print(sorted(m for m in ('tritonclient', 'grpc', 'aiohttp', 'attrs') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]"


def test_lazy_names_resolve_to_their_modules() -> None:
    """Every lazily exported name resolves, and to an object defined in the module the map names."""
    for name, module in triton_npu_client._LAZY.items():
        value = getattr(triton_npu_client, name)
        assert value is getattr(__import__(f"triton_npu_client{module}", fromlist=[name]), name)
    assert set(triton_npu_client._LAZY) <= set(triton_npu_client.__all__)


def test_no_file_points_outside_the_project() -> None:
    """No tracked file cites a document that lives outside the repository (the project stands alone)."""
    # Spelled in pieces so that this file does not match itself.
    outside = ("TRITON" + "_FACTS", ".." + "/shared")
    listed = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True, timeout=60
    ).stdout.split("\0")
    offenders = []
    for name in filter(None, listed):
        path = ROOT / name
        if not path.is_file():  # deleted in the working tree, not yet in the index
            continue
        text = path.read_bytes().decode("utf-8", errors="replace")
        offenders += [f"{name}: {word}" for word in outside if word in text]
    assert offenders == []
    assert (ROOT / "docs" / "triton-facts.md").is_file()


def test_version_flag() -> None:
    """`triton-npu --version` (module and console script) prints the package version and exits 0."""
    expected = f"triton-npu {triton_npu_client.__version__}"
    script = Path(sys.executable).parent / "triton-npu"
    assert script.is_file(), "the triton-npu console script is not installed beside this interpreter"
    for cmd in ([sys.executable, "-m", "triton_npu_client", "--version"], [str(script), "--version"]):
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == expected
