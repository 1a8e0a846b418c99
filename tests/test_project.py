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
