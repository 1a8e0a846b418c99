"""The SDK's own per-request work, without the network: validate + encode + protobuf vs tritonclient's InferInput.

    python bench/client_overhead.py [--n 20000]

No server needed: a ModelSpec is built from a config dict (that of seq_stats_oldest's input X: FP32[4]) and
each path is timed with timeit (median of 5 repeats). "Planned" is the path every call after the first takes
for an input signature already seen (model handles and sessions keep the plans).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import timeit

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.grpc._utils import _get_inference_request

from triton_npu_client import ModelSpec
from triton_npu_client._model import build_request

CONFIG = {
    "name": "seq_stats_oldest",
    "max_batch_size": 64,
    "input": [{"name": "X", "data_type": "TYPE_FP32", "dims": ["4"]}],
    "output": [{"name": "MEAN", "data_type": "TYPE_FP32", "dims": ["4"]}],
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--n", type=int, default=20000)
    ns = parser.parse_args()
    spec = ModelSpec.from_config(CONFIG)
    x = np.arange(4, dtype=np.float32)
    batch = x.reshape(1, 4)
    prebuilt = build_request(spec, None, {"X": x})
    plans: dict = {}  # type: ignore[type-arg]
    build_request(spec, None, {"X": x}, plans=plans)  # the first call with a signature plans it

    def plain_infer_input() -> object:
        tensor = grpcclient.InferInput("X", [1, 4], "FP32")
        tensor.set_data_from_numpy(batch)
        return tensor

    def plain_with_protobuf() -> object:
        # What tritonclient's aio infer() does before the call: InferInput, then the request protobuf.
        return _get_inference_request(
            "seq_stats_oldest", [plain_infer_input()], "", "", None, 5, True, False, 0, None, None
        )

    cases = {
        "SDK: build_request (validate + encode)": lambda: build_request(spec, None, {"X": x}),
        "SDK: build_request + to_grpc (a protobuf object; not what is sent)": lambda: build_request(
            spec, None, {"X": x}
        ).to_grpc(sequence_id=5, sequence_start=True),
        "SDK: prebuilt request, to_grpc only": lambda: prebuilt.to_grpc(sequence_id=5),
        "SDK: build_request, signature planned (what model.infer does)": lambda: build_request(
            spec, None, {"X": x}, plans=plans
        ),
        "SDK: build_request planned + grpc_bytes (the bytes sent)": lambda: build_request(
            spec, None, {"X": x}, plans=plans
        ).grpc_bytes(sequence_id=5, sequence_start=True),
        "tritonclient: InferInput + set_data_from_numpy": plain_infer_input,
        "tritonclient: InferInput + request protobuf (what infer() builds)": plain_with_protobuf,
    }
    print(f"python bench/client_overhead.py --n {ns.n}\n")
    print("| path | us per request |")
    print("|---|---|")
    for name, fn in cases.items():
        runs = timeit.repeat(fn, number=ns.n, repeat=5)
        print(f"| {name} | {statistics.median(runs) / ns.n * 1e6:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
