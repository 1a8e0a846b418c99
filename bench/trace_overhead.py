"""What tracing costs per request: OpenTelemetry absent, installed with no SDK provider, and with an SDK provider.

    python bench/trace_overhead.py [--n 20000] [--url grpc://127.0.0.1:8001 [--e2e-n 2000]]

Each mode runs in a fresh interpreter: "absent" hides opentelemetry from the import system (as when it is not
installed); "API, no SDK" is opentelemetry-api with no tracer provider set (its spans record nothing); "SDK" sets a
TracerProvider with a BatchSpanProcessor whose exporter drops the spans (the processor's own cost, not an
exporter's network).

Client side: ``Caller.infer`` through the real ``GrpcTransport`` (the request's trace context injected into its
metadata, the response decoded) with the channel's ModelInfer call answered in process by a prebuilt response:
everything the client does per request except the network, in CPU time of the process (its threads included, so
the batch processor's too; other processes on the machine do not count), median of 5 repeats, best of 3 rounds.
With ``--url``, also sequential ``model.infer`` calls of scale_fp32 against a real server: end to end, one in flight,
wall-clock time, so noisy on a busy machine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import textwrap

MODES = {"absent": "OpenTelemetry absent", "api": "API, no SDK provider", "sdk": "SDK provider (batch processor)"}

_HIDE = textwrap.dedent(
    """
    import sys

    class _Hide:
        def __init__(self, inner):
            self.inner = inner

        def find_spec(self, name, path=None, target=None):
            if name == "opentelemetry" or name.startswith("opentelemetry."):
                return None
            return self.inner.find_spec(name, path, target)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    sys.meta_path[:] = [_Hide(f) for f in sys.meta_path]
    """
)

_SDK = textwrap.dedent(
    """
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    class _Drop(SpanExporter):
        def export(self, spans):
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(_Drop()))
    trace.set_tracer_provider(provider)
    """
)

_MEASURE = textwrap.dedent(
    """
    import asyncio, json, statistics, sys, time, timeit

    import numpy as np
    from tritonclient.grpc import service_pb2

    from triton_npu_client import Client, ModelSpec, _trace
    from triton_npu_client._call._caller import Caller
    from triton_npu_client._call import NO_RETRY
    from triton_npu_client._model import build_request
    from triton_npu_client._transport._grpc import GrpcTransport

    n, url, e2e_n = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    spec = ModelSpec.from_config({
        "name": "scale_fp32", "max_batch_size": 64,
        "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": ["-1"]}],
        "output": [{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": ["-1"]}],
    })
    request = build_request(spec, None, {"INPUT0": np.arange(4, dtype=np.float32)})
    answer = service_pb2.ModelInferResponse(model_name="scale_fp32", model_version="1")
    answer.outputs.add(name="OUTPUT0", datatype="FP32", shape=[1, 4])
    answer.raw_output_contents.append(np.arange(4, dtype=np.float32).tobytes())

    async def client_side():
        transport = GrpcTransport("127.0.0.1:1")
        async def answered(payload, metadata=None, timeout=None):
            return answer
        transport._infer = answered  # the network, answered in process
        caller = Caller(transport, timeout_s=None, retry=NO_RETRY)
        async def batch():
            for _ in range(n):
                await caller.infer(request, timeout_s=None)
        runs = []
        for _ in range(5):
            began = time.process_time()  # this process's CPU time (its threads' too): what other processes do
            await batch()                # on the machine does not count
            runs.append((time.process_time() - began) / n * 1e6)
        await transport.aclose()
        return statistics.median(runs)

    async def end_to_end():
        async with Client(url, coalescing=None) as client:
            scale = await client.model("scale_fp32")
            x = np.arange(4, dtype=np.float32)
            for _ in range(200):
                await scale.infer(INPUT0=x)
            runs = []
            for _ in range(3):
                began = time.perf_counter()
                for _ in range(e2e_n):
                    await scale.infer(INPUT0=x)
                runs.append((time.perf_counter() - began) / e2e_n * 1e6)
            return statistics.median(runs)

    async def main():
        row = {"available": _trace.AVAILABLE, "client_us": await client_side()}
        if url:
            row["e2e_us"] = await end_to_end()
        row["otel_loaded"] = any(m.split(".")[0] == "opentelemetry" for m in sys.modules)
        print("ROW", json.dumps(row))

    asyncio.run(main())
    """
)


def _run(mode: str, n: int, url: str, e2e_n: int) -> dict[str, object]:
    code = {"absent": _HIDE, "api": "", "sdk": _SDK}[mode] + _MEASURE
    proc = subprocess.run(
        [sys.executable, "-c", code, str(n), url, str(e2e_n)], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise SystemExit(f"mode {mode} failed:\n{proc.stderr[-3000:]}")
    line = [x for x in proc.stdout.splitlines() if x.startswith("ROW ")][-1]
    row: dict[str, object] = json.loads(line[4:])
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--n", type=int, default=20000, help="client-side requests per repeat")
    parser.add_argument("--url", default="", help="a server with scale_fp32, for end-to-end figures too")
    parser.add_argument("--e2e-n", type=int, default=2000, help="end-to-end requests per repeat")
    parser.add_argument("--rounds", type=int, default=3, help="runs of every mode, round robin; the best is shown")
    ns = parser.parse_args()
    print("python bench/trace_overhead.py " + " ".join(sys.argv[1:]))
    # Round robin, the best of ``--rounds`` per mode: a busy machine slows a whole run, not one mode.
    rounds = [{mode: _run(mode, ns.n, ns.url, ns.e2e_n) for mode in MODES} for _ in range(ns.rounds)]
    rows = {mode: min((r[mode] for r in rounds), key=lambda row: float(row["client_us"])) for mode in MODES}  # type: ignore[arg-type]
    base = rows["absent"]["client_us"]
    assert isinstance(base, float)
    print(f"| tracing | client side, us/request | vs absent |{' end to end, us/request |' if ns.url else ''}")
    print(f"|---|---|---|{'---|' if ns.url else ''}")
    for mode, label in MODES.items():
        row = rows[mode]
        us = row["client_us"]
        assert isinstance(us, float)
        e2e = f" {row['e2e_us']:.0f} |" if ns.url else ""
        print(f"| {label} | {us:.1f} | {us - base:+.1f} |{e2e}")
    loaded = {mode: rows[mode]["otel_loaded"] for mode in MODES}
    print(f"opentelemetry loaded: {loaded}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
