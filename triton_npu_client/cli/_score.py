"""``triton-npu score``: score a file of rows through a model into an output file; resumable.

Re-running the same command after a crash or Ctrl-C continues after the last commit. Without ``--url`` an
embedded server is started on the packaged model repository, loading only the model asked for (an ensemble
brings its composing models). The summary goes to stdout, the progress bar to stderr when it is a terminal.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys

from .._errors import UsageError
from .._local import LocalTriton, default_model_repository

__all__ = ["add_arguments", "run"]

EXIT_INTERRUPTED = 130


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="the model to score with (stateless, batched)")
    p.add_argument("--input", required=True, help="rows: .jsonl, .csv, .npy, .txt (a row per line), .parquet")
    p.add_argument("--output", required=True, help="results: .jsonl, .npy (one output) or .parquet")
    p.add_argument("--errors", default=None, help="refused rows and why (default OUTPUT.errors.jsonl)")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight (default 4)")
    p.add_argument("--batch-size", type=int, default=None, help="rows per request (default: the model's max)")
    p.add_argument("--output-name", action="append", default=None, help="only this output (repeatable)")
    p.add_argument("--input-format", default=None, help="override the input format (jsonl, csv, npy, txt, parquet)")
    p.add_argument("--output-format", default=None, help="override the output format (jsonl, npy, parquet)")
    p.add_argument("--shared-memory", action="store_true", help="send tensors through system shared memory")
    p.add_argument("--url", default=None, help="server (grpc://host:port or http://...); default: start one here")
    p.add_argument("--commit-every", type=float, default=1.0, help="seconds between commits (default 1)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar even on a terminal")
    p.add_argument("--startup-timeout", type=float, default=180.0, help="seconds to wait for an embedded server")


async def _main(ns: argparse.Namespace) -> int:
    from .._client import Client
    from .._jobs import score

    if ns.concurrency < 1:
        raise UsageError(f"--concurrency must be >= 1, got {ns.concurrency}")
    async with contextlib.AsyncExitStack() as stack:
        url = ns.url
        if url is None:
            repository = default_model_repository()
            if not (repository / ns.model / "config.pbtxt").is_file():
                raise UsageError(f"no model {ns.model!r} among the packaged server models: pass --url")
            print(f"starting tritonserver for model {ns.model!r} ...", file=sys.stderr, flush=True)
            server = LocalTriton(
                repository, model_control_mode="explicit", load_models=[ns.model],
                startup_timeout_s=ns.startup_timeout,
            )
            await stack.enter_async_context(server)
            url = server.grpc_url
        client = await stack.enter_async_context(Client(url, timeout_s=60.0))
        model = await client.model(ns.model)
        summary = await score(
            model, ns.input, ns.output, errors=ns.errors, concurrency=ns.concurrency, batch_size=ns.batch_size,
            outputs=ns.output_name, progress=False if ns.no_progress else None, shared_memory=ns.shared_memory,
            input_format=ns.input_format, output_format=ns.output_format, commit_every_s=ns.commit_every,
        )
        print(summary, flush=True)
    return 0


def run(ns: argparse.Namespace) -> int:
    """``triton-npu score``: see the module docstring."""
    try:
        return asyncio.run(_main(ns))
    except KeyboardInterrupt:
        # score() committed what it had written before the interrupt reached it.
        print(f"\ninterrupted: re-run the same command to resume ({ns.output})", file=sys.stderr)
        return EXIT_INTERRUPTED
