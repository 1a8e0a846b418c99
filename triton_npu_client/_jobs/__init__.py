"""Jobs above the client: scoring many rows through a model (groundwork: the ordered, bounded call window and
the crash-safe output)."""

from ._checkpoint import CheckpointMismatch, ResumableOutput
from ._ordered import ordered_map

__all__ = ["CheckpointMismatch", "ResumableOutput", "ordered_map"]
