"""`chat` with two conversation slots and immediate eviction, for the eviction tests (see config.pbtxt).

The same toolkit ChatModel and weights as `chat`; only the config's caps differ.
"""

import triton_python_backend_utils as pb_utils

from triton_npu_client.server import ChatModel


class TritonPythonModel:
    def initialize(self, args):  # type: ignore[no-untyped-def]
        self._model = ChatModel(args, pb_utils)

    def execute(self, requests):  # type: ignore[no-untyped-def]
        return self._model.execute(requests)

    def finalize(self):  # type: ignore[no-untyped-def]
        self._model.finalize()
