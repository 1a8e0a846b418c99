"""Running mean / variance / count per sequence; the logic lives in triton_npu_client.server.

The toolkit reads the controls this config declares, keeps each sequence's state on the instance's
device (NPU, else CUDA, else CPU) and computes one batched step per execute.
"""

import importlib
import importlib.util
import sys
import types

import triton_python_backend_utils as pb_utils


def _import_toolkit():  # type: ignore[no-untyped-def]
    # Import triton_npu_client.server without running triton_npu_client/__init__.py: that one loads
    # the client (tritonclient, grpc, ssl), which the stub's embedded Python need not be able to import
    # (on this machine the stub's libpython cannot load the interpreter's _ssl). The toolkit itself
    # needs only numpy and torch. Only this stub process sees the bare parent package.
    if "triton_npu_client" not in sys.modules:
        spec = importlib.util.find_spec("triton_npu_client")
        if spec is None or not spec.submodule_search_locations:
            raise ImportError("triton_npu_client is not installed in the stub's Python environment")
        parent = types.ModuleType("triton_npu_client")
        parent.__path__ = list(spec.submodule_search_locations)
        sys.modules["triton_npu_client"] = parent
    return importlib.import_module("triton_npu_client.server")


class TritonPythonModel:
    def initialize(self, args):  # type: ignore[no-untyped-def]
        self._model = _import_toolkit().RunningStatsModel(args, pb_utils)

    def execute(self, requests):  # type: ignore[no-untyped-def]
        return self._model.execute(requests)
