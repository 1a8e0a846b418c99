"""Project-level promises: the public namespace, the README commands, CI."""

from __future__ import annotations

import re
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
    import subprocess
    import sys

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
