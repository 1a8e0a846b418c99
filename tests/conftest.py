"""One real tritonserver for the whole test run, on free loopback ports.

No mock of Triton anywhere: every test that talks to a server talks to this one (or starts its own
through LocalTriton when it must kill or restart it).
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from triton_npu_client import LocalTriton
from triton_npu_client._local._server import temp_folder_prefix


def _launcher_temp_folders() -> set[str]:
    prefix = temp_folder_prefix()
    return {p.name for p in Path(tempfile.gettempdir()).iterdir() if p.name.startswith(prefix)}


@pytest.fixture(scope="session", autouse=True)
def no_launcher_temp_folder_left() -> Iterator[None]:
    """At the end of the run, no temp folder that LocalTriton made in this test process remains.

    Only this process's folders (the prefix carries its pid): other test runs on the machine may be
    starting servers at the same time. Tests that start servers in subprocesses check their own.
    """
    before = _launcher_temp_folders()
    yield
    left = sorted(_launcher_temp_folders() - before)
    assert left == [], f"LocalTriton temp folders outlived the test run in {tempfile.gettempdir()}: {left}"


@pytest.fixture(scope="session")
def triton_server() -> Iterator[LocalTriton]:
    """The session's server on server_models/; explicit model control so tests can unload and load."""
    server = LocalTriton(model_control_mode="explicit")
    with server:
        yield server
    assert server.processes() == [], "tritonserver or stub processes outlived the test run"
