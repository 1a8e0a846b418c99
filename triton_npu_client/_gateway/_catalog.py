"""Which models the fleet serves through the OpenAI API: chat models and embedding models, found by their inputs.

A model is listed when its config fits one of two shapes:

- **chat**: decoupled, sequence-batched, inputs ``ROLE`` and ``TEXT``, outputs ``PIECE`` and ``FINISH`` (the shape
  of ``server_models/chat`` and of every model generated from a checkpoint); its context length is the config's
  ``max_ctx`` parameter;
- **embedding**: stateless, one string input of one element per row, one FP32 output of a fixed width (the shape of
  ``server_models/minilm``).

Everything else (the encoder's own steps, the stateless chat twin, test models) is left out. The catalog is read
from the server's repository index and each READY model's config, cached (a stale read is renewed in the
background); a request naming a model not in it reads it again once before answering 404.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Final, Literal

import attrs

from .._errors import TritonError
from .._model import ModelSpec

if TYPE_CHECKING:
    from .._client import Client

__all__ = ["Catalog", "ServedModel"]

#: Seconds a read of the catalog stays good (models come and go with explicit model control).
FRESH_S: Final = 10.0


@attrs.frozen(kw_only=True)
class ServedModel:
    name: str
    kind: Literal["chat", "embedding"]
    context_length: int | None = None
    #: For an embedding model: its text input and its vector output.
    text_input: str = ""
    vector_output: str = ""
    dimensions: int = 0


def classify(spec: ModelSpec, config: dict[str, object]) -> ServedModel | None:
    """The model's kind through this API, or None when it fits neither shape."""
    names_in = {t.name for t in spec.inputs}
    names_out = {t.name for t in spec.outputs}
    if spec.decoupled and spec.sequence is not None:
        if {"ROLE", "TEXT"} <= names_in and {"PIECE", "FINISH"} <= names_out:
            params = config.get("parameters")
            ctx: int | None = None
            if isinstance(params, dict):
                raw = params.get("max_ctx")
                value = raw.get("string_value") if isinstance(raw, dict) else None
                if isinstance(value, str) and value.isdigit():
                    ctx = int(value)
            return ServedModel(name=spec.name, kind="chat", context_length=ctx)
        return None
    if spec.sequence is not None or spec.decoupled or len(spec.inputs) != 1 or len(spec.outputs) != 1:
        return None
    (text,) = spec.inputs
    (vector,) = spec.outputs
    if text.dtype != "BYTES" or text.dims not in ((1,), (-1,)) or not spec.batched:
        return None
    if vector.dtype != "FP32" or len(vector.dims) != 1 or vector.dims[0] <= 0:
        return None
    return ServedModel(
        name=spec.name, kind="embedding", text_input=text.name, vector_output=vector.name, dimensions=vector.dims[0]
    )


class Catalog:
    """The served models, read from the fleet and cached (see the module docstring)."""

    def __init__(self, client: Client) -> None:
        self._client = client
        self._models: dict[str, ServedModel] = {}
        self._read_at: float | None = None
        self._lock = asyncio.Lock()
        self._refreshing: asyncio.Task[None] | None = None

    async def models(self, *, refresh: bool = False) -> dict[str, ServedModel]:
        """The served models. A stale read is refreshed in the background, so no request waits for the dozens of
        config reads a refresh takes; only the first read, or ``refresh=True``, waits for it."""
        if refresh or self._read_at is None:
            await self._refresh()
        elif time.monotonic() - self._read_at >= FRESH_S and self._refreshing is None:
            self._refreshing = asyncio.get_running_loop().create_task(self._refresh_quietly())
        return self._models

    async def find(self, name: str) -> ServedModel | None:
        known = (await self.models()).get(name)
        if known is None:
            known = (await self.models(refresh=True)).get(name)
        return known

    async def _refresh(self) -> None:
        async with self._lock:
            self._models = await self._read()
            self._read_at = time.monotonic()

    async def _refresh_quietly(self) -> None:
        try:
            await self._refresh()
        except TritonError:
            pass  # the server is unreachable now: requests say so themselves; the last read stays
        finally:
            self._refreshing = None

    async def aclose(self) -> None:
        task, self._refreshing = self._refreshing, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _read(self) -> dict[str, ServedModel]:
        client = self._client
        index = await client.repository_index()
        ready = sorted({m.name for m in index if m.state == "READY"})

        async def one(name: str) -> ServedModel | None:
            try:
                config = await client.model_config(name)
                return classify(ModelSpec.from_config(config), config)
            except TritonError:
                return None  # unloaded between the index and its config: not served

        found = await asyncio.gather(*(one(n) for n in ready))
        return {m.name: m for m in found if m is not None}
