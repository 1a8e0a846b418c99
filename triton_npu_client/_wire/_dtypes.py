"""Triton dtypes <-> numpy: names, wire codecs (BYTES, BF16) and the safe-cast rules of the input builders.

Representation choices (numpy has no bfloat16 and no variable-length byte string):

* ``BF16`` travels as bfloat16 on the wire and is ``float32`` in numpy, both ways. Encoding rounds to the
  nearest bfloat16 (ties to even), like a device cast does; decoding is exact.
* ``BYTES`` is an ``object`` array of ``bytes`` in numpy. ``str`` elements are encoded as UTF-8 on the way
  in; results stay ``bytes`` (``InferResult.as_str`` decodes). NUL bytes and any byte value survive.

Safe-cast rules (:func:`coerce`): the dtype always comes from the model, never from the value.

* numpy arrays: allowed when ``np.can_cast(src, dst, "safe")``; integer and bool sources are also allowed
  into a narrower integer or into a float when every value converts exactly (value-checked); anything
  else (float -> int, float64 -> float32, int -> bool, ...) raises :class:`InputDtypeError`.
* Python scalars and (nested) lists carry no dtype of their own: ints are value-checked like integer
  arrays; floats may go into any float type (FP16/FP32/BF16 round, as users expect) as long as no finite
  value overflows to infinity; floats never go into integer types; ``bool`` goes to ``BOOL`` or numbers.
* ``str``/``bytes`` only into ``BYTES``, and ``BYTES`` accepts nothing else.
* ``allow_lossy=True`` turns every numeric refusal into a plain ``astype`` (the caller's decision).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from .._errors import InputDtypeError

__all__ = [
    "TRITON_DTYPES",
    "coerce",
    "config_to_triton",
    "decode_bf16",
    "decode_bytes",
    "encode_bf16",
    "encode_bytes",
    "from_wire",
    "is_triton_dtype",
    "numpy_dtype",
    "to_wire",
    "triton_dtype_of",
]

# The numpy dtype each Triton dtype is represented by on the Python side (little-endian, as on the wire).
_NUMPY: Final[dict[str, np.dtype[Any]]] = {
    "BOOL": np.dtype(np.bool_),
    "INT8": np.dtype("<i1"),
    "INT16": np.dtype("<i2"),
    "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"),
    "UINT8": np.dtype("<u1"),
    "UINT16": np.dtype("<u2"),
    "UINT32": np.dtype("<u4"),
    "UINT64": np.dtype("<u8"),
    "FP16": np.dtype("<f2"),
    "FP32": np.dtype("<f4"),
    "FP64": np.dtype("<f8"),
    "BF16": np.dtype("<f4"),  # numpy has no bfloat16: float32 on the Python side
    "BYTES": np.dtype(object),
}

TRITON_DTYPES: Final[tuple[str, ...]] = tuple(_NUMPY)

# Config enum names that do not follow the TYPE_<name> pattern.
_CONFIG_ALIASES: Final[dict[str, str]] = {"TYPE_STRING": "BYTES"}


def is_triton_dtype(name: str) -> bool:
    """Whether ``name`` is a Triton tensor dtype string such as ``"FP32"``."""
    return name in _NUMPY


def config_to_triton(config_type: str) -> str:
    """``"TYPE_FP32"`` (model config enum) -> ``"FP32"``; ``"TYPE_STRING"`` -> ``"BYTES"``."""
    if config_type in _CONFIG_ALIASES:
        return _CONFIG_ALIASES[config_type]
    name = config_type.removeprefix("TYPE_")
    if name not in _NUMPY:
        raise ValueError(f"unknown Triton config data type {config_type!r}")
    return name


def numpy_dtype(triton_dtype: str) -> np.dtype[Any]:
    """The numpy dtype that represents ``triton_dtype`` in arrays given to and returned by the SDK."""
    try:
        return _NUMPY[triton_dtype]
    except KeyError:
        raise ValueError(f"unknown Triton dtype {triton_dtype!r}") from None


def triton_dtype_of(dtype: npt.DTypeLike) -> str:
    """The Triton dtype a numpy dtype naturally maps to (``float32`` -> ``"FP32"``, str/bytes/object -> BYTES)."""
    dt = np.dtype(dtype)
    if dt.kind in "OSU":
        return "BYTES"
    for name, candidate in _NUMPY.items():
        if name != "BF16" and candidate == dt.newbyteorder("<"):
            return name
    raise ValueError(f"numpy dtype {dt} has no Triton equivalent")


# --- wire codecs ----------------------------------------------------------------------------------


def encode_bf16(values: npt.NDArray[Any]) -> bytes:
    """float32 array -> bfloat16 wire bytes, rounding to nearest even (NaN stays NaN)."""
    bits = np.ascontiguousarray(values, dtype="<f4").view("<u4")
    # Round to nearest even on the 16 bits that are dropped; NaNs are kept quiet NaNs rather than rounded
    # (rounding could carry a NaN payload into infinity).
    rounded = (bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16)
    nan = np.isnan(values)
    if nan.any():
        rounded = np.where(nan.reshape(rounded.shape), np.uint32(0x7FC0), rounded)
    out: bytes = rounded.astype("<u2").tobytes()
    return out


def decode_bf16(buf: bytes | memoryview, shape: Sequence[int]) -> npt.NDArray[np.float32]:
    """bfloat16 wire bytes -> float32 array (exact)."""
    halves = np.frombuffer(buf, dtype="<u2")
    return (halves.astype("<u4") << np.uint32(16)).view("<f4").reshape(tuple(shape))


def _as_bytes(item: object) -> bytes:
    if isinstance(item, bytes):
        return item
    if isinstance(item, str):
        return item.encode("utf-8")
    if isinstance(item, bytearray | memoryview | np.bytes_):
        return bytes(item)
    raise TypeError(f"BYTES elements must be bytes or str, got {type(item).__name__}")


def encode_bytes(values: npt.NDArray[Any]) -> bytes:
    """Object/str/bytes array -> Triton BYTES wire format (4-byte little-endian length, then the bytes)."""
    parts: list[bytes] = []
    pack = struct.Struct("<I").pack
    for item in values.reshape(-1).tolist():
        b = _as_bytes(item)
        parts.append(pack(len(b)))
        parts.append(b)
    return b"".join(parts)


def decode_bytes(buf: bytes | memoryview, shape: Sequence[int]) -> npt.NDArray[np.object_]:
    """Triton BYTES wire format -> object array of ``bytes`` with ``shape``."""
    data = bytes(buf)
    items: list[bytes] = []
    offset = 0
    unpack = struct.Struct("<I").unpack_from
    while offset < len(data):
        (length,) = unpack(data, offset)
        offset += 4
        items.append(data[offset : offset + length])
        offset += length
    out = np.empty(len(items), dtype=object)
    out[:] = items
    return out.reshape(tuple(shape))


def to_wire(values: npt.NDArray[Any], triton_dtype: str) -> bytes:
    """An array already coerced to ``numpy_dtype(triton_dtype)`` -> raw tensor bytes."""
    if triton_dtype == "BYTES":
        return encode_bytes(values)
    if triton_dtype == "BF16":
        return encode_bf16(values)
    raw: bytes = np.ascontiguousarray(values, dtype=_NUMPY[triton_dtype]).tobytes()
    return raw


def from_wire(buf: bytes | memoryview, triton_dtype: str, shape: Sequence[int]) -> npt.NDArray[Any]:
    """Raw tensor bytes -> numpy array (BYTES: object array of bytes; BF16: float32)."""
    if triton_dtype == "BYTES":
        return decode_bytes(buf, shape)
    if triton_dtype == "BF16":
        return decode_bf16(buf, shape)
    return np.frombuffer(buf, dtype=_NUMPY[triton_dtype]).reshape(tuple(shape))


# --- safe casts -----------------------------------------------------------------------------------


def _refuse(name: str | None, triton_dtype: str, given: str, why: str, model: str | None) -> InputDtypeError:
    label = f"input {name!r}" if name else "value"
    return InputDtypeError(
        f"{label}: expected {triton_dtype}, given {given}: {why}",
        input_name=name,
        model=model,
    )


def _is_python_value(value: object) -> bool:
    return not isinstance(value, np.ndarray | np.generic)


def _bytes_array(value: object, name: str | None, model: str | None) -> npt.NDArray[np.object_]:
    arr = np.asarray(value, dtype=object) if _is_python_value(value) else np.asarray(value)
    if arr.dtype.kind not in "OSU":
        raise _refuse(name, "BYTES", str(arr.dtype), "BYTES takes bytes or str, not numbers", model)
    out = np.empty(arr.shape, dtype=object)
    flat = out.reshape(-1)
    for i, item in enumerate(arr.reshape(-1).tolist()):
        if isinstance(item, bytes):
            flat[i] = item
        elif isinstance(item, str):
            flat[i] = item.encode("utf-8")
        else:
            raise _refuse(name, "BYTES", type(item).__name__, "BYTES elements must be bytes or str", model)
    return out


def coerce(
    value: object,
    triton_dtype: str,
    *,
    allow_lossy: bool = False,
    literal: bool = False,
    name: str | None = None,
    model: str | None = None,
) -> npt.NDArray[Any]:
    """Convert ``value`` to the numpy representation of ``triton_dtype``, by the rules in the module docstring.

    Raises :class:`InputDtypeError` (naming ``name``, the expected and the given dtype) when the cast
    could lose information and ``allow_lossy`` is false. ``literal``: the values are numbers as a file wrote
    them (a Parquet column read as an array), so they follow the rules of Python values, not of numpy arrays.
    """
    if triton_dtype == "BYTES":
        return _bytes_array(value, name, model)
    target = numpy_dtype(triton_dtype)
    python_value = literal or _is_python_value(value)
    try:
        arr = np.asarray(value)
    except (ValueError, TypeError) as err:  # ragged lists
        raise _refuse(name, triton_dtype, type(value).__name__, f"not an array: {err}", model) from err
    src = arr.dtype
    if src.kind in "OSUV":
        raise _refuse(name, triton_dtype, str(src), "only BYTES inputs take bytes, str or objects", model)
    if src == target:
        return arr
    if allow_lossy:
        return arr.astype(target)
    if target.kind == "b":
        if src.kind == "b":
            return arr.astype(target)
        raise _refuse(name, triton_dtype, str(src), "numbers are not cast to BOOL; pass booleans", model)
    if np.can_cast(src, target, casting="safe"):
        return arr.astype(target)
    if src.kind in "biu":
        # Integers (Python or numpy) narrow only when every value survives the round trip exactly.
        if src.kind != "b" and target.kind in "iu":
            info = np.iinfo(target)
            if arr.size and (arr.min() < info.min or arr.max() > info.max):
                raise _refuse(
                    name,
                    triton_dtype,
                    str(src),
                    f"values outside [{info.min}, {info.max}]",
                    model,
                )
            return arr.astype(target)
        with np.errstate(over="ignore"):  # an overflow to inf is caught by the exactness check below
            cast = arr.astype(target)
        if triton_dtype == "BF16":
            exact = np.array_equal(decode_bf16(encode_bf16(cast), cast.shape).astype(np.float64), arr)
        else:
            # Casting back may overflow (2**64 as float does not fit uint64): that is inexact, not an error.
            with np.errstate(invalid="ignore", over="ignore"):
                exact = bool(np.all(np.isfinite(cast))) and bool(np.all(cast.astype(src) == arr))
        if not exact:
            raise _refuse(
                name, triton_dtype, str(src), f"some integers are not exactly representable in {target}", model
            )
        return cast
    if src.kind == "f" and target.kind == "f":
        if python_value:
            # Python floats have no precision of their own to preserve: rounding to the model's float type
            # is what the caller means, but a finite value must not become infinite.
            with np.errstate(over="ignore"):
                cast = arr.astype(target)
            check = decode_bf16(encode_bf16(cast), cast.shape) if triton_dtype == "BF16" else cast
            if np.any(np.isinf(check) & np.isfinite(arr)):
                raise _refuse(name, triton_dtype, "float", f"values overflow {triton_dtype}", model)
            return cast
        raise _refuse(
            name,
            triton_dtype,
            str(src),
            "narrowing a numpy float array loses precision; cast it yourself or pass allow_lossy=True",
            model,
        )
    raise _refuse(name, triton_dtype, str(src), "lossy cast (e.g. float to integer); pass allow_lossy=True", model)
