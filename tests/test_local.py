"""The launcher: start, readiness, stop, no orphans, and each startup error."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from _procs import living

import triton_npu_client as tnc
from triton_npu_client import cli
from triton_npu_client._local import _server as _local


def _write_model(repo: Path, name: str, body: str) -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text(
        textwrap.dedent(
            f"""
            name: "{name}"
            backend: "python"
            max_batch_size: 8
            input [ {{ name: "X" data_type: TYPE_FP32 dims: [ 1 ] }} ]
            output [ {{ name: "Y" data_type: TYPE_FP32 dims: [ 1 ] }} ]
            instance_group [ {{ kind: KIND_CPU count: 1 }} ]
            """
        )
    )
    (repo / name / "1" / "model.py").write_text(textwrap.dedent(body))


GOOD_MODEL = """
import triton_python_backend_utils as pb_utils
class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "X").as_numpy()
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x)]))
        return out
"""
BAD_MODEL = """
class TritonPythonModel:
    def initialize(self, args):
        raise RuntimeError("this model refuses to load")
"""
# Models that keep the server from exiting on SIGTERM: only SIGKILL ends them within a test's time.
SLOW_LOAD_MODEL = """
import time
class TritonPythonModel:
    def initialize(self, args):
        time.sleep(600)
    def execute(self, requests):
        return []
"""
SLOW_UNLOAD_MODEL = """
import time
import triton_python_backend_utils as pb_utils
class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "X").as_numpy()
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x)]))
        return out
    def finalize(self):
        time.sleep(600)
"""
# The longest pause the event loop may take while the launcher stops a server; stopping itself takes
# several times longer in these tests, so code that blocks the loop on it cannot stay below.
MAX_LOOP_GAP_S = 0.5


class _Ticker:
    """Ticks on the running loop every 10 ms and records the largest gap between two ticks."""

    def __init__(self) -> None:
        self.max_gap = 0.0
        self.ticks = 0
        self._ticked = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(0.01)
            now = time.monotonic()
            self.max_gap = max(self.max_gap, now - last)
            self.ticks += 1
            self._ticked.set()
            last = now

    async def __aenter__(self) -> _Ticker:
        self._task = asyncio.create_task(self._run())
        await asyncio.sleep(0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        # One more tick, so that a pause still in progress (the loop was blocked until now) is counted.
        self._ticked.clear()
        await self._ticked.wait()
        self._task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await self._task


async def _until(condition: Any, timeout_s: float, what: str) -> None:
    """Poll ``condition`` in a worker thread until it is true; fail naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not await asyncio.to_thread(condition):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


def test_session_server_urls_and_ready(triton_server: tnc.LocalTriton) -> None:
    """The session server is running on loopback, with three distinct ports and both URLs formed."""
    assert triton_server.is_running
    ports = {triton_server.http_port, triton_server.grpc_port, triton_server.metrics_port}
    assert len(ports) == 3
    assert triton_server.grpc_url == f"grpc://127.0.0.1:{triton_server.grpc_port}"
    assert triton_server.http_url == f"http://127.0.0.1:{triton_server.http_port}"
    # The server process and one stub for scale_fp32 are alive and marked as ours.
    assert triton_server.pid in triton_server.processes()


