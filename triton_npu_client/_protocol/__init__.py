"""The protocol between the client and the server models: what both sides must spell the same.

A room of its own, below both: the refusal markers the toolkit's models begin their errors with (``_markers``), the
chat history digest both sides chain (``_digest``), the chat model's tensor names and limits and the checkpoint
families it serves (``chat``, read as a namespace). It imports the standard library only, never the client's layers
nor ``server/`` (tests/test_layers.py holds it), so the client reads it without numpy or torch and the server inside
Triton's stub without tritonclient or grpc. A name both sides must agree on goes here, never into one side for the
other to import.

Control names (START, END, CORRID, READY) are not here: they are Triton's (the config's ``control_input`` kinds),
read by each side from the model's config.
"""

from . import chat
from ._digest import EMPTY, digest_role, history_digest
from ._markers import INVALID_INPUT, MARKERS, SEQUENCE_BUSY, SEQUENCE_CAPACITY, SEQUENCE_UNKNOWN, marker_in

__all__ = [
    "EMPTY",
    "INVALID_INPUT",
    "MARKERS",
    "SEQUENCE_BUSY",
    "SEQUENCE_CAPACITY",
    "SEQUENCE_UNKNOWN",
    "chat",
    "digest_role",
    "history_digest",
    "marker_in",
]
