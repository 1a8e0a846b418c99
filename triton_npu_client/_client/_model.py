"""A handle on one model: its cached spec, typed request builders, inference, and sessions on it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any, Unpack

from .._call import USE_CLIENT_DEFAULT, Call, Caller, UseClientDefault
from .._errors import UsageError
from .._model import InputsArg, ModelSpec, Plans, build_request
from .._sessions import ChatOpenArgs, ChatSession, SequenceSession, open_chat, open_sequence
from .._wire import InferRequest, InferResult

__all__ = ["Model"]


class Model:
    """One model on one client, from ``await client.model(name)``. Holds an immutable :class:`ModelSpec`.

    Inputs are given as keywords (``model.infer(INPUT0=x)``) or, for names that clash with the options
    (``outputs``, ``timeout_s``, ``request_id``, ``allow_lossy``) or are not identifiers, as a mapping or
    ``(name, value)`` pairs in the first positional argument. Every input error is raised before any
    network call.
    """

    __slots__ = ("_caller", "_plans", "_spec")

    def __init__(self, caller: Caller, spec: ModelSpec, plans: Plans | None = None) -> None:
        self._caller = caller
        self._spec = spec
        self._plans: Plans = {} if plans is None else plans

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
    def plans(self) -> Plans:
        """Input signatures already validated for this model (shared by the handles and sessions of one client)."""
        return self._plans

    @property
    def caller(self) -> Caller:
        """What this handle sends through: the client's transport and defaults."""
        return self._caller

    # -- builders (no I/O) ----------------------------------------------------------------------------

    def _build(
        self, inputs: InputsArg, named: dict[str, object], batch: bool, outputs: Sequence[str] | None, lossy: bool
    ) -> InferRequest:
        return build_request(
            self._spec, inputs, named, batch=batch, outputs=outputs, allow_lossy=lossy, plans=self._plans
        )

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
        return self._build(inputs, named, False, outputs, allow_lossy)

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
        return self._build(inputs, named, True, outputs, allow_lossy)

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
        req = self._build(inputs, named, False, outputs, allow_lossy)
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
        req = self._build(inputs, named, True, outputs, allow_lossy)
        return await self.infer_request(req, timeout_s=timeout_s, request_id=request_id)

    async def infer_request(
        self,
        request: InferRequest,
        *,
        timeout_s: float | UseClientDefault | None = USE_CLIENT_DEFAULT,
        request_id: str = "",
        retry: bool = True,
        coalesce: bool = True,
    ) -> InferResult:
        """Send a prebuilt request. ``timeout_s`` is the gRPC deadline and Triton's server-side timeout.

        ``coalesce=False``: send it as built, never merged with concurrent requests (a caller that forms its own
        batches, such as a scoring job, keeps the batch shape it chose).

        Refused before any network call: a decoupled model (use :meth:`stream`) and a stateful model (use
        :meth:`sequence`).
        """
        spec = self._spec
        if spec.decoupled or spec.sequence is not None:
            raise self._refusal()
        return await self._caller.infer(
            request,
            timeout_s=self._caller.timeout(timeout_s),
            request_id=request_id,
            retry=retry,
            coalesce=coalesce,
            max_batch_size=spec.max_batch_size,
            dynamic_batching=spec.dynamic_batching,
        )

    def _refusal(self) -> UsageError:
        if self._spec.sequence is not None:
            return UsageError(
                f"model {self.name!r} is stateful (sequence batching): send steps through model.sequence()",
                model=self.name,
            )
        return UsageError(
            f"model {self.name!r} is decoupled: Triton answers it over the gRPC stream only; use model.stream()",
            model=self.name,
        )

    async def stream(
        self,
        inputs: InputsArg = None,
        /,
        *,
        outputs: Sequence[str] | None = None,
        timeout_s: float | UseClientDefault | None = USE_CLIENT_DEFAULT,
        allow_lossy: bool = False,
        **named: object,
    ) -> AsyncIterator[InferResult]:
        """Every response of one request to a decoupled model, until its final flag (gRPC only).

        The request travels on a gRPC call of its own: leaving the loop early, or cancelling the task that
        iterates, cancels it on the server. A stateless request only; steps of a stateful model go through
        :meth:`sequence`.
        """
        if self._spec.sequence is not None:
            raise self._refusal()
        req = self._build(inputs, named, False, outputs, allow_lossy)
        responses = self._caller.call(
            Call(request=req, timeout_s=self._caller.timeout(timeout_s), route="own", many=self._spec.decoupled)
        )
        try:
            async for result in responses:
                yield result
        finally:
            await responses.aclose()

    # -- sessions -------------------------------------------------------------------------------------

    def sequence(self, **options: Any) -> SequenceSession:
        """A sequence session on this stateful model: ``async with model.sequence() as seq:``.

        Options are those of :func:`triton_npu_client.open_sequence` (``sequence_id``, ``stream``,
        ``timeout_s``, ...). No I/O until the first step.
        """
        return open_sequence(self, **options)

    def chat(self, **options: Unpack[ChatOpenArgs]) -> ChatSession:
        """A chat on this chat model (decoupled, sequence batching; gRPC only): ``async with model.chat() as chat:``.

        The options are those of :func:`triton_npu_client.open_chat` (:class:`triton_npu_client.ChatOpenArgs`). No
        I/O until the first turn.
        """
        return open_chat(self, **options)
