"""OUTPUT0 = INPUT0, answered after DELAY_S seconds (optional input)."""

import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):  # type: ignore[no-untyped-def]
        responses = []
        for request in requests:
            delay = pb_utils.get_input_tensor_by_name(request, "DELAY_S")
            if delay is not None:
                # Sleep in short slices so a cancelled request releases the instance early.
                deadline = time.monotonic() + float(delay.as_numpy().reshape(-1)[0])
                while time.monotonic() < deadline and not request.is_cancelled():
                    time.sleep(0.01)
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", x)]))
        return responses
