"""``triton-npu``: the command line. Argument parsing, printing and exit codes only.

Subcommands register themselves in :data:`COMMANDS`; each gets its own parser and returns an exit code.
Errors the SDK raises on purpose (:class:`TritonError`) become one paragraph on stderr and exit 2,
never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from .._errors import TritonError
from .._version import __version__
from . import _chat, _fleet, _openai, _score, _serve

__all__ = ["main"]

Command = tuple[Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int], str]
COMMANDS: dict[str, Command] = {}


COMMANDS["serve"] = (
    _serve.add_arguments,
    _serve.run,
    "run a local tritonserver in the foreground until Ctrl-C (--checkpoint DIR: serve a chat checkpoint)",
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
