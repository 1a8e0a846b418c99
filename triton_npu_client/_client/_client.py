"""The async client: URL -> transport, lifecycle, options, admin calls, model handles."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from types import TracebackType
from typing import Any, Final, Self, TypeVar, Unpack
from urllib.parse import SplitResult, urlsplit

import attrs

from .._call import USE_CLIENT_DEFAULT, Caller, Coalescer, Coalescing, RetryPolicy, UseClientDefault
from .._errors import (
    ClientClosedError,
    ConnectError,
    ModelNotReadyError,
    RequestTimeout,
    SequenceUsageError,
    ServerUnavailable,
    TritonError,
    UsageError,
)
from .._fleet import DNS_PREFIX, FleetOptions, FleetTransport, Place, ReplicaStatus, Resolver, parse_endpoint
from .._model import ModelSpec, Plans
from .._sessions import ChatOpenArgs, ChatSession, SequenceSession, defer_chat, defer_sequence
from .._transport import DEFAULT_HTTP_CONNECTIONS, GrpcTransport, HttpTransport, TLSConfig, Transport
from ._model import Model

# The defaults themselves are Coalescing's: written once, there.
DEFAULT_COALESCING: Final = Coalescing()

__all__ = ["Client", "ClientConfig", "ModelStatistics", "RepositoryModel", "ServerMetadata"]

T = TypeVar("T")

_DEFAULT_PORTS = {"grpc": 8001, "grpcs": 443, "http": 8000, "https": 443}


def _freeze_headers(value: Mapping[str, str] | Sequence[tuple[str, str]] | None) -> tuple[tuple[str, str], ...]:
    # Also takes the frozen form itself: with_options() evolves a config whose headers are already pairs.
    return tuple(dict(value or {}).items())


REDACTED: Final = "***"


def _redacted_headers(headers: tuple[tuple[str, str], ...]) -> str:
    """The headers' names with every value hidden: which header carries a secret is not this repr's to guess."""
    return repr(tuple((name, REDACTED) for name, _ in headers))


def _shown(parts: SplitResult) -> str:
    """A URL as it may appear in a message: scheme, host and port only (user info, path and query can hold secrets)."""
    host = parts.hostname or ""
    host = f"[{host}]" if ":" in host else host
    try:
        port = f":{parts.port}" if parts.port is not None else ""
    except ValueError:  # a port that is not a number: not a secret, but not a port either
        port = ":?"
    return f"{parts.scheme}://{host}{port}"


def _check_url(url: str) -> None:
    """A server URL names a scheme and a host, and no credentials: refused with a clear message that quotes none.

    ``dns+grpc://name:port`` (any of the four schemes) stands for every address record of ``name``: a fleet.
    """
    if not isinstance(url, str):
        raise UsageError(f"a server URL is a string such as 'grpc://127.0.0.1:8001', given {type(url).__name__}")
    parts = urlsplit(url.removeprefix(DNS_PREFIX))
    if parts.scheme not in _DEFAULT_PORTS:
        raise UsageError(
            f"unsupported URL scheme {parts.scheme!r} in {_shown(parts)}: use grpc://, grpcs://, http:// or "
            "https:// (or dns+grpc:// ... for every address of a DNS name)"
        )
    if "@" in parts.netloc:
        # Nothing would send them (the transports connect to host:port), and the URL shows in reprs and messages.
        raise UsageError(
            f"the URL for {_shown(parts)} carries user info (user:password@): the client never sends it; pass "
            "credentials as headers, e.g. Client(url, headers={'authorization': ...}), whose values are never shown"
        )
    if parts.query or parts.fragment:
        raise UsageError(
            f"the URL for {_shown(parts)} carries a query or a fragment, which the client would ignore: "
            "use scheme://host[:port], and pass tokens as headers"
        )
    if not parts.hostname:
        raise UsageError(f"no host in the URL {_shown(parts)}")
    try:
        parts.port  # noqa: B018 - parsing it is the check
    except ValueError as err:
        raise UsageError(f"the port of the URL {_shown(parts)} is not a number from 0 to 65535") from err


def _freeze_urls(value: str | Sequence[str]) -> tuple[str, ...]:
    urls = (value,) if isinstance(value, str) else tuple(value)
    if not urls:
        raise UsageError("no server URL given: pass one URL, or a list of replicas' URLs")
    return urls


def _check_urls(_config: object, _attribute: object, urls: tuple[str, ...]) -> None:
    for url in urls:
        _check_url(url)
    families = {"grpc" if urlsplit(u.removeprefix(DNS_PREFIX)).scheme.startswith("grpc") else "http" for u in urls}
    if len(families) > 1:
        raise UsageError(
            "the URLs of one client must all be gRPC (grpc://, grpcs://) or all HTTP (http://, https://): "
            + ", ".join(_shown(urlsplit(u.removeprefix(DNS_PREFIX))) for u in urls)
        )


def _freeze_options(
    value: Mapping[str, Any] | Sequence[tuple[str, Any]] | None,
) -> tuple[tuple[str, Any], ...]:
    return tuple(dict(value or {}).items())


@attrs.frozen(kw_only=True)
class ClientConfig:
    """Everything a :class:`Client` is made from; ``client.with_options(...)`` evolves a copy.

    ``urls`` are ``scheme://host[:port]``: one server, or several replicas of one (a fleet), where
    ``dns+scheme://name:port`` stands for every address record of ``name``; a URL with user info
    (``user:password@``), a query or a fragment is refused with :class:`UsageError` (credentials go in
    ``headers``). ``headers`` keep their values (every call sends them), but the repr shows their names only:
    every value reads ``***``, whatever the header. ``fleet`` and ``resolver`` apply to fleets only.
    """

    urls: tuple[str, ...] = attrs.field(converter=_freeze_urls, validator=_check_urls)
    timeout_s: float | None = 60.0
    headers: tuple[tuple[str, str], ...] = attrs.field(default=(), converter=_freeze_headers, repr=_redacted_headers)
    retry: RetryPolicy = attrs.field(factory=RetryPolicy)
    tls: TLSConfig | None = None
    channel_options: tuple[tuple[str, Any], ...] = attrs.field(default=(), converter=_freeze_options)
    coalescing: Coalescing | None = attrs.field(factory=lambda: DEFAULT_COALESCING)
    streams: int = attrs.field(default=4, validator=attrs.validators.ge(1))
    http_connections: int = attrs.field(default=DEFAULT_HTTP_CONNECTIONS, validator=attrs.validators.ge(1))
    fleet: FleetOptions = attrs.field(factory=FleetOptions)
    resolver: Resolver | None = attrs.field(default=None, repr=False)

    @property
    def url(self) -> str:
        """The first URL (the only one for a client of one server)."""
        return self.urls[0]

    @property
    def is_fleet(self) -> bool:
        """Several URLs, or a DNS name standing for its every address: the client routes over replicas."""
        return len(self.urls) > 1 or self.urls[0].startswith(DNS_PREFIX)

    @property
    def scheme(self) -> str:
        return urlsplit(self.url.removeprefix(DNS_PREFIX)).scheme

    def target(self) -> str:
        """``host:port`` from the (first) URL, with the scheme's default port."""
        return parse_endpoint(self.url).fixed().target


