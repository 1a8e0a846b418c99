"""A handle on one model: its cached spec, typed request builders and inference."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .._call._defaults import USE_CLIENT_DEFAULT, UseClientDefault
from .._errors import UsageError
from .._model import InputsArg, ModelSpec, build_request
from .._wire import InferRequest, InferResult

if TYPE_CHECKING:
    from .._sessions import SequenceSession
    from ._client import Client

__all__ = ["Model"]


class Model:
    """One model on one client, from ``await client.model(name)``. Holds an immutable :class:`ModelSpec`.

    Inputs are given as keywords (``model.infer(INPUT0=x)``) or, for names that clash with the options
    (``outputs``, ``timeout_s``, ``request_id``, ``allow_lossy``) or are not identifiers, as a mapping or
    ``(name, value)`` pairs in the first positional argument. Every input error is raised before any
    network call.
    """

    __slots__ = ("_client", "_spec")

    def __init__(self, client: Client, spec: ModelSpec) -> None:
        self._client = client
        self._spec = spec

    def __repr__(self) -> str:
        return f"<Model {self._spec!r}>"

    @property
    def spec(self) -> ModelSpec:
        """The model's signature, fetched once."""
        return self._spec

    @property
    def name(self) -> str:
        return self._spec.name

    @property
    def client(self) -> Client:
        """The client this handle sends through."""
        return self._client

    # -- builders (no I/O) ----------------------------------------------------------------------------

    def request(
        self,
        inputs: InputsArg = None,
        /,
        *,
        outputs: Sequence[str] | None = None,
        allow_lossy: bool = False,
        **named: object,
    ) -> InferRequest:
        """A validated, encoded, reusable request in sample form (the batch dim is added for batched models)."""
        return build_request(self._spec, inputs, named, batch=False, outputs=outputs, allow_lossy=allow_lossy)

    def batch_request(
        self,
        inputs: InputsArg = None,
        /,
        *,
        outputs: Sequence[str] | None = None,
        allow_lossy: bool = False,
        **named: object,
    ) -> InferRequest:
        """Like :meth:`request`, in batch form: every value has a leading batch dim <= ``max_batch_size``."""
        return build_request(self._spec, inputs, named, batch=True, outputs=outputs, allow_lossy=allow_lossy)

    # -- inference ------------------------------------------------------------------------------------

    async def infer(
        self,
        inputs: InputsArg = None,
        /,
        *,
        outputs: Sequence[str] | None = None,
        timeout_s: float | UseClientDefault | None = USE_CLIENT_DEFAULT,
        request_id: str = "",
        allow_lossy: bool = False,
        **named: object,
    ) -> InferResult:
        """Validate, encode and send one sample; outputs keep the batch dim of 1 for batched models."""
        req = build_request(self._spec, inputs, named, batch=False, outputs=outputs, allow_lossy=allow_lossy)
        return await self.infer_request(req, timeout_s=timeout_s, request_id=request_id)

    async def infer_batch(
        self,
        inputs: InputsArg = None,
        /,
        *,
        outputs: Sequence[str] | None = None,
        timeout_s: float | UseClientDefault | None = USE_CLIENT_DEFAULT,
        request_id: str = "",
        allow_lossy: bool = False,
        **named: object,
    ) -> InferResult:
        """Validate, encode and send a batch (leading dim on every input)."""
        req = build_request(self._spec, inputs, named, batch=True, outputs=outputs, allow_lossy=allow_lossy)
        return await self.infer_request(req, timeout_s=timeout_s, request_id=request_id)

    async def infer_request(
        self,
        request: InferRequest,
        *,
        timeout_s: float | UseClientDefault | None = USE_CLIENT_DEFAULT,
        request_id: str = "",
        sequence_id: int | str | None = None,
        sequence_start: bool = False,
        sequence_end: bool = False,
        retry: bool = True,
    ) -> InferResult:
        """Send a prebuilt request. ``timeout_s`` is the gRPC deadline and Triton's server-side timeout.

        ``retry=False`` disables the client's retry policy (the sequence layer passes it for every step).
        Refused before any network call: a decoupled model (it answers over the gRPC stream only) and a
        stateful model without ``sequence_id`` (Triton would refuse the missing correlation id).
        """
        if self._spec.decoupled:
            raise UsageError(
                f"model {self.name!r} is decoupled: Triton answers it over the gRPC stream only, not unary calls",
                model=self.name,
            )
        if self._spec.is_stateful and sequence_id is None:
            raise UsageError(
                f"model {self.name!r} is stateful (sequence batching): send steps through model.sequence()",
                model=self.name,
            )
        return await self._client._infer(
            request,
            timeout_s=timeout_s,
            request_id=request_id,
            sequence_id=sequence_id,
            sequence_start=sequence_start,
            sequence_end=sequence_end,
            retry=retry,
            max_batch_size=self._spec.max_batch_size,
        )

    # -- sessions -------------------------------------------------------------------------------------

    def sequence(self, **options: Any) -> SequenceSession:
        """A sequence session on this stateful model: ``async with model.sequence() as seq:``.

        Options are those of :func:`triton_npu_client.open_sequence` (``sequence_id``, ``stream``,
        ``timeout_s``, ...). No I/O until the first step.
        """
        # Imported here because the session layer sits above the model layer and imports it.
        from .._sessions import open_sequence

        return open_sequence(self, **options)
