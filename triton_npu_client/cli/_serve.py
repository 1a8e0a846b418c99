"""``triton-npu serve``: a local tritonserver in the foreground until Ctrl-C.

Every mistake on the command line (a port that is not a number or is taken, a ``--models`` name the repository does
not have, flags that do not go together, a bad checkpoint folder) is one line on stderr and exit 2, found before any
server starts. While the models load, one line per model says when it is ready (read from the server's log: Triton
opens its endpoints only once the models it starts with have loaded, so there is no index to ask before; the log's
own timestamps give each model's time). Then the addresses, until a signal:

- **Ctrl-C** (SIGINT) at any moment, during the start too, stops the server and exits 130; **SIGTERM** the same and
  exits 143 (as ``triton-npu openai`` does). A start is cut short at once (nothing is served yet); a ready server
  gets ``--stop-grace`` seconds for its in-flight requests and its models' ``finalize``, and a second signal kills
  it at once.
- A server that dies on its own ends the command with status 1 and the last lines of its log.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Final

from .._errors import LocalServerError, PortInUseError, UsageError
from .._local import LocalTriton, ModelLoad, default_model_repository, find_tritonserver
from ._chat import add_checkpoint_arguments, checkpoint_repository

__all__ = ["DEFAULT_PORTS", "add_arguments", "run"]

EXIT_SIGINT: Final = 130
EXIT_SIGTERM: Final = 143
#: Triton's own defaults, so that a client's usual URL (grpc://localhost:8001) reaches the server.
DEFAULT_PORTS: Final = {"--http-port": 8000, "--grpc-port": 8001, "--metrics-port": 8002}
_PORT_DEST: Final = {"--http-port": "http_port", "--grpc-port": "grpc_port", "--metrics-port": "metrics_port"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model-repository",
        default=None,
        help="model repository (default: the project's server_models/; with --checkpoint: none, only the chat model)",
    )
    p.add_argument(
        "--models",
        default=None,
        metavar="A,B",
        help=(
            "load only these models of the repository (comma-separated; an ensemble brings its steps; with "
            "--checkpoint its chat model is loaded too); implies --model-control-mode explicit"
        ),
    )
    p.add_argument(
        "--tritonserver",
        default=None,
        help="tritonserver binary (default: $TRITONSERVER, /opt/tritonserver, the bundled one)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    for flag, default in DEFAULT_PORTS.items():
        what = {"--http-port": "HTTP/REST", "--grpc-port": "gRPC", "--metrics-port": "Prometheus metrics"}[flag]
        p.add_argument(
            flag,
            dest=_PORT_DEST[flag],
            default=str(default),
            metavar="PORT",
            help=f"the {what} port (default {default}, as Triton's; 0: any free port)",
        )
    p.add_argument(
        "--model-control-mode",
        choices=("none", "explicit", "poll"),
        default=None,
        help=(
            "none: serve the models loaded at start (the default); explicit: models can also be loaded and unloaded "
            "through the API (all, or --models, are loaded at start; the default with --models); poll: the server "
            "follows changes in the repository"
        ),
    )
    p.add_argument("--log-verbose", type=int, default=0, help="tritonserver's --log-verbose level (default 0)")
    p.add_argument("--startup-timeout", type=float, default=120.0, help="seconds to wait for readiness (default 120)")
    p.add_argument(
        "--stop-grace",
        type=float,
        default=2.5,
        help=(
            "seconds a stop waits for in-flight requests and the models' finalize before it kills the server "
            "(default 2.5, so Ctrl-C ends the command within 5 s; a second Ctrl-C kills at once)"
        ),
    )
    add_checkpoint_arguments(p, aliases=("--chat",))


def _port(flag: str, given: str) -> int | None:
    """The port a flag names: None for 0 (LocalTriton then takes a free one). One line for anything else."""
    try:
        port = int(given.strip(), 10)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise UsageError(f"{flag}: expected a port number in 0..65535 (0: any free port), given {given!r}")
    return port or None


def _ports(ns: argparse.Namespace) -> dict[str, int | None]:
    ports = {flag: _port(flag, getattr(ns, dest)) for flag, dest in _PORT_DEST.items()}
    seen: dict[int, str] = {}
    for flag, port in ports.items():
        if port is None:
            continue
        if port in seen:
            raise UsageError(f"{seen[port]} and {flag} are both {port}: each needs a port of its own")
        seen[port] = flag
    return ports


def _model_names(given: str | None) -> tuple[str, ...] | None:
    if given is None:
        return None
    names = tuple(dict.fromkeys(n.strip() for n in given.split(",") if n.strip()))
    if not names:
        raise UsageError(f"--models: expected model names separated by commas, given {given!r}")
    return names


def _repository_models(repository: Path) -> list[str]:
    """The models a repository holds: its sub-folders, as Triton reads them."""
    if not repository.is_dir():
        raise UsageError(f"--model-repository {repository}: no such folder")
    return sorted(e.name for e in repository.iterdir() if e.is_dir() and not e.name.startswith("."))


def _check_models(wanted: tuple[str, ...], available: list[str], repository: Path) -> None:
    unknown = [n for n in wanted if n not in available]
    if unknown:
        there = ", ".join(available) or "none"
        names = ", ".join(repr(n) for n in unknown)
        raise UsageError(f"--models: no model {names} in {repository} (models there: {there})")


class _Signals:
    """What SIGINT and SIGTERM ask: the first one decides the exit status; each hurries the server along."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.received: list[int] = []
        self.server: LocalTriton | None = None
        self.serving = False

    def handle(self, signum: int, frame: FrameType | None) -> None:
        self.received.append(signum)
        # A start is cut short at once (nothing is served yet); a ready server gets its grace, unless this is the
        # second signal. The server's interrupt() only sets a flag, which a signal handler may do.
        if self.server is not None and (not self.serving or len(self.received) > 1):
            self.server.interrupt()
        self.stop.set()

    @property
    def exit_code(self) -> int:
        return EXIT_SIGTERM if self.received[0] == signal.SIGTERM else EXIT_SIGINT


