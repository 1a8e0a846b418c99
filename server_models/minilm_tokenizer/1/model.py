"""TEXT -> INPUT_IDS, ATTENTION_MASK for all-MiniLM-L6-v2; the logic lives in triton_npu_client.server."""

import triton_python_backend_utils as pb_utils

from triton_npu_client.server import TokenizerModel


class TritonPythonModel:
    def initialize(self, args):  # type: ignore[no-untyped-def]
        self._model = TokenizerModel(args, pb_utils)

    def execute(self, requests):  # type: ignore[no-untyped-def]
        return self._model.execute(requests)

    def finalize(self):  # type: ignore[no-untyped-def]
        self._model.finalize()
