"""Row codecs: round-trip error within the documented bounds, exact byte layouts, bad input rejected."""

from __future__ import annotations

import struct
from fractions import Fraction

import hypothesis.extra.numpy as hnp
import numpy as np
import pytest
import torch
from codec_bounds import error_bound
from hypothesis import given, settings
from hypothesis import strategies as st

from tiergram.codecs import CODECS, FP8_E4M3FN_VALUES, Fp8E4m3Codec, Int8Codec, get_codec

FLT_MAX = float(np.finfo(np.float32).max)
BF16_MAX = 3.3895313892515355e38  # largest finite bfloat16
FP8_TOP = 1.875 * 2.0**127  # largest fp8 value · scale that float32 holds; above ~1.9375·2^127 rounds to inf

fp32, bf16, int8, fp8 = (CODECS[n] for n in ("fp32", "bf16", "int8", "fp8_e4m3"))


# --- strategies ------------------------------------------------------------------------------------

SPECIALS = [0.0, -0.0, 1e-45, -1e-45, 3e-42, 1e-40, 1.1754944e-38, 1e-30, 1.0, -1.0, 448.0, 449.0,
            1e30, -1e30, 3e38, -3e38]


def element_strategy(max_abs: float) -> st.SearchStrategy[float]:
    """Floats mixing every scale: anything in range, specials, mantissa·10^k across 75 decades."""
    return st.one_of(
        st.floats(-max_abs, max_abs, allow_nan=False, allow_infinity=False),
        st.sampled_from([v for v in SPECIALS if abs(v) <= max_abs]),
        st.builds(lambda m, k: m * 10.0**k, st.floats(-1.0, 1.0), st.integers(-45, 30)),
        st.floats(-1e-37, 1e-37),  # float32 subnormals and the bottom of the normal range
    )


def value_arrays(max_abs: float, dims: list[int]) -> st.SearchStrategy[np.ndarray]:
    """[N, D] arrays of float32 or float64 values drawn from `element_strategy`."""
    shapes = st.tuples(st.integers(1, 4), st.sampled_from(dims))
    return st.tuples(shapes, st.sampled_from([np.float32, np.float64])).flatmap(
        lambda sd: hnp.arrays(sd[1], sd[0], elements=element_strategy(max_abs)))


def block_scaled_arrays() -> st.SearchStrategy[np.ndarray]:
    """[N, 64] arrays whose 32-value blocks have independent scales, so blocks really differ."""
    def build(base: np.ndarray, exps: list[int]) -> np.ndarray:
        return base * np.repeat(np.exp2(np.array(exps, np.float64)), 32).reshape(base.shape)
    return st.integers(1, 3).flatmap(lambda n: st.builds(
        build,
        hnp.arrays(np.float64, (n, 64), elements=st.floats(-1.0, 1.0)),
        st.lists(st.integers(-140, 120), min_size=2 * n, max_size=2 * n)))


def assert_round_trip(codec, x: np.ndarray) -> None:
    rows = codec.encode(x)
    assert rows.dtype == np.uint8 and rows.shape == (x.shape[0], codec.row_bytes(x.shape[1]))
    got = codec.decode(rows, x.shape[1]).numpy().astype(np.float64)
    err = np.abs(got - x.astype(np.float64))
    bound = error_bound(codec, x)
    assert np.all(err <= bound), f"worst error/bound ratio {np.max(err / bound)}"


# --- registry and geometry -------------------------------------------------------------------------


def test_registry_ids_and_lookup():
    assert {n: c.codec_id for n, c in CODECS.items()} == {"fp32": 0, "bf16": 1, "int8": 2, "fp8_e4m3": 3}
    assert get_codec("fp8_e4m3") is fp8
    with pytest.raises(ValueError, match="fp32, bf16, int8, fp8_e4m3"):
        get_codec("fp4")


