"""Sessions: stateful sequences on sequence-batched models, and chat conversations on top of them."""

from ._chat import (
    ChatBusyError,
    ChatHistoryMismatch,
    ChatMessage,
    ChatMessageError,
    ChatOptionError,
    ChatOptions,
    ChatReply,
    ChatSession,
    open_chat,
)
from ._sequence import SequenceIdleWarning, SequenceSession, new_sequence_id, open_sequence, validate_sequence_id

__all__ = [
    "ChatBusyError",
    "ChatHistoryMismatch",
    "ChatMessage",
    "ChatMessageError",
    "ChatOptionError",
    "ChatOptions",
    "ChatReply",
    "ChatSession",
    "SequenceIdleWarning",
    "SequenceSession",
    "new_sequence_id",
    "open_chat",
    "open_sequence",
    "validate_sequence_id",
]