def run(ns: argparse.Namespace) -> int:
    """``triton-npu serve``: see the module docstring."""
    signals = _Signals()
    previous = {s: signal.signal(s, signals.handle) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _serve(ns, signals)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _serve(ns: argparse.Namespace, signals: _Signals) -> int:
    """The repository's models (or only ``--models``); with ``--checkpoint DIR`` the chat model generated from that
    checkpoint, alone or beside ``--model-repository``'s models (a second repository, so a name both have is refused
    before the server starts)."""
    ports = _ports(ns)
    wanted = _model_names(ns.models)
    mode = ns.model_control_mode or ("explicit" if wanted is not None else "none")
    if wanted is not None and mode != "explicit":
        raise UsageError(
            f"--models loads only those models, which needs --model-control-mode explicit (given {mode}); "
            "leave --model-control-mode out"
        )
    find_tritonserver(ns.tritonserver)  # no binary: said now, not after the rest is prepared
    with contextlib.ExitStack() as stack:
        generated = checkpoint_repository(ns, "--checkpoint", prefix=f"triton-npu-serve-{os.getpid()}-")
        repository: Path | None = None if ns.model_repository is None else Path(ns.model_repository)
        extra: list[str] = []
        auto_complete: bool | None = None
        chat: str | None = None
        chat_name: str | None = None
        if generated is not None:
            chat_repository, chat_name = stack.enter_context(generated)
            chat = f"model {chat_name!r} from checkpoint {ns.checkpoint}"
            if repository is None:
                # The generated config is complete: Triton's auto-complete pass would only start one more stub.
                repository, auto_complete = chat_repository, False
            elif (repository / chat_name).exists():
                raise UsageError(
                    f"--model-repository {repository} has a model {chat_name!r} already: pass another --name"
                )
            else:
                extra.append(f"--model-repository={chat_repository}")
        resolved = Path(repository or default_model_repository()).resolve()
        available = _repository_models(resolved)
        if chat_name is not None and chat_name not in available:
            available = sorted([*available, chat_name])
        load: tuple[str, ...] | None = None
        if wanted is not None:
            _check_models(wanted, available, resolved)
            load = wanted if chat_name is None or chat_name in wanted else (*wanted, chat_name)
        server = LocalTriton(
            resolved,
            tritonserver=ns.tritonserver,
            host=ns.host,
            http_port=ports["--http-port"],
            grpc_port=ports["--grpc-port"],
            metrics_port=ports["--metrics-port"],
            log_verbose=ns.log_verbose,
            model_control_mode=mode,
            load_models=load,
            startup_timeout_s=ns.startup_timeout,
            auto_complete_config=auto_complete,
            stop_grace_s=ns.stop_grace,
            extra_args=extra,
        )
        try:
            server.check_ports()
        except PortInUseError as err:
            flag = next(f for f, p in ports.items() if p == err.port)
            raise UsageError(
                f"{flag} {err.port}: the port is in use on {ns.host} (another server?): pass another port, "
                "or 0 for any free one"
            ) from None
        if signals.stop.is_set():
            return signals.exit_code
        signals.server = server
        return _run_server(server, chat, signals, len(load) if load is not None else len(available))


def _print_load(load: ModelLoad) -> None:
    version = f" (version {load.version})" if load.version else ""
    print(f"  loaded   {load.name}{version} in {load.seconds:.1f} s", flush=True)


def _run_server(server: LocalTriton, chat: str | None, signals: _Signals, models: int) -> int:
    started = time.monotonic()
    try:
        counted = f"{models} model{'s' if models != 1 else ''}"
        print(f"starting tritonserver on {server.model_repository} ({counted}) ...", flush=True)
        try:
            server.start(on_load=_print_load)
        except LocalServerError:
            if signals.stop.is_set():  # the start was interrupted: that, not its error, is the outcome
                print("interrupted while starting; tritonserver stopped", file=sys.stderr)
                return signals.exit_code
            raise
        signals.serving = True
        if signals.stop.is_set():  # a signal came just as the start finished
            return signals.exit_code
        print(f"tritonserver ready in {time.monotonic() - started:.1f} s (pid {server.pid}, repository "
              f"{server.model_repository})")  # fmt: skip
        if chat is not None:
            print(f"  chat     {chat}")
        print(f"  gRPC     {server.grpc_url}")
        print(f"  HTTP     {server.http_url}")
        print(f"  metrics  {server.metrics_url}")
        print(f"  log      {server.log_path}")
        print("Press Ctrl-C to stop.", flush=True)
        while not signals.stop.wait(0.5):
            if not server.is_running:
                tail = "\n".join(server.log_tail(10))
                print(f"tritonserver exited unexpectedly. Last lines:\n{tail}", file=sys.stderr)
                return 1
        print("stopping tritonserver ...", flush=True)
        return signals.exit_code
    finally:
        server.stop()
