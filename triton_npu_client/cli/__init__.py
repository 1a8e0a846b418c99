"""``triton-npu``: the command line. Argument parsing, printing and exit codes only.

Subcommands register themselves in :data:`COMMANDS`; each gets its own parser and returns an exit code.
Errors the SDK raises on purpose (:class:`TritonError`) become one paragraph on stderr and exit 2,
never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType

from .._errors import TritonError, UsageError
from .._local import LocalTriton
from .._version import __version__
from . import _chat, _fleet, _openai, _score

__all__ = ["main"]

Command = tuple[Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int], str]
COMMANDS: dict[str, Command] = {}


def _serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model-repository",
        default=None,
        help="model repository (default: the project's server_models/; with --chat: none, only the chat model)",
    )
    p.add_argument(
        "--tritonserver",
        default=None,
        help="tritonserver binary (default: $TRITONSERVER, /opt/tritonserver, the bundled one)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--http-port", type=int, default=None)
    p.add_argument("--grpc-port", type=int, default=None)
    p.add_argument("--metrics-port", type=int, default=None)
    p.add_argument("--log-verbose", type=int, default=0)
    p.add_argument("--model-control-mode", choices=("none", "explicit", "poll"), default="none")
    p.add_argument("--startup-timeout", type=float, default=120.0, help="seconds to wait for readiness")
    _chat.add_checkpoint_arguments(p, "--chat")


def _serve(ns: argparse.Namespace) -> int:
    """``triton-npu serve``: the repository's models; with ``--chat DIR`` the chat model generated from that
    checkpoint, alone or beside ``--model-repository``'s models (a second repository, so a name both have is
    refused before the server starts)."""
    with contextlib.ExitStack() as stack:
        generated = _chat.checkpoint_repository(ns, "--chat", prefix=f"triton-npu-serve-{os.getpid()}-")
        repository: str | Path | None = ns.model_repository
        extra: list[str] = []
        auto_complete: bool | None = None
        chat: str | None = None
        if generated is not None:
            chat_repository, name = stack.enter_context(generated)
            chat = f"model {name!r} from checkpoint {ns.checkpoint}"
            if repository is None:
                # The generated config is complete: Triton's auto-complete pass would only start one more stub.
                repository, auto_complete = chat_repository, False
            elif (Path(repository) / name).exists():
                raise UsageError(f"--model-repository {repository} has a model {name!r} already: pass another --name")
            else:
                extra.append(f"--model-repository={chat_repository}")
        server = LocalTriton(
            repository,
            tritonserver=ns.tritonserver,
            host=ns.host,
            http_port=ns.http_port,
            grpc_port=ns.grpc_port,
            metrics_port=ns.metrics_port,
            log_verbose=ns.log_verbose,
            model_control_mode=ns.model_control_mode,
            startup_timeout_s=ns.startup_timeout,
            auto_complete_config=auto_complete,
            extra_args=extra,
        )
        return _run_server(server, chat)


def _run_server(server: LocalTriton, chat: str | None) -> int:
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    # SIGINT (Ctrl-C) and SIGTERM both mean "stop cleanly and exit 0".
    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.start()
        if stop.is_set():
            return 0
        print(f"tritonserver ready (pid {server.pid}, repository {server.model_repository})")
        if chat is not None:
            print(f"  chat     {chat}")
        print(f"  gRPC     {server.grpc_url}")
        print(f"  HTTP     {server.http_url}")
        print(f"  metrics  {server.metrics_url}")
        print(f"  log      {server.log_path}")
        print("Press Ctrl-C to stop.", flush=True)
        while not stop.wait(0.5):
            if not server.is_running:
                tail = "\n".join(server.log_tail(10))
                print(f"tritonserver exited unexpectedly. Last lines:\n{tail}", file=sys.stderr)
                return 1
        print("stopping tritonserver ...", flush=True)
        return 0
    finally:
        server.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)


COMMANDS["serve"] = (
    _serve_args,
    _serve,
    "run a local tritonserver in the foreground until Ctrl-C (--chat DIR: serve a chat checkpoint)",
)


def _stubs_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_repository", help="model repository whose */config.pbtxt files to read")
    p.add_argument("-o", "--output", default=None, help="module file to write (default: print to stdout)")
    p.add_argument("--model", action="append", default=[], help="only this model (repeatable; default: every model)")


def _stubs(ns: argparse.Namespace) -> int:
    from pathlib import Path

    from ._stubs import generate_stubs

    # Recorded in the generated module's docstring so a reader knows how to regenerate it; the
    # repository path is written as given, and models in sorted order, so the text stays reproducible.
    shown = [ns.model_repository, *(f"--model {m}" for m in sorted(set(ns.model)))]
    text = generate_stubs(Path(ns.model_repository), models=ns.model, command_args=" " + " ".join(shown))
    if ns.output is None:
        sys.stdout.write(text)
    else:
        Path(ns.output).write_text(text)
        print(f"wrote {ns.output}", file=sys.stderr)
    return 0


COMMANDS["stubs"] = (_stubs_args, _stubs, "generate typed input/output classes from a model repository")


COMMANDS["chat"] = (_chat.add_arguments, _chat.run, "chat with a chat model in the terminal, replies streamed")
COMMANDS["score"] = (_score.add_arguments, _score.run, "score a file of rows through a model; resumable, in order")
COMMANDS["fleet"] = (_fleet.add_arguments, _fleet.run, "each replica's health, READY models and load, one line each")
COMMANDS["openai"] = (
    _openai.add_arguments,
    _openai.run,
    "serve the OpenAI HTTP API (chat completions, embeddings, responses) in front of a server or a fleet",
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="triton-npu", description="Triton Inference Server client tools.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (add_args, _, help_text) in COMMANDS.items():
        add_args(sub.add_parser(name, help=help_text, description=help_text))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``triton-npu``; returns the process exit code."""
    ns = _parser().parse_args(argv)
    _, run, _ = COMMANDS[ns.command]
    try:
        return run(ns)
    except TritonError as err:
        print(f"triton-npu {ns.command}: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
