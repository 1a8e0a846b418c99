"""Find, prepare, start and stop a real ``tritonserver`` on this machine.

Used by the CLI (``triton-npu serve``), the tests and the demos. The binary comes from, in order:
an explicit path (argument or ``$TRITONSERVER``), ``/opt/tritonserver/bin/tritonserver`` (the official
and Ascend images), or the one bundled in the ``nvidia-pytriton`` wheel. The bundled one needs a private
backend folder holding the Python-backend stub for the running Python, its shared libraries on
``LD_LIBRARY_PATH``, and this interpreter's ``bin/`` first on ``PATH`` (the stub takes ``sys.prefix``
from the first ``python3`` there, so model.py imports from the current environment).

The server runs in its own session and process group: Ctrl-C in a terminal reaches only us, and
stopping kills the whole group, so no ``triton_python_backend_stub`` outlives its server. When the
server is started from the main thread and util-linux's ``setpriv`` is on ``PATH``, it is started
through ``setpriv --pdeathsig KILL``: the kernel kills it if this process dies without stopping it
(SIGKILL, crash). No ``preexec_fn``: running Python between fork and exec is unsafe once threads exist.

The async methods never block the event loop: waiting, reaping and removing files run in worker
threads, and the kill they end with happens even when the awaiting task is cancelled.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import contextlib
import importlib.metadata
import importlib.resources
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Self

import attrs

from .._errors import (
    LocalServerError,
    ModelLoadError,
    PortInUseError,
    ServerBinaryNotFound,
    ServerStartTimeout,
    StubNotFound,
)

__all__ = ["LocalTriton", "ModelLoad", "default_model_repository", "find_tritonserver"]

_log = logging.getLogger("triton_npu_client.local")

OFFICIAL_TRITONSERVER = Path("/opt/tritonserver/bin/tritonserver")
_INSTALL_HINT = (
    "Install the bundled server with `pip install 'triton-npu-client[server]'` "
    "(it brings the nvidia-pytriton wheel, Triton 2.51), or point TRITONSERVER "
    "(or --tritonserver) at an existing binary."
)
# "failed to load 'name' version 1: ..." -- the one place we read the server's log text: it is the
# only channel through which a server that exits on a load failure says which model failed.
_FAILED_LOAD = re.compile(r"failed to load '([^']+)'")
_TAIL_LINES = 200
# Every temp folder LocalTriton creates starts with this, then the creating process's pid.
TEMP_PREFIX = "triton-npu-"
# After SIGKILL the kernel still has to tear the processes down; reaping waits at most this long.
_REAP_TIMEOUT_S = 10.0
# How the Python backend names the shared-memory regions it shares with its stubs (/dev/shm/<prefix><uuid>).
_BACKEND_REGION_PREFIX = "triton_python_backend_shm_region_"

# The server's log lines that say a model's load was queued and that it is ready (Triton's INFO lines, on at every
# --log-verbose): `I1202 03:28:03.098127 25997 model_lifecycle.cc:472] "loading: chat:1"` and
# `... "successfully loaded 'chat'"`. Read only to report progress: readiness itself is asked of the server.
_LOADING = re.compile(r'^I\d{4} (\d\d):(\d\d):(\d\d\.\d+) .*"loading: (.+):(\d+)"$')
_LOADED = re.compile(r"^I\d{4} (\d\d):(\d\d):(\d\d\.\d+) .*\"successfully loaded '([^']+)'\"$")


@attrs.frozen(kw_only=True)
class ModelLoad:
    """One model the starting server has loaded, as its log says.

    ``seconds``: from the server queueing the model's load to the model being ready, by the server's own
    timestamps. Triton loads a few models at a time (``--model-load-thread-count``, 4 by default), so a model
    queued behind others counts their time too; ``elapsed_s``: since the server was started, as this process saw it.
    """

    name: str
    version: str
    seconds: float
    elapsed_s: float


class _LoadLog:
    """Follows the log of a starting server: each call of :meth:`read` returns the models loaded since the last."""

    def __init__(self, path: Path, started: float) -> None:
        self._path = path
        self._started = started
        self._offset = 0
        self._partial = b""
        self._queued: dict[str, tuple[str, float]] = {}  # name -> (version, seconds of the day it was queued)

    @staticmethod
    def _seconds(h: str, m: str, s: str) -> float:
        return int(h) * 3600 + int(m) * 60 + float(s)

    def read(self) -> list[ModelLoad]:
        try:
            with self._path.open("rb") as f:
                f.seek(self._offset)
                data = f.read()
        except OSError:
            return []
        self._offset += len(data)
        *lines, self._partial = (self._partial + data).split(b"\n")
        loads: list[ModelLoad] = []
        for raw in lines:
            line = raw.decode("utf-8", "replace").rstrip("\r")
            if (queued := _LOADING.match(line)) is not None:
                self._queued[queued.group(4)] = (queued.group(5), self._seconds(*queued.group(1, 2, 3)))
            elif (loaded := _LOADED.match(line)) is not None:
                name = loaded.group(4)
                version, at = self._queued.pop(name, ("", None))
                done = self._seconds(*loaded.group(1, 2, 3))
                # Modulo a day: a load that crosses midnight.
                took = 0.0 if at is None else (done - at) % 86400.0
                loads.append(ModelLoad(name=name, version=version, seconds=took,
                                       elapsed_s=time.monotonic() - self._started))  # fmt: skip
        return loads


# Every server started by this process, so that interpreter exit never leaves one behind.
_LIVE: weakref.WeakSet[LocalTriton] = weakref.WeakSet()


def default_model_repository() -> Path:
    """The project's ``server_models/``: the copy a wheel ships, else the one at a source checkout's root.

    A wheel carries the repository's ``server_models/`` as ``triton_npu_client/server_models``; an
    editable install runs from the checkout, where the folder sits beside the package.
    """
    shipped = importlib.resources.files("triton_npu_client").joinpath("server_models")
    # Only a real folder can be handed to tritonserver (a zipped install has none).
    if isinstance(shipped, Path) and shipped.is_dir():
        return shipped
    return Path(__file__).resolve().parents[2] / "server_models"


def temp_folder_prefix(pid: int | None = None) -> str:
    """The name prefix of the temp folders LocalTriton makes in process ``pid`` (default: this one).

    The pid tells whose folder a leftover is, on a machine where several processes start servers.
    """
    return f"{TEMP_PREFIX}{os.getpid() if pid is None else pid}-"


_LEFTOVER = re.compile(rf"^{re.escape(TEMP_PREFIX)}(\d+)-")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: alive
    return True


def _running_from(folder: Path) -> list[int]:
    """This user's living processes whose command line runs something inside ``folder`` (a server given its
    backend copy there, a stub from that copy), sorted. Zombies (state Z) are already dead: they only wait for
    their parent to reap them."""
    inside = f"{folder}/".encode()
    found: list[int] = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if entry.stat().st_uid != os.getuid():
                continue
            running = inside in (entry / "cmdline").read_bytes()
            if running and (entry / "stat").read_text().rsplit(")", 1)[-1].split()[0] != "Z":
                found.append(int(entry.name))
        except OSError:
            continue  # gone meanwhile, or not ours to read
    return sorted(found)


def sweep_leftovers(folder: str | os.PathLike[str] | None = None) -> list[Path]:
    """Remove what launchers that died without stopping left in ``folder`` (default: the temp folder); the removed.

    A script ended by SIGTERM or SIGKILL (a ``timeout``, a container stop) never runs its cleanup: its temp folder
    (the backend copy and the log, a few MB) stays, and a stub of a server that died under it may still run from
    that copy (stubs ignore SIGTERM). A folder is its owner's, named by the owner's pid (:func:`temp_folder_prefix`);
    once that pid is gone, whatever still runs from the folder is killed (SIGKILL) and the folder removed. Only this
    user's folders and processes are touched; a pid that is alive (or reused) keeps its folder. Never raises.
    """
    root = Path(folder) if folder is not None else Path(tempfile.gettempdir())
    removed: list[Path] = []
    try:
        entries = list(root.iterdir())
    except OSError:
        return removed
    for entry in entries:
        match = _LEFTOVER.match(entry.name)
        if match is None or _pid_alive(int(match.group(1))):
            continue
        try:
            if entry.is_symlink() or not entry.is_dir() or entry.stat().st_uid != os.getuid():
                continue
        except OSError:
            continue
        orphans = _running_from(entry)
        for pid in orphans:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + _REAP_TIMEOUT_S
        while orphans and _running_from(entry) and time.monotonic() < deadline:
            time.sleep(0.02)  # the kernel tears the killed processes down; nothing to wait on but /proc
        shutil.rmtree(entry, ignore_errors=True)
        if not entry.exists():
            removed.append(entry)
            _log.info("removed %s, left by launcher pid %s (%d processes still ran from it)", entry,
                      match.group(1), len(orphans))  # fmt: skip
    return removed


def _bundled_root() -> tuple[Path, Path] | None:
    """(tritonserver folder, shared-library folder) of the installed nvidia-pytriton, if any."""
    try:
        dist = importlib.metadata.distribution("nvidia-pytriton")
    except importlib.metadata.PackageNotFoundError:
        return None
    root = Path(str(dist.locate_file("pytriton/tritonserver")))
    libs = Path(str(dist.locate_file("nvidia_pytriton.libs")))
    if not (root / "bin" / "tritonserver").is_file():
        return None
    return root, libs


def find_tritonserver(explicit: str | os.PathLike[str] | None = None) -> Path:
    """Return the ``tritonserver`` binary to run; raise :class:`ServerBinaryNotFound` naming where it looked."""
    searched: list[str] = []
    candidates: list[tuple[str, Path]] = []
    if explicit is not None:
        candidates.append(("argument", Path(explicit)))
    elif os.environ.get("TRITONSERVER"):
        candidates.append(("$TRITONSERVER", Path(os.environ["TRITONSERVER"])))
    else:
        candidates.append(("official image path", OFFICIAL_TRITONSERVER))
        bundled = _bundled_root()
        if bundled is not None:
            candidates.append(("nvidia-pytriton wheel", bundled[0] / "bin" / "tritonserver"))
        else:
            searched.append("nvidia-pytriton wheel (not installed)")
    for label, path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return path
        searched.append(f"{path} ({label})")
    where = "; ".join(searched)
    raise ServerBinaryNotFound(f"No tritonserver binary found. Looked at: {where}. {_INSTALL_HINT}", searched=searched)


def _loggable(command: list[str]) -> str:
    """``command`` as one line to log, with the API keys of Triton's restricted-protocol options hidden.

    ``--grpc-restricted-protocol=<apis>:<header>=<key>`` and ``--http-restricted-api`` carry the key itself.
    """
    shown: list[str] = []
    key_follows = False
    for arg in command:
        if key_follows or "restricted" in arg:
            arg = re.sub(r"(:[^:=]+=).*$", r"\1***", arg)
        key_follows = arg.startswith("--") and "restricted" in arg and "=" not in arg
        shown.append(arg)
    return " ".join(shown)


def _check_port_free(host: str, port: int, what: str) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # SO_REUSEADDR as tritonserver binds: a port whose old connections sit in TIME_WAIT (a server
        # restarted on the same ports) is free for it, and must be free for this check too.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as err:
            raise PortInUseError(
                f"The {what} port {port} on {host} is already in use; choose another "
                f"(or leave it out to take a free one).",
                port=port,
            ) from err


def _parent_death_prefix() -> list[str]:
    """``setpriv --pdeathsig KILL --`` when util-linux's setpriv is on PATH, else nothing."""
    # The parent-death signal fires when the *thread* that forked the child ends, not the process:
    # only the main thread lives as long as we do. Elsewhere the atexit/weakref cleanup must do.
    if threading.current_thread() is not threading.main_thread():
        return []
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "KILL", "--"] if setpriv is not None else []