# --- typed admin answers --------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class ServerMetadata:
    """``server_metadata()``: name, version, extensions."""

    name: str
    version: str
    extensions: tuple[str, ...] = ()


@attrs.frozen(kw_only=True)
class RepositoryModel:
    """One entry of ``repository_index()``: name, version, state (``READY``, ``UNAVAILABLE``...), reason."""

    name: str
    version: str = ""
    state: str = ""
    reason: str = ""


def _count(section: Mapping[str, Any] | None, key: str) -> tuple[int, int]:
    entry = (section or {}).get(key) or {}
    return int(entry.get("count", 0)), int(entry.get("ns", 0))


@attrs.frozen(kw_only=True)
class ModelStatistics:
    """Inference statistics of one model version (counters since load).

    ``execution_count`` below ``inference_count`` means the server batched requests together.
    """

    name: str
    version: str
    inference_count: int
    execution_count: int
    success_count: int
    fail_count: int
    queue_ns: int
    compute_infer_ns: int
    last_inference_ms: int

    @classmethod
    def from_json(cls, entry: Mapping[str, Any]) -> ModelStatistics:
        """From one ``model_stats`` entry (gRPC JSON carries int64 as strings; HTTP as ints)."""
        stats = entry.get("inference_stats") or {}
        success, _ = _count(stats, "success")
        fail, _ = _count(stats, "fail")
        _, queue_ns = _count(stats, "queue")
        _, compute_ns = _count(stats, "compute_infer")
        return cls(
            name=str(entry.get("name", "")),
            version=str(entry.get("version", "")),
            inference_count=int(entry.get("inference_count", 0)),
            execution_count=int(entry.get("execution_count", 0)),
            success_count=success,
            fail_count=fail,
            queue_ns=queue_ns,
            compute_infer_ns=compute_ns,
            last_inference_ms=int(entry.get("last_inference", 0)),
        )


