"""Numpy-only stateful model (running sum per sequence), oldest strategy, several outputs per response.

With ``decoupled: true`` in the config it answers through the response sender with the FINAL flag
set on the one response; otherwise it returns the responses from ``execute`` (the crashing path).
"""

import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.sums = {}
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(json.loads(args["model_config"]))

    def execute(self, requests):
        rows = []
        for request in requests:
            cid, flags = request.correlation_id(), request.flags()
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            total = (0 if flags & 1 else self.sums.get(cid, 0)) + x
            self.sums[cid] = total
            if flags & 2:
                self.sums.pop(cid, None)
            rows.append(total.astype(np.float32))
        batch = np.concatenate(rows)
        live = np.array([[len(self.sums)]], dtype=np.int64)
        responses = [
            pb_utils.InferenceResponse(
                output_tensors=[
                    pb_utils.Tensor("SUM", batch[j : j + 1]),
                    pb_utils.Tensor("HALF", batch[j : j + 1] / 2),
                    pb_utils.Tensor("DOUBLE", batch[j : j + 1] * 2),
                    pb_utils.Tensor("LIVE", live),
                ]
            )
            for j in range(len(requests))
        ]
        if not self.decoupled:
            return responses
        for request, response in zip(requests, responses, strict=True):
            request.get_response_sender().send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
