"""The decoder families the chat engine serves: each of the protocol's model types to its loader.

The list of model types is the protocol's (``_protocol.chat.MODEL_TYPES``): the client's checkpoint checks refuse
another before any server starts, so it is not the engine's to keep. This table maps each to the module of this
folder and the loader function that reads it (``_decoders``); tests/test_protocol.py holds that it names exactly
those types. A new family is a module of this folder with a loader, a line here and its name in the protocol.
"""

from __future__ import annotations

from typing import Final

from ..._protocol import chat as proto

__all__ = ["FAMILIES", "MODEL_TYPES"]

#: model_type -> (module of this folder, its loader function).
FAMILIES: Final[dict[str, tuple[str, str]]] = {
    "gpt2": ("_gpt2", "load_gpt2"),
    "llama": ("_llama", "load_llama"),
    "qwen2": ("_llama", "load_llama"),
    "mistral": ("_llama", "load_llama"),
}

#: The model types, in the protocol's order (for messages and help texts).
MODEL_TYPES: Final[tuple[str, ...]] = proto.MODEL_TYPES
