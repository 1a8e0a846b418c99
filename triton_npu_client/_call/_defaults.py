"""The "not given, use the client's default" sentinel (``None`` means "no limit")."""

from __future__ import annotations

import enum
from typing import Final

__all__ = ["USE_CLIENT_DEFAULT", "UseClientDefault"]


class UseClientDefault(enum.Enum):
    """Sentinel type: "not given, use the client's default" (``None`` means "no limit")."""

    USE_CLIENT_DEFAULT = "USE_CLIENT_DEFAULT"

    def __repr__(self) -> str:
        return "USE_CLIENT_DEFAULT"


USE_CLIENT_DEFAULT: Final = UseClientDefault.USE_CLIENT_DEFAULT
