"""Chat on GPT-2, each conversation's KV cache kept on the device; the logic lives in triton_npu_client.server.

The toolkit's ChatModel reads each request into a turn and hands it to a background loop that prefills
new turns, decodes every generating conversation in one batched step per pass and streams the replies.
This model keeps nothing between requests (no sequence batching): each request carries the whole
conversation, which is prefilled again every time; `chat` is the same model keeping conversations.
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
