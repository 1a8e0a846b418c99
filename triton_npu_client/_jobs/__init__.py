"""Jobs above the client: scoring many rows through a model, in order, bounded, resumable.

``_ordered`` (the bounded, ordered call window) and ``_checkpoint`` (the crash-safe output) are the parts;
``formats`` reads and writes the files (a module per format); ``_safety`` and ``_plan`` check a job's paths and
checkpoint before anything is opened; ``_score`` is the job.
"""

from ._checkpoint import CheckpointMismatch, ResumableOutput
from ._ordered import ordered_map
from ._plan import JobPlan, plan_job
from ._preflight import check_model, check_source, repository_spec
from ._ray import RayScorer
from ._safety import (
    CheckpointFilesMismatch,
    InputFileError,
    InputFileNotFound,
    JobPathError,
    OutputExistsError,
    OutputFolderError,
    ResumeNotConfirmed,
    SameFileError,
    UnknownFormatError,
)
from ._score import ScoredBatch, ScoredRow, ScoreSummary, score, score_batches, score_rows, score_sync
from .formats import MAX_LINE_BYTES, input_format, output_format, read_rows

__all__ = [
    "MAX_LINE_BYTES",
    "CheckpointFilesMismatch",
    "CheckpointMismatch",
    "InputFileError",
    "InputFileNotFound",
    "JobPathError",
    "JobPlan",
    "OutputExistsError",
    "OutputFolderError",
    "RayScorer",
    "ResumableOutput",
    "ResumeNotConfirmed",
    "SameFileError",
    "ScoreSummary",
    "ScoredBatch",
    "ScoredRow",
    "UnknownFormatError",
    "check_model",
    "check_source",
    "input_format",
    "ordered_map",
    "output_format",
    "plan_job",
    "read_rows",
    "repository_spec",
    "score",
    "score_batches",
    "score_rows",
    "score_sync",
]
