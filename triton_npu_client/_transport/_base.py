"""The transport seam: one call primitive for inference, plus admin calls answered as plain JSON-like dicts.

Every inference request (stateless, a sequence step, a decoupled request) is one :class:`Call` value given to
:meth:`Transport.call`, which returns :class:`Responses`: an async iterator of results that a unary call ends
after one, and a decoupled request after the response carrying Triton's final flag. What lies above (plain
``infer``, sessions, coalescing) only sees this protocol, so a transport given through ``Client(transport=...)``
can stream too.
"""

from __future__ import annotations

from typing import Any, Protocol, Self

from .._errors import UsageError
from .._wire import InferResult
from ._call import Call

__all__ = ["Json", "OneResponse", "Responses", "Transport", "server_timeout_us"]

Json = dict[str, Any]


class Responses(Protocol):
    """The answers to one request, in order; closing (or cancelling the reader) stops listening.

    For the ``"own"`` route closing also cancels the call on the server; on the ``"shared"`` stream later
    answers are dropped; a unary call cannot be stopped once sent except by cancelling the awaiting task.
    """

    def __aiter__(self) -> Self: ...

    async def __anext__(self) -> InferResult: ...

    async def single(self) -> InferResult:
        """The one response of a request that expects exactly one (fewer or more raise)."""
        ...

    async def aclose(self) -> None: ...


class OneResponse:
    """:class:`Responses` for a request answered exactly once (a unary call): subclasses implement ``_send``."""

    __slots__ = ("_done",)

    def __init__(self) -> None:
        self._done = False

    async def _send(self) -> InferResult:
        raise NotImplementedError

    async def single(self) -> InferResult:
        if self._done:
            raise UsageError("this request's answer was already read")
        self._done = True
        return await self._send()

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> InferResult:
        if self._done:
            raise StopAsyncIteration
        return await self.single()

    async def aclose(self) -> None:
        self._done = True


class Transport(Protocol):
    """One connection to one Triton server. Errors come out already mapped into the SDK's tree."""

    @property
    def protocol(self) -> str:
        """``"grpc"`` or ``"http"``."""
        ...

    @property
    def can_stream(self) -> bool:
        """Whether the ``"shared"`` and ``"own"`` routes exist (gRPC: yes; HTTP: no)."""
        ...

    def call(self, call: Call, /) -> Responses:
        """Send ``call`` (see :class:`Call` for its fields); nothing is awaited until the responses are read.

        Sent once: a transport never retries on its own (the caller's :class:`RetryPolicy` decides, and sends the
        same ``call`` again). ``call.route`` is checked against :attr:`can_stream`. A transport over several
        replicas may also have ``elsewhere(call) -> bool`` (another replica could take it now; see the fleet):
        the retry loop then moves a request whose replica failed at once instead of backing off.
        """
        ...

    async def is_server_live(self, *, timeout_s: float | None) -> bool: ...

    async def is_server_ready(self, *, timeout_s: float | None) -> bool: ...

    async def is_model_ready(self, name: str, version: str, *, timeout_s: float | None) -> bool: ...

    async def server_metadata(self, *, timeout_s: float | None) -> Json: ...

    async def model_metadata(self, name: str, version: str, *, timeout_s: float | None) -> Json: ...

    async def model_config(self, name: str, version: str, *, timeout_s: float | None) -> Json:
        """The model config as JSON (the inside of ``{"config": ...}``)."""
        ...

    async def repository_index(self, *, timeout_s: float | None) -> list[Json]:
        """One dict per model: name, version, state, reason."""
        ...

    async def load_model(self, name: str, *, timeout_s: float | None) -> None: ...

    async def unload_model(self, name: str, *, timeout_s: float | None) -> None: ...

    async def inference_statistics(self, name: str, version: str, *, timeout_s: float | None) -> list[Json]:
        """``model_stats`` entries."""
        ...

    async def aclose(self) -> None: ...


def server_timeout_us(timeout_s: float | None, sequence_id: int | str | None) -> int | None:
    """Triton's server-side request timeout for a call, in microseconds.

    None for sequence steps: Triton silently dropping a queued step would leave the sequence's server state
    without it; the client deadline alone bounds the wait (the session layer decides what a timeout means).
    """
    if timeout_s is None or sequence_id is not None:
        return None
    return max(1, int(timeout_s * 1_000_000))
