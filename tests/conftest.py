"""One real tritonserver for the whole test run, on free loopback ports.

No mock of Triton anywhere: every test that talks to a server talks to this one (or starts its own
through LocalTriton when it must kill or restart it).

Randomised tests take their seed from the ``seed`` fixture: a fixed default per test, or ``TNC_SEED`` from the
environment for all of them (``TNC_SEED=123 .venv/bin/pytest tests/test_sequence_acceptance.py``). The seed
used is printed, so a failure's captured output says how to re-run it.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
from openai import AsyncOpenAI

from triton_npu_client import Client, LocalTriton
from triton_npu_client._gateway import OpenAIGateway
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
    """The session's server on server_models/; explicit model control so tests can unload and load.

    Stopped without a grace period (SIGKILL, the launcher then removes what the stubs left): a graceful stop
    waits seconds for Triton's once-a-second shutdown poll, and tests/test_local.py is where stopping is tested.
    """
    server = LocalTriton(model_control_mode="explicit", stop_grace_s=0)
    with server:
        yield server
    assert server.processes() == [], "tritonserver or stub processes outlived the test run"


SEED_ENV = "TNC_SEED"


def pytest_report_header() -> str | None:
    value = os.environ.get(SEED_ENV)
    return f"{SEED_ENV}={value}: randomised tests use this seed instead of their defaults" if value else None


@pytest.fixture
def seed(request: pytest.FixtureRequest) -> Callable[[int], int]:
    """``seed(default)``: the seed a randomised test uses (``TNC_SEED`` if set, else ``default``), printed."""

    def choose(default: int) -> int:
        raw = os.environ.get(SEED_ENV, "")
        try:
            value = int(raw) if raw else default
        except ValueError:
            raise pytest.UsageError(f"{SEED_ENV} must be an integer, got {raw!r}") from None
        print(f"{request.node.nodeid}: seed {value} (re-run with {SEED_ENV}={value})")
        request.node.user_properties.append(("seed", value))
        return value

    return choose


# -- the OpenAI gateway's test files: a client of the session's server, an embedded gateway on it, openai on that ---


@pytest.fixture
async def client(triton_server: LocalTriton) -> AsyncIterator[Client]:
    """A client of the session's server (a test file may define its own)."""
    async with Client(triton_server.grpc_url, timeout_s=120) as c:
        yield c


@pytest.fixture
async def gateway(client: Client) -> AsyncIterator[OpenAIGateway]:
    """The OpenAI gateway embedded in the test's event loop, on a free loopback port."""
    async with OpenAIGateway(client, port=0) as gw:
        yield gw


@pytest.fixture
async def oa(gateway: OpenAIGateway) -> AsyncIterator[AsyncOpenAI]:
    """The real openai client on the gateway."""
    async with AsyncOpenAI(base_url=gateway.base_url, api_key="unused", max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def chat_only_server() -> Iterator[LocalTriton]:
    """A server of the test file's own with only the chat model, for perf_analyzer's chat runs.

    perf_analyzer 2.38 hung at concurrency 4 on the session server's ``chat`` in two fresh-clone suite runs (its
    worker waiting in WaitForOngoingRequests, the server reporting every request answered and none pending), after
    the rest of that worker's files had used the server; alone it never did. The cause is not found; a server that
    nothing else has used keeps perf_analyzer's run from whatever state the others leave.
    """
    server = LocalTriton(model_control_mode="explicit", load_models=["chat"], stop_grace_s=0)
    with server:
        yield server
    assert server.processes() == []
