"""``triton-npu score``: score a file of rows through a model into an output file; resumable.

Re-running the same command after a crash or Ctrl-C continues after the last commit. Without ``--url`` an
embedded server is started on the packaged model repository, loading only the model asked for (an ensemble
brings its composing models). The summary goes to stdout, the progress bar to stderr when it is a terminal.

Every mistake in the arguments, paths, formats or checkpoint is found before a server starts, and reported as one
line on stderr with its own exit code (:data:`EXIT_CODES`, also in ``--help`` and docs/scoring.md). So is every
mistake the model's config shows (a stateful model, a batch size over its max, an output it lacks, several outputs
for one ``.npy``, an input file every row of which it would refuse): read from the packaged repository's
``config.pbtxt`` before the embedded server starts, or from the server's config at ``--url`` before any file is
opened. The SDK's messages name its keyword arguments (``overwrite=True``); :func:`cli_words` turns them into the
flags a person types here (``--overwrite``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from .._errors import JobAborted, ModelNotFoundError, TritonError, UsageError
from .._local import LocalTriton, default_model_repository
from ._urls import URL_HELP, add_url_argument, checked_urls

if TYPE_CHECKING:
    from .._model import ModelSpec

__all__ = ["EXIT_CODES", "add_arguments", "cli_words", "run"]

EXIT_OK = 0
EXIT_USAGE = 2  # bad arguments (argparse's own code): a malformed or out-of-range number, a missing flag
EXIT_ROWS_FAILED = 3
EXIT_ABORTED = 4
EXIT_INPUT_MISSING = 10
EXIT_INPUT_UNREADABLE = 11
EXIT_INPUT_FORMAT = 12
EXIT_OUTPUT_FORMAT = 13
EXIT_SAME_FILE = 14
EXIT_OUTPUT_EXISTS = 15
EXIT_CHECKPOINT_OTHER_JOB = 16
EXIT_CHECKPOINT_FILES = 17
EXIT_MODEL_NOT_FOUND = 18
EXIT_OUTPUT_FOLDER = 19
EXIT_ERROR = 20  # any other error the SDK raised on purpose (a server error, a local server that failed to start)
EXIT_INTERRUPTED = 130

EXIT_CODES: dict[int, str] = {
    EXIT_OK: "done; failed rows, if any, within --max-failed",
    EXIT_USAGE: "bad arguments (a missing flag, a malformed or out-of-range number), or a model or input the job "
                "cannot use (stateful, --batch-size over its max, several outputs for one .npy, a column or dtype "
                "every row would fail on)",
    EXIT_ROWS_FAILED: "the job finished, but more rows failed than --max-failed allows (see the errors file)",
    EXIT_ABORTED: "the server stayed unreachable past the job's patience: re-run to resume",
    EXIT_INPUT_MISSING: "the input file does not exist",
    EXIT_INPUT_UNREADABLE: "the input cannot be read as rows (a directory, no permission, a CSV without header, ...)",
    EXIT_INPUT_FORMAT: "the input's format is unknown (its suffix; --input-format)",
    EXIT_OUTPUT_FORMAT: "the output's format is unknown (its suffix; --output-format)",
    EXIT_SAME_FILE: "an output, errors or checkpoint path is the input (also through a link), or two are one file",
    EXIT_OUTPUT_EXISTS: "an output, errors or checkpoint path holds a file this job did not write, or a symlink: "
                        "--overwrite replaces it",
    EXIT_CHECKPOINT_OTHER_JOB: "the checkpoint belongs to another job (the input or options changed): --overwrite "
                               "starts over",
    EXIT_CHECKPOINT_FILES: "the checkpoint disagrees with its files (the output missing or cut short): restore them, "
                           "or delete the checkpoint (or --overwrite) to start over",
    EXIT_MODEL_NOT_FOUND: "no such model (among the packaged models, or on --url)",
    EXIT_OUTPUT_FOLDER: "the folder of an output, errors or checkpoint path does not exist, or is not writable",
    EXIT_ERROR: "another error (a server error, an embedded server that failed to start, no server at --url)",
    EXIT_INTERRUPTED: "interrupted (Ctrl-C): re-run the same command to resume",
}


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, given {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, given {text!r}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, given {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, given {text!r}")
    return value


def _max_failed(text: str) -> int | float:
    """A count of rows (``10``), or a share of the job's rows (``0.01``, ``1%``)."""
    t = text.strip()
    try:
        if t.endswith("%"):
            share = float(t[:-1]) / 100
        elif any(c in t for c in ".eE"):
            share = float(t)
        else:
            count = int(t)
            if count < 0:
                raise ValueError
            return count
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a row count (10) or a share of the rows (0.01 or 1%), given {text!r}"
        ) from None
    if not 0.0 <= share <= 1.0:
        raise argparse.ArgumentTypeError(f"a share of the rows is between 0 and 1 (0% and 100%), given {text!r}")
    return share


