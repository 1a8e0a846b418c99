"""The model layer: a model's signature (spec, from its config), the one validator, and the typed builders."""

from ._build import InputsArg, Plans, build_request, checked_request
from ._spec import ControlInput, ModelSpec, SequenceSpec, TensorSpec
from ._validate import Arrays, fmt_shape, shape_matches, validate_batch, validate_row

__all__ = [
    "Arrays",
    "ControlInput",
    "InputsArg",
    "ModelSpec",
    "Plans",
    "SequenceSpec",
    "TensorSpec",
    "build_request",
    "checked_request",
    "fmt_shape",
    "shape_matches",
    "validate_batch",
    "validate_row",
]
