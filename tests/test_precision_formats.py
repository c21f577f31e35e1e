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

from npformer.precision import (
    FORMATS,
    decode,
    encode,
    get_format,
    round_bits,
    round_to,
    stochastic_round,
)

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


@pytest.mark.parametrize("rounding", [round_to, round_bits])
@pytest.mark.parametrize("name", list(NARROW))
def test_rounding_matches_the_library_cast_bit_for_bit(name, rounding):
    x = inputs(name)
    with np.errstate(over="ignore", invalid="ignore"):
        ref = x.astype(NARROW[name]).astype(np.float32)
    y = rounding(x, name)
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
def test_rounding_matches_rounding_in_float64(name):
    x = inputs(name)
    ref = reference_round(x, name).astype(np.float32)
    assert same_or_both_nan(round_to(x, name), ref)
    assert same_or_both_nan(round_bits(x, name), ref)


@pytest.mark.parametrize("name", [n for n in FORMATS if n != "fp32"])
def test_round_to_and_round_bits_agree_to_the_bit(name):
    x = inputs(name)
    assert np.array_equal(round_to(x, name).view(np.uint32), round_bits(x, name).view(np.uint32))


def test_rounding_to_fp32_is_the_identity():
    x = random_float32(10**5, seed=2)
    assert np.array_equal(round_to(x, "fp32").view(np.uint32), x.view(np.uint32))
    assert np.array_equal(round_bits(x, "fp32").view(np.uint32), x.view(np.uint32))


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


@pytest.mark.parametrize("name", list(NARROW))
def test_decode_every_bit_pattern_as_the_library_does(name):
    form = FORMATS[name]
    pattern = np.arange(2**form.bits, dtype=form.storage)
    assert pattern.size == {8: 256, 16: 65536}[form.bits]
    ours = decode(pattern, name)
    with np.errstate(invalid="ignore"):
        theirs = pattern.view(NARROW[name]).astype(np.float64)
    nan = np.isnan(theirs)
    assert np.array_equal(np.isnan(ours), nan)
    assert np.array_equal(ours[~nan], theirs[~nan])
    assert np.array_equal(np.signbit(ours[~nan]), np.signbit(theirs[~nan]))  # -0.0 too


def test_decode_tf32_and_fp32_as_the_float32_they_are_the_top_bits_of():
    tf32 = np.arange(2**19, dtype=np.uint32)  # every TF32 pattern
    for pattern, shift, name in ((tf32, 13, "tf32"),
                                 (random_float32(10**6, 3).view(np.uint32), 0, "fp32")):
        with np.errstate(invalid="ignore"):
            theirs = (pattern << np.uint32(shift)).view(np.float32).astype(np.float64)
        ours = decode(pattern, name)
        nan = np.isnan(theirs)
        assert np.array_equal(np.isnan(ours), nan)
        assert np.array_equal(ours[~nan], theirs[~nan])
        assert np.array_equal(np.signbit(ours[~nan]), np.signbit(theirs[~nan]))


@pytest.mark.parametrize("name", list(NARROW))
def test_encode_gives_the_library_bits(name):
    x = inputs(name)
    with np.errstate(over="ignore", invalid="ignore"):
        theirs = x.astype(NARROW[name]).view(FORMATS[name].storage)
    ours = encode(x, name)
    assert ours.dtype == FORMATS[name].storage
    if name == "fp16":  # NumPy keeps a NaN's payload; encode gives the quiet NaN, same sign
        nan = np.isnan(x)
        assert np.array_equal(ours[~nan], theirs[~nan])
        assert np.all(ours[nan] & np.uint16(0x7FFF) == 0x7E00)
        assert np.array_equal(ours[nan] >> np.uint16(15), theirs[nan] >> np.uint16(15))
    else:
        assert np.array_equal(ours, theirs)


@pytest.mark.parametrize("name", [n for n in FORMATS])
def test_decode_of_encode_is_round_to(name):
    x = inputs(name) if name != "fp32" else random_float32(10**6, 4)
    y = decode(encode(x, name), name)
    assert same_or_both_nan(y.astype(np.float32), round_to(x, name))
    if name == "fp32":
        assert np.array_equal(encode(x, name), x.view(np.uint32))


def test_tf32_encode_is_the_top_19_bits_of_round_to():
    x = inputs("tf32")
    ours = encode(x, "tf32")
    y = round_to(x, "tf32").view(np.uint32)
    assert ours.dtype == np.uint32 and np.all(ours < 2**19)
    finite = ~np.isnan(round_to(x, "tf32"))
    assert np.array_equal(ours[finite], y[finite] >> np.uint32(13))