async def _get_text(url: str, timeout_s: float | None) -> str | TritonError:
    """GET ``url`` as text: the metrics endpoint is plain HTTP on every replica, whatever the inference protocol."""
    import aiohttp  # comes with tritonclient[http]; imported here, since only the metrics call needs it

    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session,
            session.get(url) as response,
        ):
            if response.status != 200:
                return ServerUnavailable(f"{url} answered HTTP {response.status}", status=str(response.status))
            return await response.text()
    except (aiohttp.ClientError, TimeoutError) as err:
        return ConnectError(f"{url}: {type(err).__name__}: {err}")


def _make_transport(config: ClientConfig) -> Transport:
    if config.is_fleet:
        return FleetTransport(
            [parse_endpoint(u) for u in config.urls],
            lambda place: _one_transport(config, place),
            options=config.fleet,
            resolver=config.resolver,
        )
    return _one_transport(config, parse_endpoint(config.url).fixed())


def _one_transport(config: ClientConfig, place: Place) -> Transport:
    scheme = urlsplit(place.url).scheme
    target = place.target
    headers = dict(config.headers)
    tls = config.tls
    if scheme in ("grpcs", "https") and tls is None:
        tls = TLSConfig()  # system roots
    if tls is not None and place.server_name is not None and tls.server_name is None:
        # An address found through DNS: the certificate names the DNS name, not the address.
        tls = attrs.evolve(tls, server_name=place.server_name)
    if scheme in ("grpc", "grpcs"):
        options: dict[str, Any] = {}
        if config.is_fleet:
            fleet = config.fleet
            options = {
                # A replica's channel of its own: gRPC shares subchannels between channels to one target, so the
                # fresh connection a probe opens after an outage would otherwise inherit the old one's backoff.
                "grpc.use_local_subchannel_pool": 1,
                # Reconnect at the fleet's probing pace, not gRPC's default (1 s doubling to 120 s): a replica
                # that is back must not stay unreachable for minutes behind a backoff nobody chose.
                "grpc.initial_reconnect_backoff_ms": max(1, int(fleet.probe_backoff_s * 1000)),
                "grpc.min_reconnect_backoff_ms": max(1, int(fleet.probe_backoff_s * 1000)),
                "grpc.max_reconnect_backoff_ms": max(1, int(fleet.max_probe_backoff_s * 1000)),
            }
        options.update(dict(config.channel_options))  # the user's own options win
        return GrpcTransport(target, headers=headers, tls=tls, channel_options=options, streams=config.streams)
    return HttpTransport(target, headers=headers, tls=tls, connections=config.http_connections)


