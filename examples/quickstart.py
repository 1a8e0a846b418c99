"""The main job: start the embedded Triton on server_models/ and use it through the SDK.

Run it with ``python examples/quickstart.py``. It starts a real tritonserver on free loopback ports, then:
one stateless request to ``scale_fp32`` (validated against the model's config before it is sent), one bad
input refused with a typed error before anything crosses the network, one stateful session on
``seq_stats_oldest`` (running mean per sequence; START/END sent for you), and a scripted multi-turn chat
on ``chat`` (``examples/chat_demo.py``: each turn's time to first token and tokens/s with the history kept
on the server, next to the same turn resent in full to a stateless twin), and a small scoring job
(``examples/nearest_neighbours.py``: 400 sentences embedded by the ``minilm`` encoder ensemble with ``score()``,
then the nearest neighbours of a query). Then it stops the server.
"""

from __future__ import annotations

import asyncio

import numpy as np
from chat_demo import run_demo  # examples/chat_demo.py, beside this file
from nearest_neighbours import run_demo as run_scoring_demo  # examples/nearest_neighbours.py

from triton_npu_client import Client, InputDtypeError, LocalTriton


async def main() -> None:
    async with LocalTriton() as server, Client(server.grpc_url) as client:
        print(f"tritonserver ready at {server.grpc_url} and {server.http_url}")

        scale = await client.model("scale_fp32")
        print(scale.spec)  # <ModelSpec scale_fp32(INPUT0: FP32[-1]) -> (OUTPUT0: FP32[-1]), max_batch_size=64>
        x = np.arange(4, dtype=np.float32)
        result = await scale.infer(INPUT0=x)  # sample form: the batch dim is added for you
        y = result["OUTPUT0"]
        if not np.array_equal(y[0], x * 2):
            raise SystemExit(f"unexpected answer: {y!r}")
        print(f"scale_fp32({x.tolist()}) = {y[0].tolist()}")

        try:
            await scale.infer(INPUT0=np.array([1.5, 2.5], dtype=np.float64))  # float64 -> FP32 loses precision
        except InputDtypeError as err:
            print(f"refused before sending: {err}")

        stats = await client.model("seq_stats_oldest")
        async with stats.sequence() as seq:  # a fresh non-zero id; START on the first step
            for step in ([1, 2, 3, 4], [3, 4, 5, 6]):
                out = await seq.infer(X=np.array(step, dtype=np.float32))
            final = await seq.end(X=np.array([5, 6, 7, 8], dtype=np.float32))  # END travels with the last step
        print(f"sequence {seq.sequence_id}: mean after 3 steps = {final['MEAN'][0].tolist()}")
        if not np.allclose(final["MEAN"][0], [3, 4, 5, 6]) or int(out["COUNT"][0, 0]) != 2:
            raise SystemExit("unexpected sequence state")

        await run_demo(client)
        await run_scoring_demo(client)
    print("server stopped")


if __name__ == "__main__":
    asyncio.run(main())
