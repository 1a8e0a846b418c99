"""Reading Triton's statistics in tests: they are updated just after a response is sent, so wait for the count."""

from __future__ import annotations

import asyncio
import time

from triton_npu_client import Client, ModelStatistics


async def stats_after(client: Client, name: str, before: ModelStatistics, rows: int) -> ModelStatistics:
    """The model's statistics once they count ``rows`` more inferences than ``before`` (or after 30 s: the
    caller's assertion then says what was missing)."""
    deadline = time.monotonic() + 30
    while True:
        (now,) = await client.inference_statistics(name)
        if now.inference_count - before.inference_count >= rows or time.monotonic() > deadline:
            return now
        await asyncio.sleep(0.01)
