"""Y = 3 * X[:, 0], after sleeping max(X[:, 1]) ms; a negative X[:, 0] fails the request (see config.pbtxt)."""

import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):  # type: ignore[no-untyped-def]
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            delay_ms = float(x[:, 1].max()) if len(x) else 0.0
            if delay_ms > 0:
                time.sleep(min(delay_ms, 5000.0) / 1000.0)
            bad = np.flatnonzero(x[:, 0] < 0)
            if bad.size:
                error = pb_utils.TritonError(f"score_probe refuses negative X[0] (batch row {int(bad[0])})")
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=error))
                continue
            y = (3.0 * x[:, :1]).astype(np.float32)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", y)]))
        return responses