def test_sync_start_stop_leaves_no_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A sync context manager starts a server with a stub, and stopping it leaves no process.

    The server is spawned without ``preexec_fn`` (Python between fork and exec is unsafe once threads
    exist), in its own session, and through ``setpriv --pdeathsig KILL`` where util-linux has it.
    """
    spawned: list[tuple[list[str], dict[str, Any]]] = []
    real_popen = subprocess.Popen

    def recording_popen(args: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        spawned.append((list(args), kwargs))
        return real_popen(args, **kwargs)

    monkeypatch.setattr(subprocess, "Popen", recording_popen)
    _write_model(tmp_path, "echo", GOOD_MODEL)
    with tnc.LocalTriton(tmp_path) as server:
        monkeypatch.undo()
        [(args, kwargs)] = spawned
        assert kwargs.get("preexec_fn") is None
        assert kwargs["start_new_session"] is True
        pid = server.pid
        assert pid is not None
        assert os.getsid(pid) == os.getpgid(pid) == pid
        setpriv = shutil.which("setpriv")
        if setpriv is not None:
            assert args[:5] == [setpriv, "--pdeathsig", "KILL", "--", str(server.binary)]
        else:
            assert args[0] == str(server.binary)
        pids = server.processes()
        assert len(pids) >= 2, pids  # tritonserver + the echo stub
        log = server.log_path
        assert log is not None
        assert log.is_file()
    assert server.processes() == []
    assert not server.is_running
    assert not log.parent.exists()  # a clean stop leaves nothing in the temp directory


async def test_async_start_cancelled_leaves_no_process(tmp_path: Path) -> None:
    """Cancelling the task that is starting a server kills it: no orphan server or stub."""
    _write_model(tmp_path, "echo", GOOD_MODEL)
    server = tnc.LocalTriton(tmp_path)
    task = asyncio.create_task(server.astart())
    # Wait until the process exists, then cancel mid-startup.
    while server.pid is None:
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert server.processes() == []


async def test_async_start_cancelled_never_blocks_the_loop(tmp_path: Path) -> None:
    """Cancelling astart() while a model loads: the loop keeps ticking through SIGTERM, grace, SIGKILL.

    The server does not act on SIGTERM while the model loads, so stopping takes the whole grace period;
    none of that time may be spent blocking the loop, and nothing (process, temp folder) is left.
    """
    _write_model(tmp_path, "slow_load", SLOW_LOAD_MODEL)
    server = tnc.LocalTriton(tmp_path, stop_grace_s=2.0)
    async with _Ticker() as ticker:
        # tritonserver installs its SIGTERM handler only once its models are loaded; before that the
        # default action would end it at once. Started with SIGTERM ignored (an inherited disposition),
        # it behaves like a server busy loading that finishes its work before it stops.
        previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            task = asyncio.create_task(server.astart())
            await _until(lambda: len(server.processes()) >= 2, 120, "the slow_load stub to start")
        finally:
            signal.signal(signal.SIGTERM, previous)
        seen: set[str] = set()
        watcher = asyncio.create_task(_watch_regions(server, seen))
        cancelled_at = time.monotonic()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        stopping_s = time.monotonic() - cancelled_at
        watcher.cancel()
    assert stopping_s >= server.stop_grace_s  # it did wait the grace period before SIGKILL
    assert ticker.max_gap < MAX_LOOP_GAP_S, (ticker.max_gap, stopping_s)
    assert server.processes() == []
    # Stubs come and go during the grace period (the auto-complete stub exits, the instance stub starts with a
    # region of its own): a region first mapped then was left behind in /dev/shm before the launcher noted
    # regions while it waited.
    assert seen, "no backend region seen while the server stopped"
    assert _still_in_shm(seen) == []
    assert server.log_path is not None
    assert not server.log_path.parent.exists()


def _still_in_shm(names: set[str]) -> list[str]:
    return sorted(name for name in names if os.path.exists(f"/dev/shm/{name}"))


async def _watch_regions(server: tnc.LocalTriton, seen: set[str]) -> None:
    """Add to ``seen`` every Python-backend region the server's processes map, until cancelled."""

    def scan() -> None:
        for pid in server.processes():
            with contextlib.suppress(OSError):
                for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                    name = line.rsplit(None, 1)[-1].removeprefix("/dev/shm/")
                    if name.startswith("triton_python_backend_shm_region_"):
                        seen.add(name)

    while True:
        await asyncio.to_thread(scan)
        await asyncio.sleep(0.02)


