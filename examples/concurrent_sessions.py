"""Many concurrent stateful sessions, each checking its own answers, against an embedded local Triton.

    python examples/concurrent_sessions.py --sessions 200 --steps 10

Starts a real ``tritonserver`` on a copy of ``server_models/seq_stats_oldest`` (running mean per sequence),
opens ``--sessions`` sequences at once, sends ``--steps`` steps on each, and checks every answer against a
numpy reference computed from that session's own inputs. Exit status 0 means every session got exactly
its own results and the server holds no sequence afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from triton_npu_client import Client, LocalTriton, default_model_repository, open_sequence

MODEL = "seq_stats_oldest"
# Over the gRPC stream: the decoupled twin (Triton 2.51 crashes under streamed load on the non-decoupled form).
STREAM_MODEL = "seq_stats_stream"


async def run(sessions: int, steps: int, *, stream: bool) -> int:
    with tempfile.TemporaryDirectory() as repo:
        name = STREAM_MODEL if stream else MODEL
        shutil.copytree(default_model_repository() / name, Path(repo) / name)
        async with LocalTriton(repo) as server, Client(server.grpc_url) as client:
            model = await client.model(name)
            rng = np.random.default_rng(0)
            inputs = rng.standard_normal((sessions, steps, 4)).astype(np.float32)

            async def session(k: int) -> bool:
                async with open_sequence(model) as seq:  # the stream for the decoupled twin, else unary
                    for step in range(steps):
                        result = await seq.infer(X=inputs[k, step])
                        expected = inputs[k, : step + 1].astype(np.float64).mean(axis=0)
                        if not np.allclose(result["MEAN"][0], expected, rtol=1e-4, atol=1e-5):
                            return False
                return True

            started = time.perf_counter()
            ok = await asyncio.gather(*(session(k) for k in range(sessions)))
            elapsed = time.perf_counter() - started
            async with open_sequence(model) as probe:
                live = int((await probe.end(X=np.zeros(4, np.float32)))["LIVE"][0, 0])
    good = sum(ok)
    print(
        f"{good}/{sessions} sessions got exactly their own results; {sessions * steps} steps in {elapsed:.2f} s "
        f"({sessions * steps / elapsed:.0f} steps/s, {'stream' if stream else 'unary gRPC'}); live after: {live}"
    )
    return 0 if good == sessions and live == 0 else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=200)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument(
        "--stream", action="store_true", help=f"carry the steps on the gRPC stream ({STREAM_MODEL}, decoupled)"
    )
    args = parser.parse_args()
    return asyncio.run(run(args.sessions, args.steps, stream=args.stream))


if __name__ == "__main__":
    sys.exit(main())
