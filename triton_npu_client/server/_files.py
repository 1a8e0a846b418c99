"""Reading a checkpoint folder's JSON files (``config.json``, sentence-transformers' module configs).

Shared by the engines' model loaders (``chat/_gpt2``, ``encoder/_bert``, ``encoder/_encoder``) so that each accepts a
file or its folder the same way and fails with the same message.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["read_json_config"]


def read_json_config(path: str | Path, name: str = "config.json") -> dict[str, Any]:
    """The JSON object in ``path``, or in ``path / name`` when ``path`` is a folder.

    Raises ``FileNotFoundError`` naming the file, ``ValueError`` naming it when it holds no JSON object.
    """
    path = Path(path)
    if path.is_dir():
        path = path / name
    if not path.is_file():
        raise FileNotFoundError(f"no {path.name} at {path}")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path} holds a JSON {type(raw).__name__}, not an object")
    return raw
