"""Temporary: the old name of :mod:`.formats`, for ``_score`` until it imports the package (then delete this)."""

from .formats import MAX_LINE_BYTES, BadRow, read_rows

__all__ = ["MAX_LINE_BYTES", "BadRow", "read_rows"]
