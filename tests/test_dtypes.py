"""Triton dtype names, wire codecs and the safe-cast rules (pure, Hypothesis)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from triton_npu_client import InputDtypeError
from triton_npu_client._wire._dtypes import (
    TRITON_DTYPES,
    coerce,
    config_to_triton,
    decode_bf16,
    encode_bf16,
    from_wire,
    numpy_dtype,
    to_wire,
    triton_dtype_of,
)

INT_TYPES = ["INT8", "INT16", "INT32", "INT64", "UINT8", "UINT16", "UINT32", "UINT64"]


def test_config_names_map_to_triton_names() -> None:
    """TYPE_* config enums map to Triton dtype strings, TYPE_STRING to BYTES."""
    assert config_to_triton("TYPE_FP32") == "FP32"
    assert config_to_triton("TYPE_STRING") == "BYTES"
    assert config_to_triton("TYPE_BF16") == "BF16"
    assert [config_to_triton(f"TYPE_{t}") for t in TRITON_DTYPES if t != "BYTES"] == [
        t for t in TRITON_DTYPES if t != "BYTES"
    ]
    with pytest.raises(ValueError, match="TYPE_NOPE"):
        config_to_triton("TYPE_NOPE")


def test_numpy_names_map_back() -> None:
    """Every non-BF16 Triton dtype round-trips through its numpy dtype; str/bytes arrays are BYTES."""
    for t in TRITON_DTYPES:
        if t not in ("BF16", "BYTES"):
            assert triton_dtype_of(numpy_dtype(t)) == t
    assert triton_dtype_of(np.dtype("U3")) == "BYTES"
    assert triton_dtype_of(np.dtype(object)) == "BYTES"


@given(hnp.arrays(np.float32, hnp.array_shapes(max_dims=3, max_side=5), elements=st.floats(width=32)))
def test_bf16_roundtrip_is_within_bf16_precision(x: np.ndarray) -> None:
    """BF16 encode/decode keeps shape, NaN and infinities, and is within bf16 rounding (2^-8 relative)."""
    y = decode_bf16(encode_bf16(x), x.shape)
    assert y.shape == x.shape
    assert y.dtype == np.float32
    np.testing.assert_array_equal(np.isnan(y), np.isnan(x))
    finite = np.isfinite(x) & np.isfinite(y)
    np.testing.assert_allclose(y[finite], x[finite], rtol=2.0**-8, atol=1e-38)
    # bf16 values are fixed points of the codec
    np.testing.assert_array_equal(decode_bf16(encode_bf16(y), y.shape), y)


@given(st.lists(st.one_of(st.binary(max_size=20), st.text(max_size=10)), min_size=1, max_size=12))
def test_bytes_roundtrip_keeps_nul_and_non_ascii(items: list[bytes | str]) -> None:
    """BYTES coerce + wire encode/decode gives back the bytes (str as UTF-8), NUL bytes included."""
    arr = coerce(items, "BYTES")
    back = from_wire(to_wire(arr, "BYTES"), "BYTES", arr.shape)
    expected = [i.encode() if isinstance(i, str) else i for i in items]
    assert back.tolist() == expected


@pytest.mark.parametrize("t", [t for t in TRITON_DTYPES if t not in ("BYTES", "BF16")])
def test_fixed_width_wire_roundtrip(t: str) -> None:
    """Fixed-width dtypes are the raw little-endian array bytes both ways."""
    x = np.arange(6).reshape(2, 3).astype(numpy_dtype(t))
    y = from_wire(to_wire(x, t), t, (2, 3))
    np.testing.assert_array_equal(y, x)
    assert y.dtype == numpy_dtype(t)


@given(st.sampled_from(INT_TYPES), st.sampled_from(INT_TYPES), st.data())
def test_int_narrowing_is_value_checked(src: str, dst: str, data: st.DataObject) -> None:
    """An integer array casts to another integer type exactly when every value fits, else InputDtypeError."""
    sinfo = np.iinfo(numpy_dtype(src))
    values = data.draw(st.lists(st.integers(int(sinfo.min), int(sinfo.max)), min_size=1, max_size=8))
    arr = np.array(values, dtype=numpy_dtype(src))
    dinfo = np.iinfo(numpy_dtype(dst))
    fits = all(dinfo.min <= v <= dinfo.max for v in values)
    if fits:
        assert coerce(arr, dst).tolist() == values
    else:
        with pytest.raises(InputDtypeError, match=rf"'x': expected {dst}, given {arr.dtype}"):
            coerce(arr, dst, name="x")


@given(st.lists(st.integers(-(2**40), 2**40), min_size=1, max_size=8), st.sampled_from(["FP16", "FP32", "FP64"]))
def test_int_to_float_only_when_exact(values: list[int], dst: str) -> None:
    """Python ints go into float inputs only when each converts exactly."""
    with np.errstate(over="ignore"):
        exact = all(float(numpy_dtype(dst).type(v)) == v for v in values)
    if exact:
        assert coerce(values, dst).tolist() == [float(v) for v in values]
    else:
        with pytest.raises(InputDtypeError):
            coerce(values, dst)


@given(st.sampled_from(INT_TYPES))
def test_float_to_int_refused_unless_lossy(dst: str) -> None:
    """float -> integer is refused (even 1.0), and allowed with allow_lossy=True."""
    with pytest.raises(InputDtypeError, match=f"expected {dst}, given float64"):
        coerce(np.array([1.0, 2.0]), dst, name="a")
    with pytest.raises(InputDtypeError):
        coerce([1.5], dst)
    assert coerce(np.array([1.0, 2.0]), dst, allow_lossy=True).tolist() == [1, 2]


@given(st.lists(st.floats(allow_nan=False, allow_infinity=False, width=64), min_size=1, max_size=8))
def test_python_floats_to_fp32_by_range(values: list[float]) -> None:
    """Python floats round into FP32 unless a finite value would overflow; numpy float64 arrays are refused."""
    overflow = any(abs(v) > float(np.finfo(np.float32).max) for v in values)
    if overflow:
        with pytest.raises(InputDtypeError, match="overflow"):
            coerce(values, "FP32")
    else:
        assert coerce(values, "FP32").dtype == np.float32
    with pytest.raises(InputDtypeError, match="allow_lossy"):
        coerce(np.array(values), "FP32")


def test_bool_and_bytes_rules() -> None:
    """Numbers never become BOOL or BYTES; strings never become numbers; bools widen into numbers."""
    with pytest.raises(InputDtypeError):
        coerce([0, 1], "BOOL")
    with pytest.raises(InputDtypeError):
        coerce([1, 2], "BYTES")
    with pytest.raises(InputDtypeError):
        coerce(["1"], "INT32")
    assert coerce([True, False], "BOOL").tolist() == [True, False]
    assert coerce([True, False], "INT8").tolist() == [1, 0]
    assert coerce(np.float16([1.5]), "FP32").dtype == np.float32
