"""Jobs above the client: scoring many rows through a model, in order, bounded, resumable.

``_ordered`` (the bounded, ordered call window) and ``_checkpoint`` (the crash-safe output) are the parts;
``_formats`` reads and writes the files; ``_score`` is the job.
"""

from ._checkpoint import CheckpointMismatch, ResumableOutput
from ._ordered import ordered_map
from ._score import ScoredRow, ScoreSummary, score, score_rows, score_sync

__all__ = [
    "CheckpointMismatch",
    "ResumableOutput",
    "ScoreSummary",
    "ScoredRow",
    "ordered_map",
    "score",
    "score_rows",
    "score_sync",
]