def test_format_facts():
    facts = {name: (f.bits, f.bias, f.machine_eps, f.min_subnormal, f.min_normal,
                    f.max_finite) for name, f in FORMATS.items()}
    assert facts["fp8_e4m3"] == (8, 7, 2**-3, 2**-9, 2**-6, 448.0)
    assert facts["fp8_e5m2"] == (8, 15, 2**-2, 2**-16, 2**-14, 57344.0)
    assert facts["fp16"] == (16, 15, 2**-10, 2**-24, 2**-14, 65504.0)
    assert facts["tf32"][:5] == (19, 127, 2**-10, 2**-136, 2**-126)
    for name, dt in (("bf16", ml_dtypes.bfloat16), ("fp32", np.float32)):
        info = ml_dtypes.finfo(dt)
        assert facts[name][2:] == (float(info.eps), float(info.smallest_subnormal),
                                   float(info.smallest_normal), float(info.max))


# Stochastic rounding: unbiased, proved by running every value of the random bits.

def enumerate_sr(x: np.ndarray, name: str, c: int):
    """stochastic_round of each x with every one of the 2^c values of xi (the top c of
    the 32 random bits): (results (len(x), 2^c), float32)."""
    xi = np.arange(2**c, dtype=np.uint32) << np.uint32(32 - c)
    X = np.repeat(x[:, None], 2**c, axis=1)
    return stochastic_round(X, name, np.broadcast_to(xi, X.shape).copy())


@pytest.mark.parametrize("name, c, scale", [
    ("bf16", 16, 1.0), ("bf16", 16, 1e-39), ("bf16", 16, 1e38),  # normal, subnormal, top
    ("tf32", 13, 1.0),
    ("fp16", 13, 1.0), ("fp16", 18, 2.0**-19),  # 5 binades below fp16's x_min
    ("fp8_e5m2", 21, 1.0), ("fp8_e4m3", 20, 1.0), ("fp8_e4m3", 20, 100.0)])
def test_stochastic_rounding_is_unbiased_exactly(name, c, scale):
    rng = np.random.default_rng(5)
    x = (scale * rng.uniform(1, 2, 8) * rng.choice([-1, 1], 8)).astype(np.float32)
    form = FORMATS[name]
    E = np.maximum(np.floor(np.log2(np.abs(x.astype(np.float64)))), -126)  # float32's
    assert np.all(23 - form.mantissa_bits + np.maximum(form.emin - E, 0) == c)  # c bits cut
    y = enumerate_sr(x, name, c).astype(np.float64)
    assert np.array_equal(y.mean(axis=1), x.astype(np.float64))  # exact: E[sr(x)] = x
    down = np.where(np.abs(y) <= np.abs(x[:, None]), 1, 0)  # a: toward zero
    lo, hi = np.min(np.abs(y), axis=1), np.max(np.abs(y), axis=1)
    assert np.all(np.abs(x) >= lo) and np.all(np.abs(x) <= hi)
    p_up = 1 - down.mean(axis=1)
    fraction = (np.abs(x.astype(np.float64)) - lo) / np.where(hi > lo, hi - lo, 1)
    assert np.array_equal(p_up, fraction)  # P(up) = (x - a) / (b - a)
    both = round_to(x, name)  # the nearest is one of the two neighbours
    assert np.all((np.abs(both) == lo) | (np.abs(both) == hi))


def test_stochastic_round_of_representable_numbers_is_exact():
    x = round_to(random_float32(10**5, 6), "fp16")
    bits = np.random.default_rng(7).integers(0, 2**32, x.shape, dtype=np.uint32)
    assert same_or_both_nan(stochastic_round(x, "fp16", bits), x)


def test_stochastic_round_takes_a_generator_and_checks_its_bits():
    x = np.full((3, 4), 1 + 2**-9, dtype=np.float32)
    y = stochastic_round(x, "bf16", np.random.default_rng(0))
    assert y.shape == (3, 4) and set(np.unique(y)) <= {1.0, 1 + 2**-7}
    with pytest.raises(ValueError, match="bits: expected shape"):
        stochastic_round(x, "bf16", np.zeros(5, np.uint32))
    with pytest.raises(ValueError, match="bits: expected dtype uint32"):
        stochastic_round(x, "bf16", np.zeros((3, 4), np.int64))


@pytest.mark.parametrize("name", list(FORMATS))
def test_the_functions_run_on_a_device_array_with_no_host_read(name):
    from npformer.strict import Strict, register, strict

    register()

    x = np.concatenate([edge_cases("fp8_e4m3"), random_float32(1000, 8)])
    bits = np.random.default_rng(9).integers(0, 2**32, x.shape, dtype=np.uint32)
    Strict.reset()
    y = round_to(strict(x), name)
    b = round_bits(strict(x), name)
    p = encode(strict(x), name)
    v = decode(p, name)
    s = stochastic_round(strict(x), name, strict(bits))
    assert Strict.reads == 0
    assert all(isinstance(a, Strict) for a in (y, b, p, v, s))
    assert np.array_equal(b.a.view(np.uint32), round_to(x, name).view(np.uint32))
    assert np.array_equal(y.a.view(np.uint32), round_to(x, name).view(np.uint32))
    assert np.array_equal(p.a, encode(x, name))
    assert np.array_equal(s.a.view(np.uint32), stochastic_round(x, name, bits).view(np.uint32))
