"""What the client needs from a transport. Admin answers are plain JSON-like dicts, normalised per protocol."""

from __future__ import annotations

from typing import Any, Protocol

from .._wire import InferRequest, InferResult

__all__ = ["Transport", "server_timeout_us"]

Json = dict[str, Any]


class Transport(Protocol):
    """One connection to one Triton server. Errors come out already mapped into the SDK's tree."""

    @property
    def protocol(self) -> str:
        """``"grpc"`` or ``"http"``."""
        ...

    async def infer(
        self,
        request: InferRequest,
        *,
        timeout_s: float | None,
        request_id: str = "",
        sequence_id: int | str | None = None,
        sequence_start: bool = False,
        sequence_end: bool = False,
    ) -> InferResult:
        """Send one request; ``timeout_s`` is both the client deadline and Triton's server-side timeout."""
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
