"""Jobs above the client: scoring many rows through a model (groundwork: the ordered, bounded call window)."""

from ._ordered import ordered_map

__all__ = ["ordered_map"]
