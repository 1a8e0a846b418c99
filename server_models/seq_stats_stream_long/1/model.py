"""Running mean / variance / count per sequence; the logic lives in triton_npu_client.server.

The toolkit reads the controls this config declares, keeps each sequence's state on the instance's
device (NPU, else CUDA, else CPU) and computes one batched step per execute.
"""

import triton_python_backend_utils as pb_utils

# The package's __init__ loads the client lazily, so this import brings only the toolkit (numpy),
# not tritonclient/grpc, into the stub (torch too only when an accelerator may exist).
from triton_npu_client.server import RunningStatsModel


class TritonPythonModel:
    def initialize(self, args):  # type: ignore[no-untyped-def]
        self._model = RunningStatsModel(args, pb_utils)

    def execute(self, requests):  # type: ignore[no-untyped-def]
        return self._model.execute(requests)