def test_row_bytes():
    assert [fp32.row_bytes(256), bf16.row_bytes(256), int8.row_bytes(256), fp8.row_bytes(256)] == [
        1024, 512, 260, 264]  # 264: DeepSeek-V4.1-Flash's row
    assert int8.row_bytes(3) == 7 and fp8.row_bytes(32) == 33


@pytest.mark.parametrize("codec", list(CODECS.values()), ids=list(CODECS))
@pytest.mark.parametrize("dim", [0, -32, 2.5, True, "64"])
def test_invalid_dims_rejected(codec, dim):
    with pytest.raises(ValueError, match="dim"):
        codec.row_bytes(dim)


@pytest.mark.parametrize("dim", [1, 16, 48, 100])
def test_fp8_needs_multiple_of_32(dim):
    with pytest.raises(ValueError, match="multiple of 32"):
        fp8.row_bytes(dim)
    with pytest.raises(ValueError, match="multiple of 32"):
        fp8.encode(np.ones((2, dim)))


# --- round trips -----------------------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(x=value_arrays(FLT_MAX, [1, 5, 32, 64]))
def test_fp32_round_trip(x):
    assert_round_trip(fp32, x)
    if x.dtype == np.float32:  # float32 input is stored exactly
        assert np.array_equal(fp32.decode(fp32.encode(x), x.shape[1]).numpy(), x)


@settings(max_examples=100, deadline=None)
@given(x=value_arrays(BF16_MAX, [1, 5, 32, 64]))
def test_bf16_round_trip(x):
    assert_round_trip(bf16, x)


@settings(max_examples=100, deadline=None)
@given(x=value_arrays(FLT_MAX, [1, 5, 32, 64]))
def test_int8_round_trip(x):
    assert_round_trip(int8, x)


@settings(max_examples=100, deadline=None)
@given(x=value_arrays(FP8_TOP, [32, 64, 256]))
def test_fp8_round_trip(x):
    assert_round_trip(fp8, x)


@settings(max_examples=100, deadline=None)
@given(x=block_scaled_arrays())
def test_mixed_scale_blocks_round_trip(x):
    for codec in (fp32, bf16, int8, fp8):
        assert_round_trip(codec, x)
    # fp8's per-block scales follow each block: a tiny block next to a huge one keeps its precision
    e = fp8.encode(x)[:, 64:].astype(int)
    assert np.array_equal(e, Fp8E4m3Codec.scale_exponents(x.astype(np.float32)))


def test_error_bound_is_not_vacuous():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 256))
    amax = np.abs(x).max()
    assert error_bound(fp32, x).max() < 1e-6 * amax
    assert error_bound(bf16, x).max() < 2**-7 * amax
    assert error_bound(int8, x).max() < amax / 250
    assert error_bound(fp8, x).max() < amax / 14


@pytest.mark.parametrize("codec", list(CODECS.values()), ids=list(CODECS))
def test_decode_to_bf16_is_fp32_then_cast(codec):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((8, 64)) * np.exp2(rng.integers(-30, 30, (8, 1)))
    rows = codec.encode(x)
    as_bf16 = codec.decode(rows, 64, dtype=torch.bfloat16)
    assert as_bf16.dtype == torch.bfloat16
    assert torch.equal(as_bf16, codec.decode(rows, 64).to(torch.bfloat16))


@pytest.mark.parametrize("codec", list(CODECS.values()), ids=list(CODECS))
def test_torch_and_numpy_inputs_agree(codec):
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(2))
    assert np.array_equal(codec.encode(x), codec.encode(x.numpy()))
    xb = x.to(torch.bfloat16)  # bf16 tensors widen exactly
    assert np.array_equal(codec.encode(xb), codec.encode(xb.float().numpy()))
    rows = codec.encode(x)
    assert torch.equal(codec.decode(torch.from_numpy(rows), 64), codec.decode(rows, 64))


