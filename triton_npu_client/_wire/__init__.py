"""The wire form shared by every layer above: dtypes and their codecs, encoded requests, lazily decoded results."""

from ._dtypes import coerce, config_to_triton, from_wire, numpy_dtype, to_wire
from ._request import EncodedInput, InferRequest, ShmPlace
from ._result import InferResult

__all__ = [
    "EncodedInput", "InferRequest", "InferResult", "ShmPlace", "coerce", "config_to_triton", "from_wire",
    "numpy_dtype", "to_wire",
]
