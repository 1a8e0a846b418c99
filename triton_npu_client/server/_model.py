"""The running-statistics sequence model, shared by every ``server_models/seq_stats_*/1/model.py``.

The one module that talks to ``triton_python_backend_utils``, and only through the ``pb`` module the
model.py passes in, so the toolkit imports without it. Per request: input ``X`` (FP32 ``[dim]``);
outputs ``MEAN`` and ``VAR`` (FP32 ``[dim]``, population variance), ``COUNT`` (INT64 ``[1]``, steps
so far in this sequence) and ``LIVE`` (INT64 ``[1]``, sequences this instance holds after this
execute, ENDs of the same batch already freed: a one-request sequence reads "live now, besides me").

END-only requests: the data input ``X`` is declared ``optional: true``, and a request that carries END
but no ``X`` closes its sequence without a step. It frees the state and answers the sequence's
statistics as they stand (``COUNT`` the steps already taken, ``MEAN``/``VAR`` unchanged; zeros and
``COUNT`` 0 with START too, an empty sequence) plus ``LIVE``. That is how a client ends a sequence whose
last step has already run: it sends END with no inputs when every data input of the model is optional.
A request without ``X`` and without END is refused with an error naming the missing input; an END-only
request for a sequence this instance does not hold gets the same "unknown" refusal as a step would.
Such a model with ``max_batch_size > 0`` must get at least one control input tensor from the sequence
batcher (READY is enough): the Python backend reads the batch size from a request's first input and
fails a request that has none ("request has 0 inputs") before the model sees it.

A config with ``model_transaction_policy { decoupled: true }`` gets each answer through the request's
response sender, with the FINAL flag on the same response. That is the form that survives Triton 2.51's
gRPC stream under load (see bench/repro_stream_crash/): for a non-decoupled model answered over a stream,
the server frees a request twice, from the frontend and the backend, and crashes now and then.

A CPU instance (``device: cpu``, or no accelerator possible here: :func:`accelerator_possible`) keeps its
state in :class:`NumpyMoments` and never imports torch, which saves each stub seconds of load, about
150 MiB and a slow shutdown; otherwise the state is :class:`RunningMoments` on the chosen device.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ._config import SequenceBatching, model_parameter, parse_model_config
from ._controls import SequenceControls, read_controls
from ._device import (
    Accelerators,
    DeviceChoice,
    accelerator_possible,
    activate,
    choose_instance_device,
    parse_device_ids,
    probe_accelerators,
    to_host,
)
from ._state import Clock, NumpyMoments, Refusal, RunningMoments, SequenceSlots

__all__ = ["RunningStatsModel"]

_log = logging.getLogger("triton_npu_client.server")

INPUT = "X"
DEFAULT_MAX_SEQUENCES = 1024
DEFAULT_SWEEP_GRACE_US = 500_000


class RunningStatsModel:
    """Running mean / variance / count per sequence, one batched device step per execute.

    Config ``parameters`` read: ``device`` (auto|npu|cuda|cpu), ``device_ids`` ("0-3", "0,2"),
    ``max_sequences`` (cap of live sequences per instance), ``sweep_grace_us`` (added to the idle
    timeout before an idle sequence's state is swept). A ``KIND_GPU`` instance runs on the CUDA device
    Triton assigns it; other kinds follow ``device``/``device_ids`` and the instance index
    (:func:`choose_instance_device`). A request with END and no ``X`` closes its sequence without a
    step (see the module docstring).
    """

    def __init__(self, args: Mapping[str, str], pb: Any, *, clock: Clock = time.monotonic) -> None:
        self._pb = pb
        config = parse_model_config(args["model_config"])
        self.batching = SequenceBatching.from_model_config(config)
        self.dim = _input_dim(config, INPUT)
        capacity = int(model_parameter(config, "max_sequences") or DEFAULT_MAX_SEQUENCES)
        grace_us = int(model_parameter(config, "sweep_grace_us") or DEFAULT_SWEEP_GRACE_US)
        force = model_parameter(config, "device")
        # numpy on CPU when CPU is forced or no accelerator can exist: then torch is never imported.
        host_only = (force or "").strip().lower() == "cpu" or not accelerator_possible()
        self.device_choice: DeviceChoice = choose_instance_device(
            args,
            available=Accelerators() if host_only else probe_accelerators(),
            device_ids=parse_device_ids(model_parameter(config, "device_ids")),
            force=force,
        )
        self.slots = SequenceSlots(
            capacity=capacity, idle_timeout_s=self.batching.idle_timeout_s, grace_s=grace_us / 1e6, clock=clock
        )
        self.state: NumpyMoments | RunningMoments
        if host_only:
            self.device: Any = "cpu"
            self.state = NumpyMoments(capacity=capacity, dim=self.dim)
        else:
            self.device = activate(self.device_choice)
            self.state = RunningMoments(capacity=capacity, dim=self.dim, device=self.device)
        self._control_names = tuple(self.batching.control_inputs.values())
        self.decoupled = bool((config.get("model_transaction_policy") or {}).get("decoupled", False))
        _log.info(
            "%s on %s: %s strategy, cap %d, idle %g s",
            args.get("model_instance_name"),
            self.device,
            self.batching.strategy,
            capacity,
            self.batching.idle_timeout_s,
        )

    def execute(self, requests: Sequence[Any]) -> list[Any] | None:
        responses = self._responses(requests)
        if not self.decoupled:
            return responses
        final = self._pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        for request, response in zip(requests, responses, strict=True):
            request.get_response_sender().send(response, flags=final)
        return None

    def _responses(self, requests: Sequence[Any]) -> list[Any]:
        pb = self._pb
        controls: list[SequenceControls] = []
        inputs: list[NDArray[Any] | None] = []
        bad: dict[int, Refusal] = {}
        for row, request in enumerate(requests):
            try:
                tensors = {name: _as_numpy(pb.get_input_tensor_by_name(request, name)) for name in self._control_names}
                ctl = read_controls(
                    self.batching, correlation_id=request.correlation_id(), flags=request.flags(), tensors=tensors
                )
                x = _as_numpy(pb.get_input_tensor_by_name(request, INPUT))
                # Dummies (READY false) are answered whatever they carry; X may be absent from them too.
                if ctl.ready and x is None and not ctl.end:
                    raise ValueError(
                        f"sequence {ctl.correlation_id!r}: input {INPUT!r} is missing; only a request that carries "
                        f"END may leave it out (that closes the sequence without a step)"
                    )
                if ctl.ready and x is not None and x.shape != (1, self.dim):
                    raise ValueError(f"input {INPUT!r} must have shape [1, {self.dim}] (one step), got {list(x.shape)}")
            except ValueError as err:
                bad[row] = Refusal(reason="bad_input", message=str(err))
                ctl, x = SequenceControls(correlation_id=0, ready=False), None
            controls.append(ctl)
            inputs.append(x)

        plan = self.slots.plan(controls, has_data=[x is not None for x in inputs])
        count = mean = var = None
        if plan.rows:
            x_host = np.concatenate([inputs[r] for r in plan.rows]).astype(np.float32, copy=False)
            c, m, v = self._step(x_host, plan.slots, plan.fresh)
            # One copy to host per output for the whole batch, then cheap numpy views per request.
            count, mean, var = to_host(c).astype(np.int64), to_host(m), to_host(v)
        closed = self._closed_outputs(plan.closes)  # read before finish frees the slots
        self.slots.finish(plan)
        live = np.array([[self.slots.live]], dtype=np.int64)

        position = {row: j for j, row in enumerate(plan.rows)}
        responses = []
        for row in range(len(requests)):
            refusal = bad.get(row) or plan.errors.get(row)
            if refusal is not None:
                code = pb.TritonError.UNAVAILABLE if refusal.reason == "capacity" else pb.TritonError.INVALID_ARG
                responses.append(pb.InferenceResponse(output_tensors=[], error=pb.TritonError(refusal.message, code)))
                continue
            j = position.get(row)
            if row in closed:
                outs = closed[row]
            elif j is None or count is None or mean is None or var is None:
                # A dummy slot (READY false): answered, state untouched.
                outs = self._zeros()
            else:
                outs = (mean[j : j + 1], var[j : j + 1], count[j : j + 1].reshape(1, 1))
            responses.append(
                pb.InferenceResponse(
                    output_tensors=[
                        pb.Tensor("MEAN", outs[0]),
                        pb.Tensor("VAR", outs[1]),
                        pb.Tensor("COUNT", outs[2]),
                        pb.Tensor("LIVE", live),
                    ]
                )
            )
        return responses

    def _zeros(self) -> tuple[NDArray[Any], NDArray[Any], NDArray[Any]]:
        return np.zeros((1, self.dim), np.float32), np.zeros((1, self.dim), np.float32), np.zeros((1, 1), np.int64)

    def _closed_outputs(
        self, closes: Mapping[int, int | None]
    ) -> dict[int, tuple[NDArray[Any], NDArray[Any], NDArray[Any]]]:
        """``(MEAN, VAR, COUNT)`` of each END-only request: its sequence's state as it stands, no step."""
        outs = {row: self._zeros() for row, slot in closes.items() if slot is None}
        held = [(row, slot) for row, slot in closes.items() if slot is not None]
        if not held:
            return outs
        c, m, v = self._read([slot for _, slot in held])
        count = to_host(c).astype(np.int64)
        mean, var = to_host(m).astype(np.float32, copy=False), to_host(v).astype(np.float32, copy=False)
        for j, (row, _) in enumerate(held):
            outs[row] = (mean[j : j + 1], var[j : j + 1], count[j : j + 1].reshape(1, 1))
        return outs

    def _read(self, slots: Sequence[int]) -> tuple[Any, Any, Any]:
        """The state of ``slots`` without a step, in numpy or in torch on the device, like :meth:`_step`."""
        if isinstance(self.state, NumpyMoments):
            return self.state.read(np.asarray(slots, np.int64))
        import torch  # already loaded: a RunningMoments state imported it

        return self.state.read(torch.tensor(slots, dtype=torch.int64, device=self.device))

    def _step(self, x: NDArray[np.float32], slots: Sequence[int], fresh: Sequence[bool]) -> tuple[Any, Any, Any]:
        """One whole-batch state step, in numpy or in torch on the device, whichever state this instance has."""
        if isinstance(self.state, NumpyMoments):
            return self.state.step(np.asarray(slots, np.int64), x, np.asarray(fresh, np.bool_))
        import torch  # already loaded: a RunningMoments state imported it

        return self.state.step(
            torch.tensor(slots, dtype=torch.int64, device=self.device),
            torch.from_numpy(x),
            torch.tensor(fresh, dtype=torch.bool, device=self.device),
        )


def _as_numpy(tensor: Any) -> NDArray[Any] | None:
    return None if tensor is None else tensor.as_numpy()


def _input_dim(config: Mapping[str, Any], name: str) -> int:
    for spec in config.get("input", []):
        if spec.get("name") == name:
            dims = [int(d) for d in spec.get("dims", [])]
            if len(dims) != 1 or dims[0] < 1:
                raise ValueError(f"input {name!r} must have fixed dims [n], got {dims}")
            return dims[0]
    raise ValueError(f"model config declares no input {name!r}")