class LocalTriton:
    """A real ``tritonserver`` started on a model repository; a sync and an async context manager.

    ::

        async with LocalTriton() as server:
            client_url = server.grpc_url      # "grpc://127.0.0.1:PORT"

    Ports not given are chosen free. ``start``/``astart`` return once the server and every model are
    ready, or raise (:class:`ModelLoadError` names the model and carries the server's error lines);
    a failed or cancelled start stops what it started and removes its temp folder.
    ``stop``/``astop`` send SIGTERM, then SIGKILL to the whole process group after ``stop_grace_s``;
    the temp folder goes too, except the log of a server that had exited on its own after a
    successful start (``log_path`` stays readable for the post-mortem).

    ``auto_complete_config``: Triton's pass that completes each model's config, which for a Python-backend model
    starts a stub of its own just to ask (about 1.2 s a model here). None (the default): off for the packaged
    ``server_models/``, whose configs are complete (tests/test_local.py checks that the server gives the same
    configs either way), on for any other repository.
    """

    def __init__(
        self,
        model_repository: str | os.PathLike[str] | None = None,
        *,
        tritonserver: str | os.PathLike[str] | None = None,
        host: str = "127.0.0.1",
        http_port: int | None = None,
        grpc_port: int | None = None,
        metrics_port: int | None = None,
        log_verbose: int = 0,
        model_control_mode: str = "none",
        load_models: Sequence[str] | None = None,
        startup_timeout_s: float = 120.0,
        auto_complete_config: bool | None = None,
        stop_grace_s: float = 10.0,
        extra_args: Sequence[str] = (),
        env: dict[str, str] | None = None,
    ) -> None:
        if model_control_mode not in ("none", "explicit", "poll"):
            raise ValueError(f"model_control_mode must be 'none', 'explicit' or 'poll', got {model_control_mode!r}")
        self.model_repository = Path(model_repository or default_model_repository()).resolve()
        self._tritonserver = tritonserver
        self.host = host
        self._ports = {"http": http_port, "grpc": grpc_port, "metrics": metrics_port}
        self.log_verbose = log_verbose
        self.model_control_mode = model_control_mode
        if load_models is not None and model_control_mode != "explicit":
            raise ValueError("load_models needs model_control_mode='explicit'")
        # Explicit mode only: the models to load at startup (an ensemble brings its composing models); all if None.
        self.load_models = None if load_models is None else tuple(load_models)
        self.startup_timeout_s = startup_timeout_s
        self.stop_grace_s = stop_grace_s
        self.extra_args = tuple(extra_args)
        if auto_complete_config is None:
            auto_complete_config = self.model_repository != default_model_repository().resolve()
        self.auto_complete_config = auto_complete_config
        self._extra_env = dict(env or {})
        self._proc: subprocess.Popen[bytes] | None = None
        self._workdir: Path | None = None
        self._log_file: Path | None = None
        # True from the moment a temp folder exists until stopping has removed it and reaped the server.
        self._active = False
        # True from a successful start until stopping has finished.
        self._ready = False
        self.binary: Path | None = None
        # The Python backend's shared-memory regions this server mapped (names under /dev/shm). A server that stops
        # cleanly unlinks them; one that is SIGKILLed cannot, so stopping removes whatever of them is left.
        self._regions: set[str] = set()
        # Set by interrupt(): a start stops waiting and a stop stops its grace period. Cleared when a stop finishes.
        self._interrupted = threading.Event()
        # Whether what outlived a server found dead has been killed (once per server: see is_running).
        self._orphans_killed = False

    def __repr__(self) -> str:
        state = f"pid={self.pid}" if self.is_running else "stopped"
        return f"<LocalTriton {state} repo={str(self.model_repository)!r} grpc={self._ports['grpc']}>"

    # -- addresses ------------------------------------------------------------------------

    @property
    def http_port(self) -> int:
        return self._port("http")

    @property
    def grpc_port(self) -> int:
        return self._port("grpc")

    @property
    def metrics_port(self) -> int:
        return self._port("metrics")

    def _port(self, which: str) -> int:
        port = self._ports[which]
        if port is None:
            raise RuntimeError("the server has not been started")
        return port

    @property
    def http_url(self) -> str:
        return f"http://{self.host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"grpc://{self.host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def is_running(self) -> bool:
        """Whether the server process is alive. Finding it dead (killed, crashed) kills what it left (see below)."""
        if self._proc is None:
            return False
        if self._proc.poll() is None:
            return True
        self._kill_orphans()
        return False

    def _kill_orphans(self) -> None:
        """SIGKILL every process still running from this server's folder once the server is found dead.

        A Python-backend stub exits when it sees its parent gone, but it asks with kill(pid, 0), which a zombie
        passes (a server killed and not yet reaped by us), and a stub whose model holds the GIL cannot exit at all;
        such stubs ignore SIGTERM and hold their model's memory. Once per dead server: a scan of /proc. Never raises.
        """
        if self._orphans_killed or self._workdir is None:
            return
        self._orphans_killed = True
        self._signal_group(signal.SIGKILL)
        for pid in self.processes():  # a process that left the group runs from the folder all the same
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        _log.debug("killed what outlived tritonserver pid %s", self._proc.pid if self._proc else None)

    def interrupt(self) -> None:
        """Hurry whatever this server is doing, from any thread or a signal handler (it only sets a flag).

        A start in progress stops waiting: it kills what it started (no grace) and raises :class:`LocalServerError`;
        a stop in progress ends its grace period and kills at once. Holds until a stop has finished (a failed start
        stops too), so an interrupt that comes just before :meth:`start` is not lost.
        """
        self._interrupted.set()

    def check_ports(self) -> None:
        """Raise :class:`PortInUseError` for a port given to the constructor that is taken now (None: taken freely).

        :meth:`start` checks again; this lets a caller refuse a taken port before it prepares anything else.
        """
        for which, label in (("http", "HTTP"), ("grpc", "gRPC"), ("metrics", "metrics")):
            port = self._ports[which]
            if port is not None and not self._active:
                _check_port_free(self.host, port, label)

    @property
    def log_path(self) -> Path | None:
        return self._log_file

    def log_tail(self, n: int = 50) -> list[str]:
        """The last ``n`` lines the server wrote."""
        if self._log_file is None or not self._log_file.exists():
            return []
        with self._log_file.open("r", errors="replace") as f:
            return [line.rstrip("\n") for line in collections.deque(f, maxlen=n)]

    def processes(self) -> list[int]:
        """PIDs of every process started for this server (server and stubs) still alive."""
        if self._workdir is None:
            return []
        return _running_from(self._workdir)

    def _note_regions(self) -> None:
        """Record the backend's shared-memory regions the server's processes map now (read from /proc)."""
        for pid in self.processes():
            try:
                maps = Path(f"/proc/{pid}/maps").read_text()
            except OSError:
                continue
            for line in maps.splitlines():
                path = line.rsplit(None, 1)[-1] if "/dev/shm/" in line else ""
                name = path.removeprefix("/dev/shm/")
                if name.startswith(_BACKEND_REGION_PREFIX) and "/" not in name:
                    self._regions.add(name)

    def _remove_regions(self) -> None:
        """Unlink the recorded regions that outlived the server (it was killed before it could). Never raises."""
        for name in self._regions:
            with contextlib.suppress(OSError):
                os.unlink(f"/dev/shm/{name}")
        self._regions.clear()

    # -- preparing ------------------------------------------------------------------------

    def _prepare(self) -> tuple[list[str], dict[str, str]]:
        binary = find_tritonserver(self._tritonserver)
        self.binary = binary
        if not self.model_repository.is_dir():
            raise LocalServerError(f"Model repository {self.model_repository} is not a directory.")
        # What launchers that died without stopping left (their folders, stubs still running from them) goes first.
        sweep_leftovers()
        self._workdir = Path(tempfile.mkdtemp(prefix=temp_folder_prefix()))
        self._log_file = self._workdir / "tritonserver.log"
        self._active = True
        # From here on interpreter exit must clean up, even if we never get as far as spawning.
        _LIVE.add(self)
        env = dict(os.environ)
        server_root = binary.parent.parent
        stubs = server_root / "python_backend_stubs"
        if stubs.is_dir():
            backends = self._prepare_bundled_backends(server_root, stubs)
            bundled = _bundled_root()
            libs = bundled[1] if bundled is not None else server_root.parent.parent / "nvidia_pytriton.libs"
            env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(libs), env.get("LD_LIBRARY_PATH", "")) if p)
        else:
            backends = server_root / "backends"
        # The stub embeds Python and takes sys.prefix from the first python3 on PATH: make it ours.
        env["PATH"] = os.pathsep.join(p for p in (str(Path(sys.executable).parent), env.get("PATH", "")) if p)
        env.update(self._extra_env)
        # The free ports are picked with every picking socket held open until all are picked: a socket closed at
        # once lets the OS hand the same port out again, and tritonserver then refuses to start (HTTP and metrics on
        # one port, seen in a suite run).
        with contextlib.ExitStack() as held:
            for which in ("http", "grpc", "metrics"):
                port = self._ports[which]
                if port is None:
                    picker = held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
                    picker.bind((self.host, 0))
                    self._ports[which] = int(picker.getsockname()[1])
                else:
                    _check_port_free(self.host, port, which.upper() if which != "metrics" else "metrics")
        args = [
            str(binary),
            f"--model-repository={self.model_repository}",
            f"--backend-directory={backends}",
            f"--http-address={self.host}",
            f"--http-port={self.http_port}",
            f"--grpc-address={self.host}",
            f"--grpc-port={self.grpc_port}",
            f"--metrics-address={self.host}",
            f"--metrics-port={self.metrics_port}",
            f"--log-verbose={self.log_verbose}",
            f"--model-control-mode={self.model_control_mode}",
            f"--exit-timeout-secs={max(1, int(self.stop_grace_s))}",
        ]
        if self.model_control_mode == "explicit":
            names = ("*",) if self.load_models is None else self.load_models
            args.extend(f"--load-model={name}" for name in names)
        if not self.auto_complete_config:
            args.append("--disable-auto-complete-config")
        args.extend(self.extra_args)
        return args, env

    def _prepare_bundled_backends(self, server_root: Path, stubs: Path) -> Path:
        assert self._workdir is not None
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        stub = stubs / version / "triton_python_backend_stub"
        if not stub.is_file():
            have = sorted(p.name for p in stubs.iterdir() if (p / "triton_python_backend_stub").is_file())
            raise StubNotFound(
                f"The bundled Triton has no Python-backend stub for Python {version} "
                f"(it has: {', '.join(have) or 'none'}). Run with one of those Python versions, "
                f"or point TRITONSERVER at a server built for Python {version}."
            )
        backends = self._workdir / "backends"
        shutil.copytree(server_root / "backends", backends)
        shutil.copy2(stub, backends / "python" / "triton_python_backend_stub")
        return backends

    # -- starting -------------------------------------------------------------------------

    def _spawn(self, args: list[str], env: dict[str, str]) -> None:
        """Start the prepared command; quick (no Python runs between fork and exec)."""
        assert self._log_file is not None
        command = [*_parent_death_prefix(), *args]
        _log.debug("starting %s", _loggable(command))
        self._orphans_killed = False
        with self._log_file.open("wb") as log:
            self._proc = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=self._workdir,
                # Its own session and group: Ctrl-C reaches only us, and stopping can kill the group.
                start_new_session=True,
            )

    def _probe(self) -> bool:
        """True once the server says it is ready and every model in the index is READY."""
        if self._proc is None or self._proc.poll() is not None:
            raise self._startup_failure()
        # Models map their regions while they load: note them as they come, so a start cancelled midway (its
        # server killed) leaves none behind either.
        self._note_regions()
        try:
            with urllib.request.urlopen(f"{self.http_url}/v2/health/ready", timeout=2) as resp:
                if resp.status != 200:
                    return False
        except (urllib.error.URLError, OSError):
            return False
        request = urllib.request.Request(f"{self.http_url}/v2/repository/index", data=b"{}", method="POST")
        try:
            with urllib.request.urlopen(request, timeout=5) as resp:
                index = json.loads(resp.read())
        except (urllib.error.URLError, OSError, ValueError):
            return False
        for entry in index:
            if not entry.get("state"):
                continue  # never loaded: a model of the repository that explicit mode was not asked to load
            if entry.get("state") == "UNAVAILABLE" and entry.get("reason"):
                raise ModelLoadError(
                    f"Model {entry['name']!r} failed to load: {entry['reason']}",
                    model=str(entry["name"]),
                    log_lines=self._error_lines(),
                )
            if entry.get("state") != "READY":
                return False
        return True

    def _check_interrupt(self) -> None:
        if self._interrupted.is_set():
            raise LocalServerError("the start of tritonserver was interrupted")

    def _error_lines(self) -> list[str]:
        return [line for line in self.log_tail(_TAIL_LINES) if line.startswith("E") or "error" in line.lower()]

    def _startup_failure(self) -> LocalServerError:
        code = self._proc.poll() if self._proc is not None else None
        errors = self._error_lines()
        for line in errors:
            match = _FAILED_LOAD.search(line)
            if match:
                return ModelLoadError(
                    f"Model {match.group(1)!r} failed to load; the server exited (code {code}). "
                    f"Server said: {line.strip()}",
                    model=match.group(1),
                    log_lines=errors,
                )
        said = " | ".join(errors[-5:]) or "\n".join(self.log_tail(10))
        return LocalServerError(
            f"tritonserver exited during startup (code {code}). Server said: {said}", log_lines=errors
        )

    def _timeout_failure(self) -> ServerStartTimeout:
        # The temp folder goes with the failed start: the error carries the lines, not a log path.
        tail = self.log_tail(10)
        said = " | ".join(tail[-5:])
        return ServerStartTimeout(
            f"tritonserver was not ready after {self.startup_timeout_s:.0f} s. Server said last: {said}",
            log_lines=self._error_lines() or tail,
        )

    def start(self, *, on_load: Callable[[ModelLoad], None] | None = None) -> Self:
        """Start the server and block until it and every model are ready.

        ``on_load`` is called (in this thread) with each model the server reports loaded, as it does: read from
        the server's log, since Triton opens its endpoints only after the models it starts with have loaded (no
        index to poll before that). :meth:`interrupt` (e.g. from a signal handler) ends the start at once.
        """
        if self.is_running:
            return self
        self._stop(keep_log_if_exited=True)  # what is left of an earlier run that died
        try:
            args, env = self._prepare()
            self._check_interrupt()
            started = time.monotonic()
            self._spawn(args, env)
            assert self._log_file is not None
            log = _LoadLog(self._log_file, started) if on_load is not None else None
            deadline = started + self.startup_timeout_s
            while True:
                self._check_interrupt()
                ready = self._probe()
                for load in log.read() if log is not None else ():
                    assert on_load is not None
                    on_load(load)
                if ready:
                    break
                if time.monotonic() > deadline:
                    raise self._timeout_failure()
                self._interrupted.wait(0.1)
        except BaseException as err:
            # Nothing was served yet, so nothing to drain: an interrupted start (Ctrl-C, or interrupt()) kills at
            # once; a failed one gives the server its grace (it may be exiting on its own, its log complete).
            if not isinstance(err, Exception) or self._interrupted.is_set():
                self.kill()
            self._stop(keep_log_if_exited=False)
            raise
        self._note_regions()
        self._ready = True
        _log.debug("tritonserver ready: %s %s", self.http_url, self.grpc_url)
        return self

    async def astart(self) -> Self:
        """Start the server and wait, without blocking the loop, until it and every model are ready.

        Cancelled or failed, it stops what it started (SIGTERM, then SIGKILL after ``stop_grace_s``;
        at once if cancelled again) before re-raising.
        """
        if self.is_running:
            return self
        await self._astop(keep_log_if_exited=True)  # what is left of an earlier run that died
        # Copying the backends and probing ports touch the disk: a worker thread does it. The thread
        # cannot be cancelled, so a cancellation waits for it, then removes what it made.
        prepared = asyncio.ensure_future(asyncio.to_thread(self._prepare))
        try:
            args, env = await asyncio.shield(prepared)
            # Spawned on the loop's thread: when that is the main thread, the parent-death signal
            # is tied to a thread that lives as long as the process.
            self._spawn(args, env)
            deadline = time.monotonic() + self.startup_timeout_s
            while not await asyncio.to_thread(self._probe):
                self._check_interrupt()
                if time.monotonic() > deadline:
                    raise self._timeout_failure()
                await asyncio.sleep(0.1)
        except BaseException:
            if self._interrupted.is_set():
                self._signal_group(signal.SIGKILL, scan=False)  # interrupted: nothing to drain, no grace
            try:
                await asyncio.wait([prepared])
            finally:
                await self._astop(keep_log_if_exited=False)
            raise
        await asyncio.to_thread(self._note_regions)
        self._ready = True
        _log.debug("tritonserver ready: %s %s", self.http_url, self.grpc_url)
        return self

    # -- stopping -------------------------------------------------------------------------

    def _signal_group(self, sig: signal.Signals, *, scan: bool = True) -> None:
        """Signal the server's process group while it is certainly ours.

        Once the leader is reaped, its pid (the group id) may go to a stranger's group as soon as no
        member of ours is left: then only a scan of /proc (``scan``) can tell that members remain.
        """
        if self._proc is None:
            return
        if self._proc.returncode is not None and not (scan and self.processes()):
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._proc.pid, sig)

    def _group_alive(self) -> bool:
        if self._proc is None:
            return False
        # Zombies do not count: processes() asks /proc for living members carrying our marker.
        return self._proc.poll() is None or bool(self.processes())

    def _stubs(self) -> set[int]:
        """The group's processes other than the server: the Python backend's stubs, one per model instance."""
        return set(self.processes()) - {self._proc.pid} if self._proc is not None else set()

    def _stopped(self, stubs_at_term: bool) -> bool:
        """Whether stopping need not wait any longer: the group is gone, the server itself has exited, or
        (``stubs_at_term``: a ready server that had stubs when it got SIGTERM) no stub is left.

        A stub exits once its model instance has finished its requests and run ``finalize``; Triton then only
        waits for its once-a-second shutdown poll and tears itself down, a second or two that the SIGKILL which
        follows saves. A server without stubs (other backends), or one still starting (its stubs come and go
        while models load), is waited for until it exits.
        """
        if not self._group_alive():
            return True
        if self._proc is not None and self._proc.poll() is not None:
            # The server itself has gone (it died during the grace, or was dying when stop() found it alive: a
            # SIGKILLed server's sockets close before the kernel lets it be reaped). Nobody is left to drain its
            # stubs, and a busy one never exits: the SIGKILL that follows is all that is left to wait for.
            return True
        return stubs_at_term and not self._stubs()

    def _stopped_noting(self, stubs_at_term: bool) -> bool:
        """:meth:`_stopped`, noting the regions mapped now first: while a server stops, stubs still come and go (an
        auto-complete stub exits and the model's instance stub starts, with a region of its own), and a region
        first mapped during the grace period would otherwise outlive the SIGKILL unrecorded."""
        self._note_regions()
        return self._stopped(stubs_at_term)

    def _send_term(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.send_signal(signal.SIGTERM)

    def _grace_deadline(self) -> float:
        return time.monotonic() + self.stop_grace_s

    def _finish(self, *, keep_log: bool) -> None:
        """Kill whatever is left of the group, reap it, and remove the temp folder. Blocking.

        ``keep_log``: the server had exited on its own after a successful start (a crash), so its log
        is what a post-mortem needs; only the backend copy goes and ``log_path`` stays readable.
        """
        self._note_regions()  # models loaded since the start map regions of their own
        self._signal_group(signal.SIGKILL)
        for pid in self.processes():  # one that left the group still runs from the folder
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + _REAP_TIMEOUT_S
        if self._proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=_REAP_TIMEOUT_S)
        # The stubs got the SIGKILL too; the kernel needs a moment to tear them down.
        while self.processes() and time.monotonic() < deadline:
            time.sleep(0.02)
        if not self.processes():
            self._remove_regions()
        if self._workdir is not None:
            shutil.rmtree(self._workdir / "backends" if keep_log else self._workdir, ignore_errors=True)
        self._active = False
        self._ready = False
        self._interrupted.clear()
        _LIVE.discard(self)

    def _should_keep_log(self, keep_log_if_exited: bool) -> bool:
        return keep_log_if_exited and self._proc is not None and self._proc.poll() is not None

    def _stop(self, *, keep_log_if_exited: bool) -> None:
        if not self._active:
            return
        keep_log = self._should_keep_log(keep_log_if_exited)
        try:
            self._note_regions()
            # A server that has exited has nobody left to drain its stubs: they get SIGKILL at once, no grace.
            if self._proc is not None and self._proc.poll() is None:
                stubs_at_term = self._ready and bool(self._stubs())
                self._send_term()
                deadline = self._grace_deadline()
                while not self._stopped_noting(stubs_at_term) and time.monotonic() < deadline:
                    if self._interrupted.wait(0.05):
                        break
        finally:
            self._finish(keep_log=keep_log)

    async def _astop(self, *, keep_log_if_exited: bool) -> None:
        if not self._active:
            return
        keep_log = self._should_keep_log(keep_log_if_exited)
        try:
            # As in _stop: a server that has exited gets no grace.
            if self._proc is not None and self._proc.poll() is None:
                stubs_at_term = self._ready and bool(await asyncio.to_thread(self._stubs))
                self._send_term()
                await asyncio.to_thread(self._note_regions)  # while the group still lives to be read
                deadline = self._grace_deadline()
                while time.monotonic() < deadline and not self._interrupted.is_set():
                    if await asyncio.to_thread(self._stopped_noting, stubs_at_term):
                        break
                    await asyncio.sleep(0.05)
        finally:
            # SIGKILL now, on the loop's thread: it never blocks (no /proc scan), and it happens even
            # if this task is cancelled again while the rest runs.
            self._signal_group(signal.SIGKILL, scan=False)
            # Reaping and removing the folder block; a worker thread does them. Shielded so that a
            # second cancellation cannot drop the job before a busy executor has started it.
            await asyncio.shield(asyncio.to_thread(self._finish, keep_log=keep_log))

    def stop(self) -> None:
        """SIGTERM, wait up to ``stop_grace_s``, then SIGKILL the whole group. Idempotent.

        The wait ends early once the server has exited, or once every Python-backend stub it had has exited
        (each model has finished its requests and run ``finalize``; what Triton does after that is not worth the
        second or two it takes).
        """
        self._stop(keep_log_if_exited=True)

    def kill(self) -> None:
        """SIGKILL the server and its stubs at once, with no grace, as a machine failure would; then reap them and
        remove the temp folder. For tests of what clients do when a server dies. Idempotent."""
        if self._active:
            self._finish(keep_log=False)

    async def astop(self) -> None:
        """Async :meth:`stop`, never blocking the loop; if cancelled while waiting, it kills at once and re-raises."""
        await self._astop(keep_log_if_exited=True)

    # -- context managers -----------------------------------------------------------------

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    async def __aenter__(self) -> Self:
        return await self.astart()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.astop()


@atexit.register
def _stop_all() -> None:
    for server in list(_LIVE):
        with contextlib.suppress(Exception):
            server.stop()
