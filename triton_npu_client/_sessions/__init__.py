"""Sessions: stateful sequences on sequence-batched models (and, later, chat on top of them)."""

from ._sequence import SequenceIdleWarning, SequenceSession, new_sequence_id, open_sequence, validate_sequence_id

__all__ = ["SequenceIdleWarning", "SequenceSession", "new_sequence_id", "open_sequence", "validate_sequence_id"]