def _help_epilog() -> str:
    lines = ["exit codes:"]
    lines += [f"  {code:>3}  {text}" for code, text in EXIT_CODES.items()]
    return "\n".join(lines)


def _error_one_line(message: str) -> NoReturn:
    print(f"triton-npu score: {_one_line(message)}", file=sys.stderr)
    sys.exit(EXIT_USAGE)


def _one_line(message: str) -> str:
    return " ".join(cli_words(message).split("\n"))


# The SDK's words for its keyword arguments, and the flags that stand for them here. Each SDK message that names an
# argument says so in one of these phrases (tests/test_cli_score.py meets every one through the command line).
_WORDS: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"(\w+)=True \((--[\w-]+)\)"), r"\2"),  # "overwrite=True (--overwrite)"
    (re.compile(r"(\w+)=\S* \((--[\w-]+)\)"), r"\2"),  # "outputs=[NAME] (--output-name)", "keep= (--keep)"
    (re.compile(r"pass format= one of ([\w, ]+) \((--(?:input|output)-format) on the command line\)"),
     r"pass \2, one of \1"),
    (re.compile(r"\ballow_lossy=True"), "--allow-lossy"),
    (re.compile(r"\(max_line_bytes\)"), "(--max-line-bytes)"),
    (re.compile(r"\bbatch_size must be"), "--batch-size must be"),
    (re.compile(r"\(output=\.\.\.\)"), "(--output-name)"),
    (re.compile(r"\(patience_s=([\d.]+)\)"), r"(its patience, \1 s)"),
    (re.compile(r"\bscore\(\) "), "triton-npu score "),
]


def cli_words(message: str) -> str:
    """An SDK message with its keyword arguments named as this command's flags (``overwrite=True`` ->
    ``--overwrite``); the SDK keeps its Python words for Python callers."""
    for pattern, flag in _WORDS:
        message = pattern.sub(flag, message)
    return message