async def test_async_stop_cancelled_kills_at_once_never_blocking_the_loop(tmp_path: Path) -> None:
    """astop() cut short by wait_for: SIGKILL at the cancellation, no process or folder left, loop never blocked."""
    _write_model(tmp_path, "slow_unload", SLOW_UNLOAD_MODEL)
    server = await tnc.LocalTriton(tmp_path, stop_grace_s=60.0).astart()
    assert server.log_path is not None
    workdir = server.log_path.parent
    async with _Ticker() as ticker:
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            # The model sleeps in finalize: SIGTERM alone would take the whole 60 s grace.
            await asyncio.wait_for(server.astop(), timeout=1.0)
        stopping_s = time.monotonic() - started
        ticks_while_stopping = ticker.ticks
    assert stopping_s < server.stop_grace_s / 2
    assert ticks_while_stopping > 0
    assert ticker.max_gap < MAX_LOOP_GAP_S, (ticker.max_gap, stopping_s)
    assert server.processes() == []
    assert not workdir.exists()
    assert not server.is_running


def test_server_dies_with_its_parent(tmp_path: Path) -> None:
    """A python process holding a LocalTriton is SIGKILLed (no cleanup runs): its server and stub die anyway."""
    if shutil.which("setpriv") is None:
        pytest.fail("util-linux's setpriv is not on PATH: the server cannot be tied to its parent's life")
    _write_model(tmp_path, "echo", GOOD_MODEL)
    holder = (
        "import sys, triton_npu_client as tnc\n"
        "server = tnc.LocalTriton(sys.argv[1]).start()\n"
        "print(server.pid, server.log_path.parent, ','.join(sorted(server._regions)), flush=True)\n"
        "sys.stdin.read()\n"
    )
    with subprocess.Popen(
        [sys.executable, "-c", holder, str(tmp_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as parent:
        server_pid, workdir, regions = 0, Path(), []
        try:
            assert parent.stdout is not None
            pid_text, folder, names = parent.stdout.readline().split()
            server_pid, workdir, regions = int(pid_text), Path(folder), names.split(",")
            marker = str(workdir).encode()
            assert server_pid in living(marker)
            parent.kill()
            parent.wait()
            deadline = time.monotonic() + 60
            while living(marker) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert living(marker) == []
        finally:
            # The holder never ran its cleanup: its temp folder (and, on failure, its group) is ours to remove.
            if server_pid and living(str(workdir).encode()):
                os.killpg(server_pid, signal.SIGKILL)
            if workdir.name.startswith(_local.TEMP_PREFIX):
                shutil.rmtree(workdir, ignore_errors=True)
            # Nor its server's backend shared memory, which a SIGKILLed server cannot unlink itself.
            for name in regions:
                with contextlib.suppress(OSError):
                    os.unlink(f"/dev/shm/{name}")


FINALIZE_MARKS_MODEL = """
import pathlib
import triton_python_backend_utils as pb_utils
class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy())])
                for r in requests]
    def finalize(self):
        pathlib.Path(MARK).write_text("finalized")
"""


@pytest.mark.parametrize("how", ["sync", "async"])
async def test_stopping_a_ready_server_lets_every_model_finalize(tmp_path: Path, how: str) -> None:
    """stop()/astop() may end the wait once the stubs are gone, never before: each model's finalize has run."""
    marks = [tmp_path / f"finalized-{n}" for n in range(2)]
    for n, mark in enumerate(marks):
        _write_model(tmp_path / "repo", f"mark{n}", FINALIZE_MARKS_MODEL.replace("MARK", repr(str(mark))))
    server = tnc.LocalTriton(tmp_path / "repo", stop_grace_s=60.0)
    if how == "sync":
        server.start()
        server.stop()
    else:
        await server.astart()
        await server.astop()
    assert [m.read_text() for m in marks] == ["finalized", "finalized"]
    assert server.processes() == []


async def test_async_context_manager(tmp_path: Path) -> None:
    """``async with`` yields a ready server whose HTTP endpoint answers, then stops it."""
    _write_model(tmp_path, "echo", GOOD_MODEL)
    async with tnc.LocalTriton(tmp_path) as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.http_port)
        writer.write(b"GET /v2/models/echo/ready HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        status = await reader.readline()
        writer.close()
        await writer.wait_closed()
        assert status.startswith(b"HTTP/1.1 200")
    assert server.processes() == []


async def test_explicit_mode_loads_only_the_models_asked_for(tmp_path: Path) -> None:
    """``load_models``: the server is ready with those models loaded and the others of the repository not."""
    _write_model(tmp_path, "echo", GOOD_MODEL)
    _write_model(tmp_path, "other", GOOD_MODEL)
    server = tnc.LocalTriton(tmp_path, model_control_mode="explicit", load_models=["echo"])
    async with server, tnc.Client(server.grpc_url) as client:
        index = {m.name: m.state for m in await client.repository_index()}
        assert await client.is_model_ready("echo")
        assert not await client.is_model_ready("other")
    assert index["echo"] == "READY"
    assert index["other"] != "READY"
    with pytest.raises(ValueError, match="explicit"):
        tnc.LocalTriton(tmp_path, load_models=["echo"])


def test_a_killed_server_leaves_no_backend_shared_memory(tmp_path: Path) -> None:
    """The Python backend's /dev/shm regions of a SIGKILLed server (it cannot unlink them) go when it is stopped."""
    _write_model(tmp_path, "echo", GOOD_MODEL)
    server = tnc.LocalTriton(tmp_path).start()
    try:
        # Noted while it started (a region the backend made and dropped while loading may be among them).
        regions = sorted(server._regions)
        assert any(os.path.exists(f"/dev/shm/{name}") for name in regions), "no live backend region noted"
        assert server.pid is not None
        os.killpg(server.pid, signal.SIGKILL)
    finally:
        server.stop()
        if server.log_path is not None:  # the log LocalTriton keeps for a server that died on its own
            shutil.rmtree(server.log_path.parent, ignore_errors=True)
    assert [name for name in regions if os.path.exists(f"/dev/shm/{name}")] == []


def test_model_load_failure_names_model(tmp_path: Path) -> None:
    """A model that fails to load raises ModelLoadError naming it, with the server's own lines."""
    _write_model(tmp_path, "good", GOOD_MODEL)
    _write_model(tmp_path, "broken", BAD_MODEL)
    server = tnc.LocalTriton(tmp_path)
    with pytest.raises(tnc.ModelLoadError) as info:
        server.start()
    assert info.value.model == "broken"
    assert "broken" in str(info.value)
    assert any("refuses to load" in line for line in info.value.log_lines)
    assert server.processes() == []
    # The error carries the server's lines; the failed start leaves no temp folder behind.
    assert server.log_path is not None
    assert not server.log_path.parent.exists()


def test_port_in_use(tmp_path: Path) -> None:
    """A given port that is taken raises PortInUseError naming the port; nothing is started."""
    _write_model(tmp_path, "echo", GOOD_MODEL)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        server = tnc.LocalTriton(tmp_path, grpc_port=port)
        with pytest.raises(tnc.PortInUseError) as info:
            server.start()
    assert info.value.port == port
    assert str(port) in str(info.value)
    assert server.pid is None


def test_no_binary_names_places(monkeypatch: pytest.MonkeyPatch) -> None:
    """With no binary anywhere, the error lists every place looked at and how to install one."""
    monkeypatch.delenv("TRITONSERVER", raising=False)
    monkeypatch.setattr(_local, "OFFICIAL_TRITONSERVER", Path("/nonexistent/bin/tritonserver"))
    monkeypatch.setattr(_local, "_bundled_root", lambda: None)
    with pytest.raises(tnc.ServerBinaryNotFound) as info:
        tnc.find_tritonserver()
    assert "/nonexistent/bin/tritonserver" in str(info.value)
    assert "nvidia-pytriton" in str(info.value)
    assert "pip install" in str(info.value)
    assert len(info.value.searched) == 2


def test_cli_no_binary_one_paragraph(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """`triton-npu serve` without a binary prints one paragraph, no traceback, and exits non-zero."""
    monkeypatch.delenv("TRITONSERVER", raising=False)
    monkeypatch.setattr(_local, "OFFICIAL_TRITONSERVER", Path("/nonexistent/bin/tritonserver"))
    monkeypatch.setattr(_local, "_bundled_root", lambda: None)
    code = cli.main(["serve"])
    err = capsys.readouterr().err
    assert code != 0
    assert "Traceback" not in err
    assert err.strip().count("\n") == 0
    assert "Looked at" in err


def test_cli_bad_env_binary_subprocess() -> None:
    """The installed entry point, with $TRITONSERVER pointing nowhere, exits 2 with no traceback."""
    env = dict(os.environ, TRITONSERVER="/nonexistent/tritonserver")
    proc = subprocess.run(
        [sys.executable, "-m", "triton_npu_client", "serve"], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "/nonexistent/tritonserver" in proc.stderr


def test_no_stub_for_python(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A bundled server without a stub for this Python raises StubNotFound naming the versions it has."""
    fake = tmp_path / "pytriton" / "tritonserver"
    (fake / "bin").mkdir(parents=True)
    (fake / "backends" / "python").mkdir(parents=True)
    (fake / "python_backend_stubs" / "3.8").mkdir(parents=True)
    (fake / "python_backend_stubs" / "3.8" / "triton_python_backend_stub").write_text("")
    binary = fake / "bin" / "tritonserver"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    server = tnc.LocalTriton(tmp_path, tritonserver=binary)
    with pytest.raises(tnc.StubNotFound) as info:
        server.start()
    assert f"{sys.version_info.major}.{sys.version_info.minor}" in str(info.value)
    assert "3.8" in str(info.value)


# `triton-npu serve` (banner, Ctrl-C, SIGTERM, --models, its mistakes): tests/test_cli_serve.py.


async def test_the_packaged_configs_are_the_same_without_tritons_auto_complete(
    triton_server: tnc.LocalTriton, tmp_path: Path
) -> None:
    """The launcher turns Triton's auto-complete pass off for the packaged repository (a stub per Python model just to
    complete a config it does not need to): the server must then give exactly the configs it gives with the pass on.

    The session server runs the packaged repository (pass off); a second one runs the same models with it on.
    """
    assert triton_server.auto_complete_config is False
    assert tnc.LocalTriton(tmp_path).auto_complete_config is True  # any other repository keeps Triton's default
    models = ["scale_fp32", "seq_stats_oldest", "chat", "minilm", "dtypes_echo", "seq_count_stream"]
    with_pass = tnc.LocalTriton(
        model_control_mode="explicit", load_models=models, auto_complete_config=True, stop_grace_s=0
    )
    async with with_pass, tnc.Client(with_pass.grpc_url) as on, tnc.Client(triton_server.grpc_url) as off:
        names = sorted(m.name for m in await on.repository_index() if m.state == "READY")
        assert set(models) < set(names)  # the ensemble brought its steps
        for name in names:
            assert await on.model_config(name) == await off.model_config(name), name


# A model whose execute holds the GIL for hours (a C-level loop: no bytecode runs, so no switch): its stub cannot
# run the exit it starts when it sees its server gone, and it ignores SIGTERM. It marks the moment execute starts.
GIL_BOUND_MODEL = """
import pathlib
import triton_python_backend_utils as pb_utils
class TritonPythonModel:
    def execute(self, requests):
        pathlib.Path(MARK).write_text("busy")
        sum(range(10**15))
        return []
"""


@pytest.mark.parametrize("finds", ["is_running", "stop", "stop, dying meanwhile"])
def test_the_stubs_of_a_server_found_dead_are_killed(tmp_path: Path, finds: str) -> None:
    """The server is SIGKILLed while its stub executes a request (its owner, this process, lives on): the stub would
    stay, holding its model, since it can no longer exit. The first look that finds the server dead (is_running, or
    stop()) kills it, and stop() then ends at once, with no grace to wait for a server that has gone.

    "stop, dying meanwhile": the server is still alive when stop() looks and sends SIGTERM, and dies right after (as
    a SIGKILLed server does while the kernel tears it down: its sockets close before it can be reaped). The grace
    ends as soon as the server has gone: nobody is left to drain the busy stub.
    """
    mark = tmp_path / "busy"
    _write_model(tmp_path / "repo", "busy", GIL_BOUND_MODEL.replace("MARK", repr(str(mark))))
    server = tnc.LocalTriton(tmp_path / "repo", auto_complete_config=False, stop_grace_s=30.0).start()
    body = b'{"inputs":[{"name":"X","shape":[1,1],"datatype":"FP32","data":[1.0]}]}'
    request = subprocess.Popen(  # the request that keeps the stub busy; it fails once the server dies
        ["curl", "-s", "-o", "/dev/null", "-X", "POST", "--data", body, f"{server.http_url}/v2/models/busy/infer"]
    )
    try:
        deadline = time.monotonic() + 60
        while not mark.exists():  # until execute has begun
            assert request.poll() is None, "the request ended before it reached execute"
            assert time.monotonic() < deadline, "the request never reached execute"
            time.sleep(0.01)
        stubs = server._stubs()
        assert stubs, "no stub"
        assert server.pid is not None
        pid = server.pid
        if finds == "stop, dying meanwhile":
            send_term = server._send_term

            def term_then_die() -> None:
                send_term()
                os.kill(pid, signal.SIGKILL)

            server._send_term = term_then_die  # type: ignore[method-assign]
        else:
            os.kill(pid, signal.SIGKILL)
            assert request.wait(timeout=60) != 0
        if finds == "is_running":
            while server.is_running:  # until the kernel has made the server a zombie
                assert time.monotonic() < deadline
                time.sleep(0.01)
            # Without the kill the stub would stay (its loop runs for hours): this wait would run out.
            while set(living(str(tmp_path / "repo").encode())) & stubs:
                assert time.monotonic() < deadline, "the stub outlived its dead server"
                time.sleep(0.01)
        began = time.monotonic()
        server.stop()
        stopping_s = time.monotonic() - began
        assert request.wait(timeout=60) != 0
    finally:
        server.stop()
        if request.poll() is None:
            request.kill()
        request.wait()
        if server.log_path is not None:  # the log LocalTriton keeps for a server that died on its own
            shutil.rmtree(server.log_path.parent, ignore_errors=True)
    assert set(living(str(tmp_path / "repo").encode())) & stubs == set()
    assert server.processes() == []
    assert stopping_s < 5.0, stopping_s  # not the 30 s grace


def test_what_a_dead_launcher_left_is_swept_and_a_live_ones_is_not(tmp_path: Path) -> None:
    """A launcher ended by SIGTERM/SIGKILL leaves its temp folder, and maybe a stub still running from it: the next
    start (sweep_leftovers) kills what runs from a dead owner's folder and removes it; a live owner's stays."""
    with subprocess.Popen([sys.executable, "-c", "pass"]) as gone:
        gone.wait()
    dead = tmp_path / f"{_local.temp_folder_prefix(gone.pid)}abc"
    live = tmp_path / f"{_local.temp_folder_prefix()}xyz"
    for folder in (dead, live):
        (folder / "backends" / "python").mkdir(parents=True)
        (folder / "tritonserver.log").write_text("log\n")

    def stub_from(folder: Path) -> subprocess.Popen[bytes]:
        # A process whose command line runs from the folder's backend copy, as a Python-backend stub does.
        stub = f"{folder}/backends/python/triton_python_backend_stub"
        return subprocess.Popen(["bash", "-c", f"exec -a {stub} sleep 120"])

    orphan, kept = stub_from(dead), stub_from(live)
    try:
        for proc in (orphan, kept):  # until each has exec'd (its command line names the folder)
            for _ in range(1000):
                if str(dead if proc is orphan else live).encode() in Path(f"/proc/{proc.pid}/cmdline").read_bytes():
                    break
                time.sleep(0.005)
        assert _local.sweep_leftovers(tmp_path) == [dead]
        assert orphan.wait(timeout=10) == -signal.SIGKILL
        assert not dead.exists()
        assert live.is_dir()
        assert kept.poll() is None
    finally:
        for proc in (orphan, kept):
            proc.kill()
            proc.wait()
