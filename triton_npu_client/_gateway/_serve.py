"""Serving the gateway's ASGI app with uvicorn inside the caller's event loop.

::

    async with Client("grpc://127.0.0.1:8001") as client:
        async with OpenAIGateway(client, port=9000, store=SQLiteStore("responses.sqlite3")) as gateway:
            print(gateway.base_url)          # http://127.0.0.1:9000/v1: give it to OpenAI(base_url=...)
            await gateway.wait()             # until stop() (the CLI calls it on Ctrl-C)

Why uvicorn, and why in-loop: it is the ASGI server the Starlette and FastAPI ecosystem runs on (its HTTP parser
httptools where installed, pure-Python h11 otherwise), and running it in the client's loop keeps every chat, stream
and the fleet's background checks on one loop, as the SDK requires. Its own signal handling is left out: the owner
decides what a signal means.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Generator
from types import TracebackType
from typing import TYPE_CHECKING, Final, Self

import uvicorn

from .._errors import UsageError
from ._app import GatewayOptions, create_app
from ._store import ResponseStore

if TYPE_CHECKING:
    from .._client import Client

__all__ = ["OpenAIGateway"]

#: Seconds an idle keep-alive connection is kept open (nginx's default).
KEEP_ALIVE_S: Final = 75


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield  # the gateway's owner handles signals (see the module docstring)


class OpenAIGateway:
    """The OpenAI API on ``client``, listening on ``host:port`` (port 0: a free one; see :attr:`port`).

    ``store``: where responses are kept (default: in memory). ``options``: :class:`GatewayOptions`. The client is
    the caller's: the gateway never closes it. Leaving the block stops listening, lets running requests finish for
    up to ``grace_s`` seconds (then cancels them: their turns roll back), and closes the store.
    """

    def __init__(
        self,
        client: Client,
        *,
        host: str = "127.0.0.1",
        port: int = 9000,
        store: ResponseStore | None = None,
        options: GatewayOptions | None = None,
        grace_s: float = 5.0,
    ) -> None:
        if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
            raise UsageError(f"port: expected an int in 0..65535, given {port!r}")
        self.app = create_app(client, store=store, options=options)
        self._host = host
        self._port = port
        self._grace_s = grace_s
        self._server: _Server | None = None
        self._task: asyncio.Task[None] | None = None
        self._socket: socket.socket | None = None

    @property
    def port(self) -> int:
        if self._socket is None:
            raise UsageError("the gateway is not listening: enter its block first")
        return int(self._socket.getsockname()[1])

    @property
    def url(self) -> str:
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"http://{host}:{self.port}"

    @property
    def base_url(self) -> str:
        """What an OpenAI client takes as ``base_url``."""
        return f"{self.url}/v1"

    async def __aenter__(self) -> Self:
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY on accepted connections only for a listening socket made
        # so; without it Nagle holds a stream's first events behind its headers until the client's delayed ACK
        # (~40 ms on every follow-up turn). Set on the listener too: Linux copies it to what it accepts.
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.bind((self._host, self._port))
        except OSError as err:
            sock.close()
            raise UsageError(f"cannot listen on {self._host}:{self._port}: {err.strerror or err}") from None
        self._socket = sock
        config = uvicorn.Config(
            self.app,
            log_level="warning",
            lifespan="on",
            access_log=False,
            timeout_graceful_shutdown=int(max(self._grace_s, 1)),
            # Longer than the clients' own idle expiry (the openai client's is 5 s, uvicorn's default too): a
            # server that closes an idle connection first races a request just sent on it.
            timeout_keep_alive=KEEP_ALIVE_S,
            ws="none",
            http="auto",  # httptools (the openai extra brings it) parses in C; h11 where it is missing
        )
        self._server = server = _Server(config)
        self._task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]), name="triton-npu-openai")
        while not server.started:
            if self._task.done():
                self._task.result()  # startup failed: raise why
                raise UsageError("the gateway stopped while starting")
            await asyncio.sleep(0.01)
        return self

    def stop(self) -> None:
        """Ask the gateway to stop (returns at once; leaving the block waits for it)."""
        if self._server is not None:
            self._server.should_exit = True

    async def wait(self) -> None:
        """Until the gateway stops (after :meth:`stop`, or a failure)."""
        if self._task is not None:
            await asyncio.shield(self._task)

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._socket is not None:
            self._socket.close()