class _AppendColumns(argparse.Action):
    """``--keep id --keep a,b``: each comma-separated name, in order, once."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        names = list(getattr(namespace, self.dest, None) or [])
        for piece in str(values).split(","):
            name = piece.strip()
            if not name:
                parser.error(f"{option_string}: an empty column name in {values!r} (a stray comma?)")
            if name not in names:
                names.append(name)
        setattr(namespace, self.dest, names)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="the model to score with (stateless, batched)")
    p.add_argument("--input", required=True, help="rows: .jsonl, .csv, .npy, .txt (a row per line), .parquet")
    p.add_argument("--output", required=True, help="results: .jsonl, .npy (one output) or .parquet")
    p.add_argument("--errors", default=None, help="refused rows and why (default OUTPUT.errors.jsonl)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace output, errors or checkpoint files this job did not write (a symlink: the link "
                        "itself, never its target), and start over from another job's checkpoint; never the input")
    p.add_argument("--max-failed", type=_max_failed, default=0, metavar="N|SHARE",
                   help="failed rows tolerated before the exit code says so (3): a count (default 0) or a share of "
                        "the job's rows (0.01 or 1%%)")
    p.add_argument("--concurrency", type=_positive_int, default=4, help="requests in flight (default 4)")
    p.add_argument("--batch-size", type=_positive_int, default=None, help="rows per request (default: the model's max)")
    p.add_argument("--output-name", action="append", default=None,
                   help="only this output (repeatable); a .npy output holds one, so a model of several outputs needs "
                        "it there (JSONL and Parquet hold them all)")
    p.add_argument("--keep", action=_AppendColumns, default=[], metavar="COLUMN",
                   help="carry this input column (an id) to each output row, beside the outputs (repeatable, or a "
                        "comma-separated list; JSONL, CSV or Parquet in, JSONL or Parquet out)")
    p.add_argument("--allow-lossy", action="store_true",
                   help="cast numbers whatever they lose (a float64 .npy into an FP32 input); without it such rows "
                        "are refused")
    p.add_argument("--keep-checkpoint", action="store_true",
                   help="keep OUTPUT.checkpoint.json and an empty errors file when the job is complete (removed by "
                        "default; kept, a re-run of the finished job does nothing instead of refusing the output as "
                        "a file no checkpoint vouches for)")
    p.add_argument("--input-format", default=None, help="override the input format (jsonl, csv, npy, txt, parquet)")
    p.add_argument("--output-format", default=None, help="override the output format (jsonl, npy, parquet)")
    p.add_argument("--max-line-bytes", type=_positive_int, default=None,
                   help="a longer line of a JSONL, CSV or text input is an error row (default 8 MiB)")
    p.add_argument("--shared-memory", action="store_true", help="send tensors through system shared memory")
    add_url_argument(p, help=URL_HELP + "; neither given: start one here")
    p.add_argument("--commit-every", type=_positive_float, default=1.0, help="seconds between commits (default 1)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar even on a terminal")
    p.add_argument("--startup-timeout", type=_positive_float, default=180.0,
                   help="seconds to wait for an embedded server")
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = _help_epilog()
    # One line on stderr, not argparse's usage block: the same shape as every other mistake.
    p.error = _error_one_line  # type: ignore[method-assign]


def _preflight(ns: argparse.Namespace) -> None:
    """Every check that needs no server: paths, formats, the checkpoint, the input's own structure; and, for the
    embedded server, the model's config as its repository holds it."""
    url = checked_urls(ns.url)
    from .._jobs import InputFileError, JobPathError, plan_job, read_rows, repository_spec

    plan = plan_job(
        ns.input, ns.output, model=ns.model, errors=ns.errors, batch_size=ns.batch_size, outputs=ns.output_name,
        input_format_name=ns.input_format, output_format_name=ns.output_format, overwrite=ns.overwrite, apply=False,
        keep=ns.keep,
    )
    assert plan.source is not None
    try:
        read_rows(plan.source, input_names=(), format=plan.input_format)  # a header, a footer: no rows read
    except JobPathError:
        raise
    except (ValueError, OSError) as err:
        raise InputFileError(f"input file {plan.source}: {err}", path=plan.source, role="input") from err
    if url is None:
        # The embedded server serves this repository as it is on disk (no auto-complete): its config is the model's.
        spec = repository_spec(default_model_repository(), ns.model)
        if spec is None:
            raise ModelNotFoundError(f"no model {ns.model!r} among the packaged server models: pass --url",
                                     model=ns.model)
        _check_job(ns, spec, plan.source, plan.input_format)


def _check_job(ns: argparse.Namespace, spec: ModelSpec, source: Path | None, input_format: str | None) -> None:
    """The model and options (stateful, batch size, outputs), then the input file's columns or dtype, against
    ``spec``: from the repository before a server starts, or from the server before any file is opened."""
    from .._jobs import check_model, check_source, output_format

    check_model(spec, batch_size=ns.batch_size, concurrency=ns.concurrency, outputs=ns.output_name,
                output_format=output_format(ns.output, ns.output_format), keep=ns.keep)
    if source is not None and input_format is not None:
        check_source(spec, source, input_format, allow_lossy=ns.allow_lossy, keep=ns.keep)


