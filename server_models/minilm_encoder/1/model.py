"""INPUT_IDS, ATTENTION_MASK -> mean-pooled, normalised EMBEDDING (all-MiniLM-L6-v2); see triton_npu_client.server.

The toolkit's EncoderModel checks each request of a batch on its own, pads the batch's rows (of any widths)
itself and runs them through the BERT encoder on the instance's device.
"""

import triton_python_backend_utils as pb_utils

from triton_npu_client.server import EncoderModel


class TritonPythonModel:
    def initialize(self, args):  # type: ignore[no-untyped-def]
        self._model = EncoderModel(args, pb_utils)

    def execute(self, requests):  # type: ignore[no-untyped-def]
        return self._model.execute(requests)

    def finalize(self):  # type: ignore[no-untyped-def]
        self._model.finalize()
