"""Stable markers at the start of the server toolkit's own refusal messages: the server writes them, the client reads
them.

The client must tell these refusals apart over unary gRPC, HTTP and the gRPC stream alike; a stream
error carries nothing but its message text, so the text itself holds a fixed, versionless phrase.
Every refusal the toolkit makes for one of these reasons begins with its marker, then a human
sentence naming the sequence id and what to do. Match with ``in`` (or :func:`marker_in`), not by
position: a server or proxy may prefix the text.

This module imports nothing (tests/test_server_toolkit.py holds it), so either side reads it without the other's
dependencies.
"""

__all__ = ["INVALID_INPUT", "MARKERS", "SEQUENCE_BUSY", "SEQUENCE_CAPACITY", "SEQUENCE_UNKNOWN", "marker_in"]

#: A non-START step for a sequence this model instance does not hold (never started, ended, swept
#: after idling, or its START was refused): the sequence's state is gone; start a new one.
SEQUENCE_UNKNOWN = "[triton-npu:sequence-unknown]"

#: A START refused because the instance already holds its cap of live sequences: retry later.
#: Sent with Triton's UNAVAILABLE status where the transport carries one.
SEQUENCE_CAPACITY = "[triton-npu:capacity]"

#: A step refused because the previous step of its sequence is still streaming (steps of one sequence never
#: overlap): the sequence is intact; send the step again once the previous one has ended.
SEQUENCE_BUSY = "[triton-npu:sequence-busy]"

#: A request refused because of its own inputs (a bad option, a message over a size cap, a malformed turn): the
#: request's fault, never retried; the sequence's state is untouched. Sent with INVALID_ARG where the transport
#: carries a status; over the gRPC stream the marker is the only signal.
INVALID_INPUT = "[triton-npu:invalid-input]"

MARKERS = (SEQUENCE_UNKNOWN, SEQUENCE_CAPACITY, SEQUENCE_BUSY, INVALID_INPUT)


def marker_in(text: str) -> str | None:
    """The first of :data:`MARKERS` that ``text`` contains, or None."""
    for marker in MARKERS:
        if marker in text:
            return marker
    return None
