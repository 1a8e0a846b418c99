"""What the chat model holds, read from the model itself: its LIVE and KV_BYTES outputs."""

from __future__ import annotations

import numpy as np

from triton_npu_client import Client


async def probe(client: Client, model: str = "chat") -> tuple[int, int]:
    """LIVE (less the probe's own conversation) and KV_BYTES, read with a conversation of one request (START and END
    at once)."""
    handle = await client.model(model)
    roles = np.array([b"user"], dtype=object)
    texts = np.array([b"probe"], dtype=object)
    async with handle.sequence() as seq:
        async for r in seq.stream(ROLE=roles, TEXT=texts, MAX_TOKENS=np.array([1], np.int32)):
            if "LIVE" in r.outputs and int(r["LIVE"].reshape(-1)[0]) > 0:
                return int(r["LIVE"].reshape(-1)[0]) - 1, int(r["KV_BYTES"].reshape(-1)[0])
    raise AssertionError("the chat model reported no LIVE")