@pytest.mark.parametrize("codec", list(CODECS.values()), ids=list(CODECS))
def test_empty_and_zero_rows(codec):
    assert codec.encode(np.zeros((0, 64))).shape == (0, codec.row_bytes(64))
    assert codec.decode(np.zeros((0, codec.row_bytes(64)), np.uint8), 64).shape == (0, 64)
    zeros = codec.decode(codec.encode(np.zeros((2, 64))), 64)
    assert torch.equal(zeros, torch.zeros(2, 64))


# --- exact byte layouts ----------------------------------------------------------------------------


def test_fp32_layout():
    rows = fp32.encode(np.array([[1.0, -2.5]]))
    assert rows.tobytes() == struct.pack("<2f", 1.0, -2.5)


def test_bf16_layout_and_ties_to_even():
    one_plus_half_ulp = struct.unpack("<f", struct.pack("<I", 0x3F808000))[0]  # tie -> 0x3F80 (even)
    three_halves_ulp = struct.unpack("<f", struct.pack("<I", 0x3F818000))[0]  # tie -> 0x3F82 (even)
    just_above_tie = struct.unpack("<f", struct.pack("<I", 0x3F808001))[0]  # -> 0x3F81
    rows = bf16.encode(np.array([[1.0, -2.0, one_plus_half_ulp, three_halves_ulp, just_above_tie]],
                                np.float32))
    assert rows.tobytes() == struct.pack("<5H", 0x3F80, 0xC000, 0x3F80, 0x3F82, 0x3F81)


def test_bf16_rounding_matches_torch():
    rng = np.random.default_rng(3)
    bits = rng.integers(0, 2**32, 20000, dtype=np.uint64).astype(np.uint32)
    x = bits.view(np.float32)
    x = x[np.isfinite(x) & (np.abs(x) <= BF16_MAX)].reshape(1, -1)
    ours = bf16.encode(x).view("<u2")
    theirs = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(ours, theirs)


def test_int8_layout_hand_computed():
    # amax 127 -> s = 1.0; -63.5 rounds half to even -> -64 (0xC0); 0.4 -> 0; 1.6 -> 2
    rows = int8.encode(np.array([[127.0, -63.5, 0.4, 1.6]]))
    assert rows.tobytes() == bytes([0x7F, 0xC0, 0x00, 0x02]) + struct.pack("<f", 1.0)
    # amax 2.54 -> s = float32(2.54/127) = float32(0.02); the scale sits in the last 4 bytes
    # and 0.013/0.02 = 0.65 -> 1, 0.047/0.02 = 2.35 -> 2
    rows = int8.encode(np.array([[-2.54, 0.013, 0.047]], np.float32))
    assert rows[0, 3:].tobytes() == struct.pack("<f", np.float32(2.54) / np.float32(127))
    assert list(rows[0, :3].view(np.int8)) == [-127, 1, 2]


def test_int8_decode_is_one_float32_multiply():
    rng = np.random.default_rng(4)
    rows = rng.integers(0, 256, (16, 36), dtype=np.uint8)
    rows[:, 32:] = np.frombuffer(np.float32(rng.standard_normal(16)).tobytes(), np.uint8).reshape(16, 4)
    q = rows[:, :32].view(np.int8).astype(np.float32)
    s = rows[:, 32:].copy().view("<f4")
    assert np.array_equal(int8.decode(rows, 32).numpy(), q * s)


def test_int8_subnormal_rows_exact():
    x = np.array([[1e-45, -3e-45, 0.0, 5e-44]], np.float32)  # multiples of 2^-149: exact with s = 2^-149
    assert np.array_equal(int8.decode(int8.encode(x), 4).numpy(), x)
    assert Int8Codec.scales(x)[0] == np.float32(2.0**-149)


