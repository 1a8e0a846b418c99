"""One real tritonserver for the whole test run, on free loopback ports.

No mock of Triton anywhere: every test that talks to a server talks to this one (or starts its own
through LocalTriton when it must kill or restart it).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from triton_npu_client import LocalTriton


@pytest.fixture(scope="session")
def triton_server() -> Iterator[LocalTriton]:
    """The session's server on server_models/; explicit model control so tests can unload and load."""
    server = LocalTriton(model_control_mode="explicit")
    with server:
        yield server
    assert server.processes() == [], "tritonserver or stub processes outlived the test run"
