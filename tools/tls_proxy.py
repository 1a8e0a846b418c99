"""A small TLS-terminating TCP proxy, for testing ``https://`` against Triton's HTTP endpoint (which has no TLS).

Triton serves HTTP in clear text only; in production HTTPS comes from whatever sits in front of it (an ingress,
nginx, envoy, a service mesh). This stands in for that in the tests, with nothing to install: asyncio + ssl from
the standard library, on loopback, on a thread of its own so that it never waits on the test's event loop.
With ``client_ca`` it requires a client certificate signed by that CA (mutual TLS at the proxy).

::

    with TLSProxy(upstream=("127.0.0.1", 8000), cert_file="server.pem", key_file="server.key") as proxy:
        url = proxy.url            # "https://127.0.0.1:PORT"

By hand: ``python -m tools.tls_proxy --upstream 127.0.0.1:8000 --cert server.pem --key server.key``.
Not a production proxy: no limits, no timeouts beyond the sockets' own, loopback by default.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ssl
import threading
from types import TracebackType
from typing import Self

__all__ = ["TLSProxy"]

_CHUNK = 1 << 16


class TLSProxy:
    """Accepts TLS on ``host:port`` (port 0: a free one) and pipes the clear bytes to ``upstream`` over TCP."""

    def __init__(
        self,
        *,
        upstream: tuple[str, int],
        cert_file: str,
        key_file: str,
        client_ca: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self.upstream = upstream
        self.host = host
        self._port = port
        self._context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self._context.load_cert_chain(cert_file, key_file)
        if client_ca is not None:
            self._context.load_verify_locations(cafile=client_ca)
            self._context.verify_mode = ssl.CERT_REQUIRED
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.Server | None = None
        self._thread: threading.Thread | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("the proxy is not started")
        return int(self._server.sockets[0].getsockname()[1])

    @property
    def url(self) -> str:
        return f"https://{self.host}:{self.port}"

    def start(self) -> Self:
        """Listen (on return the port is bound and accepting)."""
        loop = asyncio.new_event_loop()
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            asyncio.set_event_loop(loop)
            try:
                self._server = loop.run_until_complete(asyncio.start_server(self._accept, self.host, self._port))
            except BaseException as err:  # reported to start()'s caller
                failure.append(err)
                ready.set()
                loop.close()
                return
            ready.set()
            loop.run_forever()
            loop.close()

        self._loop = loop
        self._thread = threading.Thread(target=run, name="tls-proxy", daemon=True)
        self._thread.start()
        ready.wait()
        if failure:
            self._thread.join()
            raise failure[0]
        return self

    def stop(self) -> None:
        """Close the listener and every open connection, and end the thread."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result()
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        self._loop = self._thread = None

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        # A connection whose task was cancelled before its first step never closed its side itself.
        for writer in list(self._writers):
            await _close(writer)
        if self._server is not None:
            await self._server.wait_closed()

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # Synchronous, so that every connection is known from the moment it exists (see _shutdown).
        self._writers.add(writer)
        task = asyncio.get_running_loop().create_task(self._serve(reader, writer))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            tls = _TLS(self._context, reader, writer)
            if not await tls.handshake():
                return
            try:
                up_reader, up_writer = await asyncio.open_connection(*self.upstream)
            except OSError:
                return  # upstream down: the client sees the connection close, as behind any proxy
            to_upstream = asyncio.ensure_future(tls.pipe_to(up_writer))
            try:
                # The connection ends when upstream's side does: a client that waits for an answer never hangs up.
                await tls.pipe_from(up_reader)
            finally:
                to_upstream.cancel()
                up_writer.close()  # now: a cancel (stop()) may interrupt the awaits below
                await asyncio.gather(to_upstream, return_exceptions=True)
                await _close(up_writer)
        except asyncio.CancelledError:
            pass  # stop() ends the open connections: each closes its sides below
        finally:
            await _close(writer)
            self._writers.discard(writer)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


class _TLS:
    """TLS over a plain asyncio stream through memory BIOs.

    asyncio's own server-side TLS drops the connection on a failed handshake without sending the alert, so the
    client only sees the connection close; real TLS terminators (envoy, HAProxy) send it ("certificate required",
    "unknown CA"), and a client can then say why it was refused. Here the alert goes out before the close.
    """

    def __init__(self, context: ssl.SSLContext, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._in, self._out = ssl.MemoryBIO(), ssl.MemoryBIO()
        self._tls = context.wrap_bio(self._in, self._out, server_side=True)
        self._reader, self._writer = reader, writer

    async def _flush(self) -> None:
        if data := self._out.read():
            self._writer.write(data)
            await self._writer.drain()

    async def handshake(self) -> bool:
        """True once the handshake is done; False (alert sent) when it failed or the client went away."""
        while True:
            try:
                self._tls.do_handshake()
            except ssl.SSLWantReadError:
                await self._flush()
                data = await self._reader.read(_CHUNK)
                if not data:
                    return False
                self._in.write(data)
                continue
            except (ssl.SSLError, ConnectionError):
                with contextlib.suppress(ConnectionError):
                    await self._flush()  # the alert
                return False
            await self._flush()
            return True

    async def pipe_to(self, upstream: asyncio.StreamWriter) -> None:
        """Decrypt what the client sends and pass it on, until either side goes away."""
        try:
            while True:
                try:
                    clear = self._tls.read(_CHUNK)
                except ssl.SSLWantReadError:
                    # Records that came with the handshake's last flight are already in; wait only when all is read.
                    await upstream.drain()
                    await self._flush()
                    data = await self._reader.read(_CHUNK)
                    if not data:
                        return
                    self._in.write(data)
                    continue
                if not clear:
                    return  # close_notify
                upstream.write(clear)
        except (ssl.SSLError, ConnectionError):
            pass  # the caller closes both sides
        finally:
            with contextlib.suppress(OSError, RuntimeError):
                if upstream.can_write_eof():
                    upstream.write_eof()

    async def pipe_from(self, upstream: asyncio.StreamReader) -> None:
        """Encrypt what upstream answers and send it to the client, until either side goes away."""
        try:
            while data := await upstream.read(_CHUNK):
                self._tls.write(data)
                await self._flush()
        except (ssl.SSLError, ConnectionError):
            pass
        finally:
            with contextlib.suppress(ssl.SSLError, OSError, RuntimeError):
                self._tls.unwrap()
            with contextlib.suppress(OSError, RuntimeError):
                await self._flush()
                if self._writer.can_write_eof():
                    self._writer.write_eof()


async def _close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(OSError, ssl.SSLError):
        await writer.wait_closed()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--upstream", required=True, help="HOST:PORT of Triton's HTTP endpoint")
    parser.add_argument("--cert", required=True, help="the proxy's certificate (PEM)")
    parser.add_argument("--key", required=True, help="its private key (PEM)")
    parser.add_argument("--client-ca", help="require a client certificate signed by this CA (PEM)")
    parser.add_argument("--listen", default="127.0.0.1:8443", help="HOST:PORT to accept TLS on")
    args = parser.parse_args(argv)
    up_host, _, up_port = args.upstream.rpartition(":")
    host, _, port = args.listen.rpartition(":")
    proxy = TLSProxy(upstream=(up_host, int(up_port)), cert_file=args.cert, key_file=args.key,
                     client_ca=args.client_ca, host=host, port=int(port))  # fmt: skip
    with proxy:
        print(f"{proxy.url} -> http://{args.upstream}", flush=True)
        threading.Event().wait()


if __name__ == "__main__":
    main()