def test_fp8_layout_block_of_ones():
    # amax 1: e = ceil(log2(1/448)) + 127 = ceil(-8.807) + 127 = 119 (0x77), scale 2^-8,
    # so q = 1 · 2^8 = 256 = 2^8 -> e4m3 exponent field 8 + 7 = 15, mantissa 0 -> 0b0_1111_000 = 0x78
    rows = fp8.encode(np.ones((1, 256)))
    assert rows.shape == (1, 264)
    assert np.all(rows[0, :256] == 0x78) and np.all(rows[0, 256:] == 0x77)
    assert torch.equal(fp8.decode(rows, 256), torch.ones(1, 256))


def test_fp8_layout_scales_at_the_end():
    # block 0 holds 448 -> e = 127 (scale 1): 448 -> 0x7E, 1.0 -> 0x38 (exponent 7, mantissa 0),
    # -0.5 -> 0xB0; block 1 is 2^-20 everywhere -> e = ceil(-20 - log2 448) + 127 = -28 + 127 = 99
    x = np.zeros((1, 64))
    x[0, 0], x[0, 1], x[0, 2] = 448.0, 1.0, -0.5
    x[0, 32:] = 2.0**-20
    rows = fp8.encode(x)
    assert rows.shape == (1, 66)
    assert list(rows[0, :4]) == [0x7E, 0x38, 0xB0, 0x00]
    assert list(rows[0, 64:]) == [127, 99]
    # 2^-20 / 2^-28 = 256 -> 0x78
    assert np.all(rows[0, 32:64] == 0x78)
    assert torch.equal(fp8.decode(rows, 64), torch.from_numpy(x.astype(np.float32)))


def test_fp8_zero_block_gets_scale_byte_zero():
    rows = fp8.encode(np.zeros((1, 32)))
    assert list(rows[0]) == [0] * 33


def test_fp8_scale_exponent_is_exact_ceil():
    # around every power-of-two multiple of 448 (where a rounded log2 would slip), and at the extremes
    amaxes = [float(np.float32(1e-45)), 1e-38, 1.0, FLT_MAX]
    for k in range(-140, 119, 7):
        edge = np.float32(448.0 * 2.0**k)
        amaxes += [float(np.nextafter(edge, np.float32(0))), float(edge), float(np.nextafter(edge, np.inf))]
    x = np.zeros((len(amaxes), 32), np.float32)
    x[:, 5] = amaxes
    got = Fp8E4m3Codec.scale_exponents(x)[:, 0].astype(int)
    for a, e in zip(amaxes, got, strict=True):
        # the smallest t with amax <= 448·2^t, in exact rational arithmetic, clamped to e in [0, 254]
        t = -200
        while Fraction(a) > 448 * Fraction(2) ** t:
            t += 1
        assert e == min(max(t + 127, 0), 254), a


def _e4m3_rne_oracle(y: np.ndarray) -> np.ndarray:
    """uint8 e4m3fn codes of |y| <= 448 rounded to nearest, ties to the even code (numpy only)."""
    pos = FP8_E4M3FN_VALUES[:0x7F].astype(np.float64)  # codes 0x00..0x7E, increasing
    a = np.abs(y.astype(np.float64))
    hi = np.clip(np.searchsorted(pos, a), 1, 126)
    lo = hi - 1
    d_lo, d_hi = a - pos[lo], pos[hi] - a
    code = np.where(d_lo < d_hi, lo, np.where(d_hi < d_lo, hi, np.where(lo % 2 == 0, lo, hi)))
    code = np.where(a == pos[hi], hi, code)
    return (code | np.where(np.signbit(y), 0x80, 0)).astype(np.uint8)


