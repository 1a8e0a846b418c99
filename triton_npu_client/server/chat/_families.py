"""The decoder families the chat engine serves, by a checkpoint's ``config.json`` ``model_type``: the one list.

A leaf (it imports nothing): the chat engine's loader (``_decoders``), the client's checkpoint checks
(``_local/_checkpoint``), the CLI, the benchmarks and the tests all read this table instead of keeping their own.
A new family is a module of this folder with a loader, and a line here.
"""

from __future__ import annotations

from typing import Final

__all__ = ["FAMILIES", "MODEL_TYPES"]

#: model_type -> (module of this folder, its loader function).
FAMILIES: Final[dict[str, tuple[str, str]]] = {
    "gpt2": ("_gpt2", "load_gpt2"),
    "llama": ("_llama", "load_llama"),
    "qwen2": ("_llama", "load_llama"),
    "mistral": ("_llama", "load_llama"),
}

#: The model types, in the table's order (for messages and help texts).
MODEL_TYPES: Final[tuple[str, ...]] = tuple(FAMILIES)
