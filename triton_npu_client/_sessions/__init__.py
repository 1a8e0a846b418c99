"""Sessions: stateful sequences on sequence-batched models, and chat conversations on top of them.

Their errors (``ChatOptionError``, ``SequenceIdleWarning``, ...) live in the one tree, ``_errors``.
"""

from ._chat import (
    ChatMessage,
    ChatOpenArgs,
    ChatOptionArgs,
    ChatOptions,
    ChatReply,
    ChatSession,
    ChatState,
    TokenLogprob,
    TopLogprob,
    defer_chat,
    open_chat,
)
from ._constraint import ResponseFormat, as_response_format
from ._sequence import SequenceSession, defer_sequence, new_sequence_id, open_sequence, validate_sequence_id
from ._tools import Tool, ToolCall, ToolChoice

__all__ = [
    "ChatMessage",
    "ChatOpenArgs",
    "ChatOptionArgs",
    "ChatOptions",
    "ChatReply",
    "ChatSession",
    "ChatState",
    "ResponseFormat",
    "SequenceSession",
    "TokenLogprob",
    "Tool",
    "ToolCall",
    "ToolChoice",
    "TopLogprob",
    "as_response_format",
    "defer_chat",
    "defer_sequence",
    "new_sequence_id",
    "open_chat",
    "open_sequence",
    "validate_sequence_id",
]
