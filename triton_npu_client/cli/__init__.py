"""``triton-npu``: the command line. Argument parsing, printing and exit codes only.

Subcommands register themselves in :data:`COMMANDS`; each gets its own parser and returns an exit code.
Errors the SDK raises on purpose (:class:`TritonError`) become one paragraph on stderr and exit 2,
never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from .._errors import TritonError
from .._version import __version__
from . import _chat, _fleet, _openai, _score, _serve, _stubs

__all__ = ["main"]

Command = tuple[Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int], str]
COMMANDS: dict[str, Command] = {}


COMMANDS["serve"] = (
    _serve.add_arguments,
    _serve.run,
    "run a local tritonserver in the foreground until Ctrl-C (--checkpoint DIR: serve a chat checkpoint)",
)


COMMANDS["stubs"] = (
    _stubs.add_arguments,
    _stubs.run,
    "generate typed input/output classes from a model repository, or from a running server (--url)",
)


COMMANDS["chat"] = (_chat.add_arguments, _chat.run, "chat with a chat model in the terminal, replies streamed")
COMMANDS["score"] = (_score.add_arguments, _score.run, "score a file of rows through a model; resumable, in order")
COMMANDS["fleet"] = (_fleet.add_arguments, _fleet.run, "each replica's health, READY models and load, one line each")
COMMANDS["openai"] = (
    _openai.add_arguments,
    _openai.run,
    "serve the OpenAI HTTP API (chat completions, embeddings, responses) in front of a server or a fleet",
)


class _Parser(argparse.ArgumentParser):
    """argparse with a mistake reported as one line (``triton-npu VERB: message``) and exit 2, not a usage block:
    the same shape as every mistake a verb finds itself. Subparsers are made of this class too."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: {' '.join(message.split())}", file=sys.stderr)
        sys.exit(2)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="triton-npu", description="Triton Inference Server client tools.")
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