class Client:
    """An async client for one Triton server, or for several replicas of one (a fleet).

    ::

        async with Client("grpc://127.0.0.1:8001") as client:
            model = await client.model("scale_fp32")
            result = await model.infer(INPUT0=[1.0, 2.0])

    ``timeout_s`` is the default per-call limit (``None``: no limit); per call it becomes the gRPC deadline
    and Triton's server-side request timeout. ``headers`` go with every call (gRPC metadata, HTTP headers): put
    credentials there (an API key, ``authorization``); their values never appear in a repr, a log record or an error
    message. A URL carrying user info (``user:password@``) is refused with :class:`UsageError`. ``retry`` applies
    to stateless inference only. ``transport`` replaces the transport built from the URL (a seam for wrapping the
    real one, e.g. to count calls).
    Create it inside a running event loop: grpc.aio channels and aiohttp sessions bind to the loop (the
    constructor does no network I/O; connections open on first use).

    ``coalescing`` merges concurrent stateless requests to one model into batched requests (client-side
    batching: 2-5x the throughput at 16-256 in flight on 2 cores). By default only for models whose config has
    ``dynamic_batching``: their authors already let Triton merge requests, and a merged request the server
    refuses is re-sent caller by caller, so each caller still gets its own answer or error.
    ``Coalescing(models="batched")`` extends it to every batched model; ``None`` turns it off (see
    :class:`Coalescing`).

    **A fleet**: ``Client(["grpc://a:8001", "grpc://b:8001"])``, or ``Client("dns+grpc://triton.ns.svc:8001")``
    for every address record of a name (a Kubernetes headless Service; re-resolved every
    ``fleet.resolve_interval_s``; ``resolver`` replaces the system resolver). Stateless requests go to the least
    loaded healthy replica and move on when one fails; every sequence and chat is pinned to one replica by
    rendezvous hashing of its id, so separate processes agree; a sequence whose replica fails raises
    :class:`SequenceLost` (a chat with ``replay_on_loss=True`` replays on another). Replicas are health-checked
    per ``fleet`` (:class:`FleetOptions`); :meth:`replicas` shows them. Everything else is the same API.

    ``streams``: how many long-lived gRPC streams the shared stream route spreads over (gRPC).
    ``http_connections``: HTTP connections open at once; more concurrent requests wait on this side, visibly
    (a sequence step that waited past its model's idle timeout is warned about when it leaves).
    """

    def __init__(
        self,
        url: str | Sequence[str],
        *,
        timeout_s: float | None = 60.0,
        headers: Mapping[str, str] | None = None,
        retry: RetryPolicy | None = None,
        tls: TLSConfig | None = None,
        channel_options: Mapping[str, Any] | Sequence[tuple[str, Any]] | None = None,
        coalescing: Coalescing | None = DEFAULT_COALESCING,
        streams: int = 4,
        http_connections: int = DEFAULT_HTTP_CONNECTIONS,
        transport: Transport | None = None,
        fleet: FleetOptions | None = None,
        resolver: Resolver | None = None,
    ) -> None:
        config = ClientConfig(
            urls=url,
            timeout_s=timeout_s,
            headers=headers,  # the converter freezes it
            retry=retry if retry is not None else RetryPolicy(),
            tls=tls,
            channel_options=channel_options,
            coalescing=coalescing,
            streams=streams,
            http_connections=http_connections,
            fleet=fleet if fleet is not None else FleetOptions(),
            resolver=resolver,
        )
        self._init(config, transport if transport is not None else _make_transport(config), owns=True)

    def _init(self, config: ClientConfig, transport: Transport, *, owns: bool) -> None:
        self._config = config
        self._transport = transport
        self._owns_transport = owns
        self._closed = False
        # Spec and validated input signatures per (name, version): fetched once, dropped on load/unload.
        self._models: dict[tuple[str, str], tuple[ModelSpec, Plans]] = {}
        # Per client object (not per transport): a copy from with_options() batches its own callers.
        self._coalescer = Coalescer(config.coalescing) if config.coalescing is not None else None
        self._caller = Caller(transport, timeout_s=config.timeout_s, retry=config.retry, coalescer=self._coalescer)

    @classmethod
    def _from_config(cls, config: ClientConfig, transport: Transport, *, owns: bool) -> Client:
        client = cls.__new__(cls)
        client._init(config, transport, owns=owns)
        return client

    def __repr__(self) -> str:
        state = " closed" if self._closed else ""
        shown = ", ".join(
            ("dns+" if u.startswith(DNS_PREFIX) else "") + _shown(urlsplit(u.removeprefix(DNS_PREFIX)))
            for u in self._config.urls
        )
        return f"<Client {shown}{state}>"

    # -- configuration and lifecycle ------------------------------------------------------------------

    @property
    def config(self) -> ClientConfig:
        return self._config

    @property
    def transport(self) -> Transport:
        """The transport: its ``call()`` is the one primitive every inference request goes through."""
        self._check_open()
        return self._transport

    @property
    def is_closed(self) -> bool:
        return self._closed

    def with_options(self, **changes: Any) -> Client:
        """A client with some options changed (``attrs.evolve`` of :attr:`config`).

        Changing only ``timeout_s``, ``retry`` or ``coalescing`` shares this client's connection (closing the
        copy leaves it open); anything else opens a new connection that the copy owns.
        """
        self._check_open()
        if "url" in changes:  # the one-server spelling of urls
            changes["urls"] = changes.pop("url")
        config = attrs.evolve(self._config, **changes)
        if set(changes) <= {"timeout_s", "retry", "coalescing"}:
            child = Client._from_config(config, self._transport, owns=False)
            child._models = self._models
            return child
        return Client._from_config(config, _make_transport(config), owns=True)

    def _check_open(self) -> None:
        if self._closed:
            raise ClientClosedError(f"client for {self._config.url} is closed")

    async def aclose(self) -> None:
        """Close the connection; idempotent. Calls made afterwards raise :class:`ClientClosedError`."""
        if self._closed:
            return
        self._closed = True
        self._caller.closed = True
        try:
            if self._coalescer is not None:
                await self._coalescer.aclose()
        finally:
            if self._owns_transport:
                await self._transport.aclose()

    async def __aenter__(self) -> Self:
        self._check_open()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    def _timeout(self, timeout_s: float | UseClientDefault | None) -> float | None:
        return self._caller.timeout(timeout_s)

    # -- health and metadata --------------------------------------------------------------------------

    async def is_server_live(self, *, timeout_s: float | UseClientDefault | None = USE_CLIENT_DEFAULT) -> bool:
        self._check_open()
        return await self._transport.is_server_live(timeout_s=self._timeout(timeout_s))

    async def is_server_ready(self, *, timeout_s: float | UseClientDefault | None = USE_CLIENT_DEFAULT) -> bool:
        self._check_open()
        return await self._transport.is_server_ready(timeout_s=self._timeout(timeout_s))

    async def is_model_ready(
        self, name: str, *, version: str = "", timeout_s: float | UseClientDefault | None = USE_CLIENT_DEFAULT
    ) -> bool:
        self._check_open()
        return await self._transport.is_model_ready(name, version, timeout_s=self._timeout(timeout_s))

    async def wait_for_model_ready(self, name: str, *, version: str = "", timeout_s: float = 30.0) -> None:
        """Return once ``name`` is ready; raise :class:`RequestTimeout` after ``timeout_s``.

        A server that is not reachable yet (starting up) counts as "not ready yet".
        """
        self._check_open()
        deadline = time.monotonic() + timeout_s
        delay = 0.02
        while True:
            left = deadline - time.monotonic()
            try:
                if await self._transport.is_model_ready(name, version, timeout_s=max(0.01, min(left, 5.0))):
                    return
            except (ConnectError, ServerUnavailable, RequestTimeout):
                pass
            left = deadline - time.monotonic()
            if left <= 0:
                raise RequestTimeout(
                    f"model {name!r} not ready after {timeout_s}s", model=name, version=version or None
                )
            # No event to wait for: the server offers no readiness notification, so poll with backoff.
            await asyncio.sleep(min(delay, left))
            delay = min(delay * 2, 0.5)

    async def server_metadata(
        self, *, timeout_s: float | UseClientDefault | None = USE_CLIENT_DEFAULT
    ) -> ServerMetadata:
        self._check_open()
        raw = await self._transport.server_metadata(timeout_s=self._timeout(timeout_s))
        return ServerMetadata(
            name=str(raw.get("name", "")),
            version=str(raw.get("version", "")),
            extensions=tuple(raw.get("extensions", ())),
        )

    async def model_metadata(
        self, name: str, *, version: str = "", timeout_s: float | UseClientDefault | None = USE_CLIENT_DEFAULT
    ) -> dict[str, Any]:
        """The model's metadata as the server sends it (name, versions, platform, inputs, outputs)."""
        self._check_open()
        return await self._transport.model_metadata(name, version, timeout_s=self._timeout(timeout_s))

    async def model_config(
        self, name: str, *, version: str = "", timeout_s: float | UseClientDefault | None = USE_CLIENT_DEFAULT
    ) -> dict[str, Any]:
        """The model's config as JSON (field names as in ``config.pbtxt``)."""
        self._check_open()
        return await self._transport.model_config(name, version, timeout_s=self._timeout(timeout_s))

    async def repository_index(
        self, *, timeout_s: float | UseClientDefault | None = USE_CLIENT_DEFAULT
    ) -> tuple[RepositoryModel, ...]:
        self._check_open()
        raw = await self._transport.repository_index(timeout_s=self._timeout(timeout_s))
        return tuple(
            RepositoryModel(
                name=str(m.get("name", "")),
                version=str(m.get("version", "")),
                state=str(m.get("state", "")),
                reason=str(m.get("reason", "")),
            )
            for m in raw
        )

    async def load_model(self, name: str, *, timeout_s: float | UseClientDefault | None = USE_CLIENT_DEFAULT) -> None:
        """Load (or reload) ``name``; needs ``--model-control-mode=explicit`` on the server."""
        self._check_open()
        self._forget(name)
        await self._transport.load_model(name, timeout_s=self._timeout(timeout_s))

    async def unload_model(self, name: str, *, timeout_s: float | UseClientDefault | None = USE_CLIENT_DEFAULT) -> None:
        self._check_open()
        self._forget(name)
        await self._transport.unload_model(name, timeout_s=self._timeout(timeout_s))

    def _forget(self, name: str) -> None:
        for key in [k for k in self._models if k[0] == name]:
            del self._models[key]

    async def inference_statistics(
        self, name: str, *, version: str = "", timeout_s: float | UseClientDefault | None = USE_CLIENT_DEFAULT
    ) -> tuple[ModelStatistics, ...]:
        """Statistics per loaded version of ``name``."""
        self._check_open()
        raw = await self._transport.inference_statistics(name, version, timeout_s=self._timeout(timeout_s))
        return tuple(ModelStatistics.from_json(m) for m in raw)

    # -- replicas ---------------------------------------------------------------------------------------

    async def replicas(self, *, refresh: bool = False) -> tuple[ReplicaStatus, ...]:
        """Each replica's health, READY models, load and latency (:class:`ReplicaStatus`), in URL order.

        A fleet reports what its background checks and its own calls have seen (``refresh=True`` checks every
        replica first). A client of one server checks it now; its load and latency figures are not kept (zero).
        """
        self._check_open()
        transport = self._transport
        if isinstance(transport, FleetTransport):
            if refresh:
                await transport.refresh()
            else:
                await transport.ready()
            return transport.replica_status()
        limit = self._config.fleet.health_timeout_s
        error: str | None = None
        models: tuple[str, ...] = ()
        try:
            healthy = await transport.is_server_ready(timeout_s=limit)
            if healthy:
                index = await transport.repository_index(timeout_s=limit)
                models = tuple(sorted(str(m.get("name", "")) for m in index if m.get("state") == "READY"))
        except TritonError as err:
            healthy, error = False, f"{type(err).__name__}: {err}"
        url = self._config.url
        return (
            ReplicaStatus(
                url=url, healthy=healthy, models=models, outstanding=0, requests=0, errors=0, latency_p50_ms=None,
                latency_p99_ms=None, pinned=0, epoch=0, last_error=error, down_for_s=None,
            ),
        )  # fmt: skip

    async def replica_for(self, model: str, sequence_id: int | str) -> str | None:
        """The URL of the replica that holds sequence ``sequence_id`` of ``model`` (or would take its START now).

        Every process that sees the same healthy replicas gives the same answer (rendezvous hashing); a client of
        one server answers its URL. None when no replica is healthy.
        """
        self._check_open()
        transport = self._transport
        if not isinstance(transport, FleetTransport):
            return self._config.url
        await transport.ready()
        return transport.placement(model, sequence_id)

    async def replica_statistics(
        self, name: str, *, version: str = "", timeout_s: float | UseClientDefault | None = USE_CLIENT_DEFAULT
    ) -> dict[str, tuple[ModelStatistics, ...] | TritonError]:
        """Triton's statistics of ``name`` on each replica (URL -> per-version statistics, or the error it gave).

        :meth:`inference_statistics` gives the same figures summed over the healthy replicas.
        """
        self._check_open()
        limit = self._timeout(timeout_s)

        async def ask(transport: Transport) -> tuple[ModelStatistics, ...]:
            raw = await transport.inference_statistics(name, version, timeout_s=limit)
            return tuple(ModelStatistics.from_json(m) for m in raw)

        return await self._each_replica(ask)

    async def replica_metrics(
        self, *, port: int = 8002, timeout_s: float | UseClientDefault | None = USE_CLIENT_DEFAULT
    ) -> dict[str, str | TritonError]:
        """Each replica's Prometheus metrics text (``http://HOST:port/metrics``; Triton's default metrics port is
        8002, the same on every pod of a Deployment). URL -> the text, or the error it gave."""
        self._check_open()
        limit = self._timeout(timeout_s)

        async def fetch(url: str) -> str | TritonError:
            host = urlsplit(url).hostname or ""
            host = f"[{host}]" if ":" in host else host
            return await _get_text(f"http://{host}:{port}/metrics", limit)

        transport = self._transport
        urls = [self._config.url]
        if isinstance(transport, FleetTransport):
            await transport.ready()
            urls = [s.url for s in transport.replica_status()]
        answers = await asyncio.gather(*(fetch(u) for u in urls))
        return dict(zip(urls, answers, strict=True))

    async def _each_replica(self, ask: Callable[[Transport], Awaitable[T]]) -> dict[str, T | TritonError]:
        transport = self._transport
        if isinstance(transport, FleetTransport):
            return await transport.each_replica(ask)
        try:
            return {self._config.url: await ask(transport)}
        except TritonError as err:
            return {self._config.url: err}

    # -- models and inference -------------------------------------------------------------------------

    async def model(
        self, name: str, *, version: str = "", timeout_s: float | UseClientDefault | None = USE_CLIENT_DEFAULT
    ) -> Model:
        """A handle on ``name``: fetches its config once (cached per client until load/unload)."""
        self._check_open()
        key = (name, version)
        known = self._models.get(key)
        if known is None:
            config = await self._transport.model_config(name, version, timeout_s=self._timeout(timeout_s))
            spec = ModelSpec.from_config(config, version=version or None)
            if not spec.inputs and not spec.outputs:
                raise ModelNotReadyError(f"model {name!r} has no inputs or outputs in its config", model=name)
            known = self._models[key] = (spec, {})
        return Model(self._caller, known[0], known[1])

    def sequence(self, name: str, *, version: str = "", **options: Any) -> SequenceSession:
        """``async with client.sequence(name) as seq:``: the session ``model.sequence(**options)`` gives, by name.

        Options are those of ``model.sequence()``. Nothing is sent here: the model is fetched (cached by the
        client) when the session is entered or sends its first step.
        """
        self._check_open()

        async def fetch() -> Model:
            return await self.model(name, version=version)

        return defer_sequence(name, fetch, **options)

    def chat(self, name: str, *, version: str = "", **options: Unpack[ChatOpenArgs]) -> ChatSession:
        """``async with client.chat(name, system=...) as chat:``: the chat ``model.chat(...)`` gives, by name.

        The same :class:`ChatSession`, used the same way (``async with``, or ``await chat.aclose()`` when done).
        The options are those of ``model.chat()`` (:class:`~triton_npu_client.ChatOpenArgs`), checked here; nothing
        is sent here: the model is fetched (cached by the client) when the chat is entered or sends its first turn.
        A chat model is decoupled, which Triton serves over the gRPC stream only: an HTTP client is refused here.
        To replay a conversation into a fresh chat: ``client.chat(name, history=old.messages)``. To go on with one the
        server still holds, sending only the next message (a chat's :attr:`~ChatSession.state`, perhaps saved by
        another process): ``client.chat(name, resume=state)``.
        """
        self._check_open()
        if not self._transport.can_stream:
            raise SequenceUsageError(
                f"chat on model {name!r}: a chat model is decoupled, which Triton serves only over the gRPC stream; "
                f"this client speaks {self._transport.protocol}: use a gRPC client (grpc://)",
                model=name,
            )

        async def fetch() -> Model:
            return await self.model(name, version=version)

        return defer_chat(name, fetch, **options)