async def _main(ns: argparse.Namespace) -> int:
    from .._client import Client
    from .._jobs import score

    async with contextlib.AsyncExitStack() as stack:
        url: str | tuple[str, ...] | None = checked_urls(ns.url)
        if url is None:
            print(f"starting tritonserver for model {ns.model!r} ...", file=sys.stderr, flush=True)
            server = LocalTriton(
                default_model_repository(), model_control_mode="explicit", load_models=[ns.model],
                startup_timeout_s=ns.startup_timeout,
            )
            await stack.enter_async_context(server)
            url = server.grpc_url
        client = await stack.enter_async_context(Client(url, timeout_s=60.0))
        model = await client.model(ns.model)
        # The server's own config (a model at --url was not read before): every check again, before any file opens.
        from .._jobs import input_format

        _check_job(ns, model.spec, Path(ns.input), input_format(ns.input, ns.input_format))
        extra = {} if ns.max_line_bytes is None else {"max_line_bytes": ns.max_line_bytes}
        summary = await score(
            model, ns.input, ns.output, errors=ns.errors, concurrency=ns.concurrency, batch_size=ns.batch_size,
            outputs=ns.output_name, progress=False if ns.no_progress else None, shared_memory=ns.shared_memory,
            input_format=ns.input_format, output_format=ns.output_format, commit_every_s=ns.commit_every,
            overwrite=ns.overwrite, allow_lossy=ns.allow_lossy, keep=ns.keep, keep_checkpoint=ns.keep_checkpoint,
            **extra,
        )
        print(summary, flush=True)
    failed, total = summary.job_rows_failed, summary.job_rows
    allowed = ns.max_failed if isinstance(ns.max_failed, int) else math.floor(ns.max_failed * total)
    if failed > allowed:
        print(f"triton-npu score: {failed:,} of {total:,} rows failed, more than --max-failed {ns.max_failed} "
              f"allows ({allowed:,}): see {summary.errors}", file=sys.stderr)
        return EXIT_ROWS_FAILED
    return EXIT_OK


def _exit_code(err: TritonError) -> int:
    from .._errors import (
        CheckpointFilesMismatch,
        CheckpointMismatch,
        InputFileError,
        InputFileNotFound,
        OutputExistsError,
        OutputFolderError,
        SameFileError,
        UnknownFormatError,
    )

    table: list[tuple[type[BaseException], int | Callable[[TritonError], int]]] = [
        (InputFileNotFound, EXIT_INPUT_MISSING),
        (InputFileError, EXIT_INPUT_UNREADABLE),
        (UnknownFormatError, lambda e: EXIT_INPUT_FORMAT if getattr(e, "role", "") == "input" else EXIT_OUTPUT_FORMAT),
        (SameFileError, EXIT_SAME_FILE),
        (OutputExistsError, EXIT_OUTPUT_EXISTS),
        (OutputFolderError, EXIT_OUTPUT_FOLDER),
        (CheckpointFilesMismatch, EXIT_CHECKPOINT_FILES),
        (CheckpointMismatch, EXIT_CHECKPOINT_OTHER_JOB),
        (ModelNotFoundError, EXIT_MODEL_NOT_FOUND),
        (JobAborted, EXIT_ABORTED),
        (UsageError, EXIT_USAGE),
    ]
    for kind, code in table:
        if isinstance(err, kind):
            return code(err) if callable(code) else code
    return EXIT_ERROR


def run(ns: argparse.Namespace) -> int:
    """``triton-npu score``: see the module docstring."""
    try:
        _preflight(ns)
        return asyncio.run(_main(ns))
    except TritonError as err:
        print(f"triton-npu score: {_one_line(str(err))}", file=sys.stderr)
        return _exit_code(err)
    except KeyboardInterrupt:
        # score() committed what it had written before the interrupt reached it.
        print(f"\ninterrupted: re-run the same command to resume ({ns.output})", file=sys.stderr)
        return EXIT_INTERRUPTED
