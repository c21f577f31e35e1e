"""Number formats bit by bit (book/precision.md, "Number formats, bit by bit").

The book's rounding, encoding and decoding are checked bit for bit against ml_dtypes
(bfloat16 and the two float8 formats) and NumPy (float16): every bit pattern of each
16-bit and 8-bit format is decoded; float32 inputs are rounded and encoded, among them a
million random bit patterns and, for each format, every midpoint between neighbouring
numbers of the format (the ties), the float32 numbers on either side of each, the
overflow threshold, the subnormals, signed zeros, infinities and NaNs with payloads.
TF32 has no ml_dtypes type: it is checked against rounding done in float64 and against
its definition as the top 19 bits of a float32.
"""
from __future__ import annotations

import numpy as np
import pytest

from npformer.precision import FORMATS, get_format, round_to

ml_dtypes = pytest.importorskip("ml_dtypes")

NARROW = {  # the formats that have a NumPy dtype to check against
    "bf16": ml_dtypes.bfloat16,
    "fp16": np.float16,
    "fp8_e4m3": ml_dtypes.float8_e4m3fn,
    "fp8_e5m2": ml_dtypes.float8_e5m2,
}
STORAGE = {8: np.uint8, 16: np.uint16}


def random_float32(n: int, seed: int = 0) -> np.ndarray:
    """n float32 numbers with uniformly random bit patterns: every exponent equally likely,
    so subnormals, huge numbers, infinities and NaNs (with payloads) all occur."""
    return np.random.default_rng(seed).integers(0, 2**32, n, dtype=np.uint32).view(np.float32)


def all_values(name: str) -> np.ndarray:
    """Every finite number of a format, in increasing order, as float64."""
    f = FORMATS[name]
    if name in NARROW:
        dt = np.dtype(NARROW[name])
        v = np.arange(2 ** (8 * dt.itemsize), dtype=STORAGE[8 * dt.itemsize]).view(dt)
    else:  # tf32 is the top 19 bits of a float32
        v = (np.arange(2**f.bits, dtype=np.uint32) << np.uint32(32 - f.bits)).view(np.float32)
    with np.errstate(invalid="ignore"):  # signalling NaNs become quiet
        v = v.astype(np.float64)
    v = np.unique(v[np.isfinite(v)])  # -0.0 and 0.0 are one value to np.unique
    return v


def edge_cases(name: str) -> np.ndarray:
    """float32 inputs at every place where rounding to the format can go wrong."""
    f = FORMATS[name]
    v = all_values(name)
    beyond = f.max_finite + 2.0 ** (f.emax - f.mantissa_bits)  # the next number if it had one
    v = np.concatenate([-beyond, v, beyond], axis=None)
    mid = ((v[:-1] + v[1:]) / 2).astype(np.float32)  # exact: one more bit than the format
    assert np.all(mid.astype(np.float64) == (v[:-1] + v[1:]) / 2)
    up = np.nextafter(mid, np.float32(np.inf))
    down = np.nextafter(mid, np.float32(-np.inf))
    specials = np.array([0x00000000, 0x80000000, 0x7F800000, 0xFF800000,  # zeros, inf
                         0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001,  # NaNs
                         0x7FA00000, 0x7FFFFFFF, 0xFFFFFFFF, 0x7F812345,
                         0x00000001, 0x80000001, 0x007FFFFF, 0x00800000,  # f32 subnormals
                         0x00400000, 0x00008000, 0x00010000, 0x00018000,
                         0x7F7FFFFF, 0xFF7FFFFF], dtype=np.uint32).view(np.float32)
    return np.concatenate([mid, up, down, v[1:-1].astype(np.float32), specials])


def inputs(name: str) -> np.ndarray:
    return np.concatenate([edge_cases(name), random_float32(10**6, seed=1)])


def reference_round(x: np.ndarray, name: str) -> np.ndarray:
    """Round to nearest, ties to even, done in float64 arithmetic rather than on bits:
    the float64 value over the format's spacing at x, rounded by np.round (which rounds
    halves to even), times the spacing; beyond the largest finite number, inf (E4M3: NaN)."""
    f = FORMATS[name]
    with np.errstate(invalid="ignore"):  # signalling NaNs become quiet
        x64 = x.astype(np.float64)
    finite = np.isfinite(x64)
    _, e = np.frexp(np.where(finite & (x64 != 0), x64, 1.0))  # |x| in [2^(e-1), 2^e)
    spacing = np.ldexp(1.0, np.maximum(e - 1, f.emin) - f.mantissa_bits)
    r = np.round(np.where(finite, x64, 0.0) / spacing) * spacing  # exact in float64
    r = np.where(finite, r, x64)
    over = np.abs(r) > f.max_finite
    r = np.where(over, np.copysign(np.nan if f.finite_only else np.inf, x64), r)
    return r


def same_or_both_nan(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal bit patterns, except that a NaN may match any NaN of the same sign."""
    nan = np.isnan(a)
    same_sign = np.signbit(a) == np.signbit(b)
    return bool(np.all(np.where(nan, np.isnan(b) & same_sign,
                                a.view(np.uint32) == b.view(np.uint32))))


@pytest.mark.parametrize("name", list(NARROW))
def test_round_to_matches_the_library_cast_bit_for_bit(name):
    x = inputs(name)
    with np.errstate(over="ignore", invalid="ignore"):
        ref = x.astype(NARROW[name]).astype(np.float32)
    y = round_to(x, name)
    assert y.dtype == np.float32 and y.shape == x.shape
    nan = np.isnan(ref)
    assert np.array_equal(np.isnan(y), nan)
    assert np.array_equal(y.view(np.uint32)[~nan], ref.view(np.uint32)[~nan])
    # a NaN comes back as float32's quiet NaN with the input's sign, its payload dropped:
    # ml_dtypes does the same for bfloat16 and float8; NumPy's float16 keeps a payload
    assert np.all(y.view(np.uint32)[nan] & np.uint32(0x7FFFFFFF) == 0x7FC00000)
    assert np.array_equal(np.signbit(y[nan]), np.signbit(x[nan]))
    if name != "fp16":
        assert np.array_equal(y.view(np.uint32), ref.view(np.uint32))


@pytest.mark.parametrize("name", [n for n in FORMATS if n != "fp32"])
def test_round_to_matches_rounding_in_float64(name):
    x = inputs(name)
    assert same_or_both_nan(round_to(x, name), reference_round(x, name).astype(np.float32))


def test_round_to_fp32_is_the_identity():
    x = random_float32(10**5, seed=2)
    assert np.array_equal(round_to(x, "fp32").view(np.uint32), x.view(np.uint32))


def test_tf32_is_the_top_19_bits_of_float32_rounded():
    y = round_to(inputs("tf32"), "tf32").view(np.uint32)
    finite = (y & np.uint32(0x7F800000)) != 0x7F800000
    assert np.all(y[finite] & np.uint32(0x1FFF) == 0)  # the 13 low bits are zero


def test_round_to_keeps_shape_and_refuses_other_dtypes():
    x = np.linspace(-3, 3, 24, dtype=np.float32).reshape(2, 3, 4)
    assert round_to(x, "bf16").shape == (2, 3, 4)
    with pytest.raises(ValueError, match="x: expected dtype float32"):
        round_to(x.astype(np.float64), "bf16")
    with pytest.raises(ValueError, match="fmt: expected a Format or one of"):
        round_to(x, "bf17")
    assert get_format(FORMATS["fp16"]) is FORMATS["fp16"]
