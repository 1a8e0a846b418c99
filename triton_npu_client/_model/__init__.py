"""The model layer: a model's signature (spec, from its config) and the typed builders that validate and encode."""

from ._build import InputsArg, Plans, build_request
from ._spec import ControlInput, ModelSpec, SequenceSpec, TensorSpec

__all__ = ["ControlInput", "InputsArg", "ModelSpec", "Plans", "SequenceSpec", "TensorSpec", "build_request"]
