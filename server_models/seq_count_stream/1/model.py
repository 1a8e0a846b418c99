"""A per-sequence counter, N responses per step; streaming, cancellation and per-sequence order come from the toolkit.

execute() only reads each request and hands its response sender to a StepLoop; the loop's thread admits
new steps (SequenceSlots: START resets, unknown sequences refused), advances every due step by one
response (one numpy increment for the whole batch) and stops cancelled steps.
"""

import numpy as np
import triton_python_backend_utils as pb_utils

from triton_npu_client._protocol import INVALID_INPUT
from triton_npu_client.server import (
    SequenceBatching,
    SequenceControls,
    SequenceSlots,
    StepLoop,
    StepOutput,
    model_parameter,
    parse_model_config,
    read_controls,
)

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class _Job:
    """One step of one sequence: what is left to send, its pacing, and the state slot it was given."""

    __slots__ = ("controls", "delay_s", "remaining", "slot")

    def __init__(self, controls, remaining, delay_s):  # type: ignore[no-untyped-def]
        self.controls = controls
        self.remaining = remaining
        self.delay_s = delay_s
        self.slot = -1


def _error(message, code=None):  # type: ignore[no-untyped-def]
    # pb_utils gets TritonError from the stub after this module is imported: look it up per call.
    error = pb_utils.TritonError(message) if code is None else pb_utils.TritonError(message, code)
    return pb_utils.InferenceResponse(output_tensors=[], error=error)


def _one_int(request, name, default=None):  # type: ignore[no-untyped-def]
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        if default is None:
            raise ValueError(f"input {name!r} is required")
        return default
    flat = tensor.as_numpy().reshape(-1)
    if flat.size != 1 or int(flat[0]) < 0:
        raise ValueError(f"input {name!r} must hold one value >= 0, got {flat.tolist()}")
    return int(flat[0])


class TritonPythonModel:
    def initialize(self, args):  # type: ignore[no-untyped-def]
        config = parse_model_config(args["model_config"])
        self._batching = SequenceBatching.from_model_config(config)
        capacity = int(model_parameter(config, "max_sequences") or 4096)
        grace_us = int(model_parameter(config, "sweep_grace_us") or 500_000)
        self._slots = SequenceSlots(
            capacity=capacity, idle_timeout_s=self._batching.idle_timeout_s, grace_s=grace_us / 1e6
        )
        self._counter = np.zeros(capacity, dtype=np.int64)
        self._control_names = tuple(self._batching.control_inputs.values())
        self._loop = StepLoop(
            step=self._step,
            admit=self._admit,
            on_exit=self._on_exit,
            final_flag=FINAL,
            error_response=_error,
            name=args.get("model_instance_name", "seq_count_stream"),
        )

    def execute(self, requests):  # type: ignore[no-untyped-def]
        for request in requests:
            sender = request.get_response_sender()
            try:
                tensors = {
                    name: None if (t := pb_utils.get_input_tensor_by_name(request, name)) is None else t.as_numpy()
                    for name in self._control_names
                }
                controls = read_controls(
                    self._batching, correlation_id=request.correlation_id(), flags=request.flags(), tensors=tensors
                )
                # END with no N closes the sequence without a step (what a client sends to end a session).
                n = _one_int(request, "N", 0 if controls.end else None)
                job = _Job(controls, n, _one_int(request, "DELAY_MS", 0) / 1000.0)
            except ValueError as err:
                # Marked: over the gRPC stream the text is all the client gets (no status code).
                sender.send(_error(f"{INVALID_INPUT} {err}", pb_utils.TritonError.INVALID_ARG), flags=FINAL)
                continue
            if not controls.ready:
                sender.send(flags=FINAL)
                continue
            refusal = self._loop.submit(controls.correlation_id, sender, job)
            if refusal is not None:
                sender.send(_error(refusal.message, pb_utils.TritonError.UNAVAILABLE), flags=FINAL)
        return None

    def finalize(self):  # type: ignore[no-untyped-def]
        self._loop.close()

    # The three callbacks below run on the loop's thread only: the slots and counters need no lock.

    def _admit(self, new, running):  # type: ignore[no-untyped-def]
        # Listing the running sequences too marks them seen, so the idle sweep inside plan() never
        # frees a sequence whose step is still streaming.
        touch = [SequenceControls(correlation_id=s.key) for s in running]
        plan = self._slots.plan([s.job.controls for s in new] + touch)
        verdicts = [None] * len(new)
        for row, refusal in plan.errors.items():
            if row < len(new):
                code = pb_utils.TritonError.UNAVAILABLE if refusal.reason == "capacity" else pb_utils.TritonError.INVALID_ARG
                verdicts[row] = _error(refusal.message, code)
        for row, slot, fresh in zip(plan.rows, plan.slots, plan.fresh):
            if row < len(new):
                new[row].job.slot = slot
                if fresh:
                    self._counter[slot] = 0
        return verdicts

    def _step(self, due):  # type: ignore[no-untyped-def]
        sending = [i for i, s in enumerate(due) if s.job.remaining > 0]
        slots = np.array([due[i].job.slot for i in sending], dtype=np.int64)
        # One step of every due sequence at once (slots are unique: one step per sequence).
        self._counter[slots] += 1
        values = self._counter[slots]
        for i in sending:
            due[i].job.remaining -= 1
        for s in due:
            if s.job.remaining == 0 and s.job.controls.end:
                self._slots.release(s.key)
        live = np.array([[self._slots.live]], dtype=np.int64)
        cancelled = np.array([[self._loop.cancelled]], dtype=np.int64)
        outputs = [StepOutput(done=True)] * len(due)
        for j, i in enumerate(sending):
            job = due[i].job
            response = pb_utils.InferenceResponse(
                output_tensors=[
                    pb_utils.Tensor("VALUE", values[j : j + 1].reshape(1, 1)),
                    pb_utils.Tensor("CANCELLED", cancelled),
                    pb_utils.Tensor("LIVE", live),
                ]
            )
            done = job.remaining == 0
            outputs[i] = StepOutput(response=response, done=done, wait_s=0.0 if done else job.delay_s)
        return outputs

    def _on_exit(self, stream, reason):  # type: ignore[no-untyped-def]
        # Triton counts an END step as delivered even when it was cancelled or failed: free it too.
        if stream.job.controls.end:
            self._slots.release(stream.key)
