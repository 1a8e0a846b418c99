"""Load any decoder the chat engine serves, chosen by the checkpoint's ``config.json`` ``model_type``.

Each family keeps its own module (``_gpt2``, ``_llama``); this one only reads the model type and hands the
folder to that family's loader, so a caller needs neither to know the family nor to import torch itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from .._files import read_json_config

if TYPE_CHECKING:
    import torch

    from ._gpt2 import GPT2
    from ._llama import Llama

__all__ = ["DECODER_FAMILIES", "load_decoder"]

# config.json model_type -> the module of this folder whose loader reads it.
DECODER_FAMILIES = {"gpt2": "_gpt2", "llama": "_llama", "qwen2": "_llama", "mistral": "_llama"}


def load_decoder(
    path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> GPT2 | Llama:
    """Load the checkpoint folder ``path`` with the decoder its ``config.json`` names (``model_type``).

    ``gpt2`` loads with :func:`~._gpt2.load_gpt2`; ``llama``, ``qwen2`` and ``mistral`` with
    :func:`~._llama.load_llama`. ``dtype`` defaults to float32. Raises ``ValueError`` naming the model type
    and the supported ones for any other, ``FileNotFoundError`` when there is no ``config.json``.
    """
    model_type = read_json_config(path).get("model_type")
    module = DECODER_FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if module == "_gpt2":
        from ._gpt2 import load_gpt2

        return load_gpt2(path, device, dtype)
    if module == "_llama":
        from ._llama import load_llama

        return load_llama(path, device, dtype)
    raise ValueError(
        f"{Path(path)}: config.json's model_type {model_type!r} is not supported; "
        f"supported are {', '.join(sorted(DECODER_FAMILIES))}"
    )