def test_fp8_rounding_is_nearest_even():
    # blocks with amax 448 have scale 1, so q is exactly the e4m3 rounding of x; cover every
    # representable value, every midpoint (the ties), and random values in between
    pos = FP8_E4M3FN_VALUES[:0x7F].astype(np.float64)
    mids = (pos[1:] + pos[:-1]) / 2
    rng = np.random.default_rng(5)
    vals = np.concatenate([pos, mids, np.nextafter(mids, 0), np.nextafter(mids, 1000),
                           rng.uniform(-448, 448, 4000)]).astype(np.float32)
    vals = np.concatenate([vals, -vals])
    vals = np.concatenate([vals, np.zeros(-len(vals) % 31, np.float32)]).reshape(-1, 31)
    x = np.concatenate([np.full((len(vals), 1), 448.0, np.float32), vals], axis=1)
    rows = fp8.encode(x)
    assert np.all(rows[:, 32] == 127)
    assert np.array_equal(rows[:, :32], _e4m3_rne_oracle(x))


def test_fp8_decode_special_bytes():
    rows = np.zeros((1, 33), np.uint8)
    rows[0, :4] = [0x7F, 0xFF, 0x01, 0x81]  # NaN, NaN, smallest subnormal 2^-9, its negative
    rows[0, 32] = 0  # scale 2^-127, a float32 subnormal: 2^-9 · 2^-127 = 2^-136 is still exact
    got = fp8.decode(rows, 32).numpy()
    assert np.isnan(got[0, 0]) and np.isnan(got[0, 1])
    assert got[0, 2] == np.float32(2.0**-136) and got[0, 3] == -np.float32(2.0**-136)
    rows[0, 32] = 255  # ue8m0 NaN
    assert np.isnan(fp8.decode(rows, 32).numpy()).all()


# --- bad input -------------------------------------------------------------------------------------


@pytest.mark.parametrize("codec", list(CODECS.values()), ids=list(CODECS))
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nonfinite_input_names_the_row(codec, bad):
    x = np.ones((5, 64))
    x[3, 7] = bad
    with pytest.raises(ValueError, match="row 3"):
        codec.encode(x)
    with pytest.raises(ValueError, match="row 2"):
        codec.encode(torch.tensor(np.where(np.arange(5)[:, None] == 2, bad, 1.0)))


@pytest.mark.parametrize("codec", list(CODECS.values()), ids=list(CODECS))
def test_beyond_float32_range_rejected(codec):
    x = np.ones((3, 32))
    x[1, 0] = 1e39
    with pytest.raises(ValueError, match="row 1.*float32 range"):
        codec.encode(x)


def test_fp8_overflow_rejected():
    x = np.ones((2, 32), np.float32)
    x[1, 2] = 1.9375 * 2.0**127  # a tie between 1.875·2^127 and 2^128: rounds to even, 2^128 = inf
    with pytest.raises(ValueError, match="row 1.*fp8_e4m3 range"):
        fp8.encode(x)
    x[1, 2] = np.nextafter(np.float32(x[1, 2]), np.float32(0))  # just below the tie: stays finite
    assert fp8.decode(fp8.encode(x), 32)[1, 2] == FP8_TOP


def test_int8_top_of_float32_range_decodes_finite():
    x = np.array([[FLT_MAX, -FLT_MAX, 1.0]], np.float32)
    assert_round_trip(int8, x)


def test_bf16_overflow_rejected():
    x = np.ones((2, 4), np.float32)
    x[1, 2] = 3.399e38  # finite in float32, rounds to bf16 inf
    with pytest.raises(ValueError, match="row 1.*bfloat16 range"):
        bf16.encode(x)


@pytest.mark.parametrize("codec", list(CODECS.values()), ids=list(CODECS))
def test_bad_shapes_rejected(codec):
    with pytest.raises(ValueError, match=r"\[N, D\]"):
        codec.encode(np.ones(64))
    rows = codec.encode(np.ones((2, 64)))
    with pytest.raises(ValueError, match="uint8 rows"):
        codec.decode(rows[:, :-1], 64)
    with pytest.raises(ValueError, match="uint8 rows"):
        codec.decode(rows.astype(np.int16), 64)
    with pytest.raises(ValueError, match="dtype"):
        codec.decode(rows, 64, dtype=torch.float16)
