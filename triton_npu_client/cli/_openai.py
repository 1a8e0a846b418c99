"""``triton-npu openai``: the OpenAI HTTP API in front of one server or a fleet, until Ctrl-C.

::

    triton-npu openai                                   # an embedded server with the packaged chat and minilm
    triton-npu openai --url grpc://10.0.0.5:8001 --url grpc://10.0.0.6:8001 --port 9000 --api-key "$KEY"
    triton-npu openai --checkpoint ./SmolLM2-135M-Instruct  # an embedded server with that checkpoint's chat model

Everything the command line says is checked before any server starts: the port, the keys, the URLs, the store
(an existing file that is not the gateway's SQLite database is refused, never overwritten). Ctrl-C stops the
gateway (running turns are cancelled and rolled back), then the embedded server, and exits 130; SIGTERM the same
and exits 143. A key given with ``--api-key`` shows in the process list: ``--api-key-env NAME`` reads it from the
environment instead.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from typing import Final

from .._errors import UsageError
from .._local import LocalTriton, default_model_repository
from ._chat import add_checkpoint_arguments, checkpoint_repository
from ._urls import URL_HELP, add_url_argument, checked_urls

__all__ = ["add_arguments", "run"]

#: The packaged models an embedded server starts with: the chat model and the sentence encoder (its two steps).
EMBEDDED: Final = ("chat", "minilm", "minilm_tokenizer", "minilm_encoder")
EXIT_SIGINT: Final = 130
EXIT_SIGTERM: Final = 143


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_url_argument(p, help=URL_HELP + " (neither given: an embedded server with the packaged chat and minilm)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=9000, help="port to listen on (default 9000; 0: a free one)")
    p.add_argument(
        "--api-key",
        action="append",
        default=None,
        metavar="KEY",
        help="a key requests must carry (Authorization: Bearer KEY); repeatable; default: no key asked",
    )
    p.add_argument(
        "--api-key-env",
        default=None,
        metavar="NAME",
        help="read a key from environment variable NAME (not shown in the process list)",
    )
    p.add_argument(
        "--store",
        default=None,
        metavar="PATH|memory",
        help="where responses are kept: an SQLite file (default: the user's data folder, "
        "e.g. ~/.local/share/triton-npu/responses.sqlite3) or 'memory' (lost when the gateway stops)",
    )
    p.add_argument("--max-turns", type=int, default=64, help="generation requests at once; beyond: 429 (default 64)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds one turn may take; beyond: 504 (default 300)")
    p.add_argument(
        "--startup-timeout", type=float, default=180.0, help="seconds to wait for an embedded server (default 180)"
    )
    add_checkpoint_arguments(p, "--checkpoint")


def _keys(ns: argparse.Namespace) -> tuple[str, ...]:
    keys = list(ns.api_key or [])
    if ns.api_key_env is not None:
        value = os.environ.get(ns.api_key_env)
        if not value:
            raise UsageError(f"--api-key-env {ns.api_key_env}: that environment variable is not set or empty")
        keys.append(value)
    for key in keys:
        if not key.strip() or key != key.strip() or any(c.isspace() for c in key):
            raise UsageError("--api-key: a key is one word without spaces (the value given is not shown)")
    return tuple(keys)


def _checked(ns: argparse.Namespace) -> None:
    if not 0 <= ns.port <= 65535:
        raise UsageError(f"--port: expected 0..65535, given {ns.port}")
    if ns.max_turns < 1:
        raise UsageError(f"--max-turns: expected an int >= 1, given {ns.max_turns}")
    if not ns.timeout > 0:
        raise UsageError(f"--timeout: expected seconds > 0, given {ns.timeout}")


async def _serve(ns: argparse.Namespace, stopped: asyncio.Event, listening: asyncio.Event) -> int:
    from .._client import Client

    try:
        from .._gateway import (
            GatewayOptions,
            MemoryStore,
            OpenAIGateway,
            ResponseStore,
            SQLiteStore,
            default_store_path,
        )
    except ImportError as err:
        raise UsageError(
            f"the gateway needs the openai extra ({err.name} is not installed): pip install 'triton-npu-client[openai]'"
        ) from None

    _checked(ns)
    keys = _keys(ns)
    urls = checked_urls(ns.url)
    generated = checkpoint_repository(ns, "--checkpoint", prefix=f"triton-npu-openai-{os.getpid()}-")
    if generated is not None and urls is not None:
        raise UsageError("--checkpoint serves the checkpoint on an embedded server: it cannot go with --url")
    async with contextlib.AsyncExitStack() as stack:
        # The store first: a wrong path is a mistake found before any server starts.
        store: ResponseStore
        persistent = ns.store != "memory"
        if persistent:
            path = Path(ns.store) if ns.store is not None else default_store_path()
            store = await SQLiteStore.open(path)
        else:
            store = MemoryStore()
        url: str | tuple[str, ...] | None = urls
        if url is None:
            if generated is not None:
                repository, name = stack.enter_context(generated)
                print(f"starting tritonserver for chat model {name!r} (checkpoint {ns.checkpoint}) ...", flush=True)
                server = LocalTriton(repository, startup_timeout_s=ns.startup_timeout, auto_complete_config=False)
            else:
                folder = Path(
                    stack.enter_context(tempfile.TemporaryDirectory(prefix=f"triton-npu-openai-{os.getpid()}-"))
                )
                for model in EMBEDDED:
                    shutil.copytree(default_model_repository() / model, folder / model)
                print(f"starting tritonserver for {', '.join(EMBEDDED[:2])} ...", flush=True)
                server = LocalTriton(folder, startup_timeout_s=ns.startup_timeout)
            await stack.enter_async_context(server)
            url = server.grpc_url
        client = await stack.enter_async_context(Client(url, timeout_s=30.0))
        options = GatewayOptions(
            api_keys=keys, max_turns=ns.max_turns, timeout_s=ns.timeout, detach_on_close=persistent
        )
        gateway = await stack.enter_async_context(
            OpenAIGateway(client, host=ns.host, port=ns.port, store=store, options=options)
        )
        models = await gateway.app.state.gateway.catalog.models(refresh=True)
        shown = ", ".join(f"{m.name} ({m.kind})" for m in models.values()) or "none yet"
        print(f"OpenAI API on {gateway.base_url}", flush=True)
        print(f"  models   {shown}")
        print(f"  store    {path if persistent else 'memory (lost when the gateway stops)'}")
        print(f"  keys     {f'{len(keys)} (Authorization: Bearer KEY)' if keys else 'none asked'}")
        print("Press Ctrl-C to stop.", flush=True)
        listening.set()
        waiting = asyncio.ensure_future(gateway.wait())
        stop = asyncio.ensure_future(stopped.wait())
        await asyncio.wait({waiting, stop}, return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if waiting.done():
            waiting.result()
            return 1
        waiting.cancel()
        print("stopping ...", flush=True)
    return 0


async def _main(ns: argparse.Namespace) -> int:
    loop = asyncio.get_running_loop()
    stopped = asyncio.Event()
    signals: list[int] = []
    listening = asyncio.Event()
    main = asyncio.current_task()
    assert main is not None

    def on_signal(signum: int) -> None:
        signals.append(signum)
        if stopped.is_set() or not listening.is_set():
            main.cancel()  # while starting (or a second signal): stop at once; everything entered is closed
        stopped.set()

    for s in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(s, on_signal, s)
    try:
        code = await _serve(ns, stopped, listening)
    except asyncio.CancelledError:
        code = 0
    finally:
        for s in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(s)
    if signals:
        return EXIT_SIGTERM if signals[0] == signal.SIGTERM else EXIT_SIGINT
    return code


def run(ns: argparse.Namespace) -> int:
    """``triton-npu openai``: see the module docstring."""
    try:
        return asyncio.run(_main(ns))
    except KeyboardInterrupt:
        print("", file=sys.stderr)
        return EXIT_SIGINT
