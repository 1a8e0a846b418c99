"""OUT_<T> = IN_<T> for every input the request carries (no batching across requests: nothing to compute)."""

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):  # type: ignore[no-untyped-def]
        responses = []
        for request in requests:
            outputs = []
            for tensor in request.inputs():
                out_name = "OUT_" + tensor.name()[3:]
                if out_name == "OUT_BF16":
                    # numpy has no bfloat16: as_numpy() cannot represent it, dlpack can (BYTES is the reverse).
                    outputs.append(pb_utils.Tensor.from_dlpack(out_name, tensor.to_dlpack()))
                else:
                    outputs.append(pb_utils.Tensor(out_name, tensor.as_numpy()))
            responses.append(pb_utils.InferenceResponse(outputs))
        return responses
