"""Row codecs: the reference encoders and decoders (docs/table-format.md, Codecs), the ground truth for the native
and Triton decoders. Decodes are exact: int8 is one float32 multiply; fp8_e4m3 is q * 2^(e-127), exact in float32
for every scale an encoder writes (e = 255 and fp8 NaN codes give NaN); bfloat16 output rounds the float32 result."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

FLOAT32_MAX = float(np.finfo(np.float32).max)
FP8_BLOCK = 32  # values per ue8m0 scale byte
UE8M0_NAN = 255
OUT_DTYPES = (torch.float32, torch.bfloat16)  # what rows decode to, here and in every reader of a table


def _fp8_e4m3fn_table() -> np.ndarray:
    """float32 [256]: the value of every float8 e4m3fn byte (0x7F and 0xFF are NaN)."""
    codes = np.arange(256)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exp = (codes >> 3) & 0xF
    man = codes & 0x7
    # exponent field 0 is subnormal: man/8 * 2^-6; otherwise (1 + man/8) * 2^(exp-7)
    mag = np.where(exp == 0, man / 8.0 * 2.0**-6, (1.0 + man / 8.0) * np.exp2(exp - 7.0))
    table = (sign * mag).astype(np.float32)
    table[0x7F] = table[0xFF] = np.nan
    return table


FP8_E4M3FN_VALUES = _fp8_e4m3fn_table()


def _to_numpy(x) -> np.ndarray:
    """Any numpy array or torch tensor (any device, bf16 included) -> numpy array on the CPU."""
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu()
        if x.dtype in (torch.bfloat16, torch.float16) or x.dtype.is_floating_point and x.itemsize == 1:
            x = x.float()  # numpy has no bf16/fp8; widening is exact
        return x.numpy()
    return np.asarray(x)


def _values_to_float32(values) -> np.ndarray:
    """float [N, D] (numpy or torch) -> contiguous float32 [N, D]; ValueError on NaN/inf/overflow."""
    x = _to_numpy(values)
    if x.ndim != 2:
        raise ValueError(f"expected values of shape [N, D], got shape {tuple(x.shape)}")
    if not (np.issubdtype(x.dtype, np.floating) or np.issubdtype(x.dtype, np.integer)):
        raise ValueError(f"expected real numbers, got dtype {x.dtype}")
    finite = np.isfinite(x)
    if not finite.all():
        row, col = np.argwhere(~finite)[0]
        n_bad = int((~finite.all(axis=1)).sum())
        raise ValueError(f"row {row} (column {col}) is {x[row, col]}: NaN/inf cannot be encoded "
                         f"({n_bad} bad row(s) in all)")
    if x.dtype != np.float32:
        big = np.abs(x.astype(np.float64)) > FLOAT32_MAX
        if big.any():
            row, col = np.argwhere(big)[0]
            raise ValueError(f"row {row} (column {col}) is {x[row, col]}: outside the float32 range")
    return np.ascontiguousarray(x, dtype=np.float32)


def _bf16_bits(x32: np.ndarray) -> np.ndarray:
    """float32 -> uint16 bfloat16 bits, round to nearest even (ties keep the even upper half)."""
    bits = x32.view(np.uint32).astype(np.uint64)
    # adding 0x7FFF plus the lowest kept bit rounds half to even; a carry into the exponent is right,
    # including the carry from the largest finite bf16 to inf
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype(np.uint16)


@dataclass(frozen=True)
class Codec:
    """A row encoding: `name` as written in the manifest, `codec_id` as the native core knows it."""

    name: str
    codec_id: int

    def row_bytes(self, dim: int) -> int:
        """Encoded bytes per row of `dim` values; ValueError if this codec cannot hold such rows."""
        self._check_dim(dim)
        return self._row_bytes(dim)

    def encode(self, values) -> np.ndarray:
        """float [N, D] (numpy or torch) -> uint8 [N, row_bytes(D)]; ValueError naming a NaN/inf row."""
        x32 = _values_to_float32(values)
        self._check_dim(x32.shape[1])
        out = self._encode(x32)
        assert out.shape == (x32.shape[0], self._row_bytes(x32.shape[1])) and out.dtype == np.uint8
        return out

    def decode(self, rows, dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """uint8 [N, row_bytes(dim)] (numpy or torch) -> CPU tensor [N, dim] of float32 or bfloat16."""
        check_out_dtype(dtype)
        r, row_bytes = _to_numpy(rows), self.row_bytes(dim)
        if r.dtype != np.uint8 or r.ndim != 2 or r.shape[1] != row_bytes:
            raise ValueError(f"expected uint8 rows of shape [N, {row_bytes}], got {r.dtype} {tuple(r.shape)}")
        with np.errstate(over="ignore"):  # bytes no encoder writes may overflow to inf: that is the value
            values = self._decode(np.ascontiguousarray(r), dim)
        out = torch.from_numpy(np.array(values, dtype=np.float32, order="C", copy=True))
        return out if dtype == torch.float32 else out.to(torch.bfloat16)

    def _check_dim(self, dim: int) -> None:
        if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)) or dim < 1:
            raise ValueError(f"codec {self.name}: dim must be a positive integer, got {dim!r}")

    # each codec defines _row_bytes(dim), _encode(x32) and _decode(rows, dim)


@dataclass(frozen=True)
class Fp32Codec(Codec):
    """`fp32`: D little-endian IEEE float32 values, 4·D bytes."""

    def _row_bytes(self, dim: int) -> int:
        return 4 * dim

    def _encode(self, x32: np.ndarray) -> np.ndarray:
        return x32.astype("<f4").view(np.uint8)

    def _decode(self, rows: np.ndarray, dim: int) -> np.ndarray:
        return rows.view("<f4")


@dataclass(frozen=True)
class Bf16Codec(Codec):
    """`bf16`: D little-endian bfloat16 values (upper half of float32, round to nearest even), 2·D bytes."""

    def _row_bytes(self, dim: int) -> int:
        return 2 * dim

    def _encode(self, x32: np.ndarray) -> np.ndarray:
        bits = _bf16_bits(x32)
        overflow = (bits & 0x7FFF) == 0x7F80  # finite input rounded up to inf
        if overflow.any():
            row, col = np.argwhere(overflow)[0]
            raise ValueError(f"row {row} (column {col}) is {x32[row, col]}: outside the bfloat16 range")
        return bits.astype("<u2").view(np.uint8)

    def _decode(self, rows: np.ndarray, dim: int) -> np.ndarray:
        return (rows.view("<u2").astype(np.uint32) << 16).view(np.float32)


@dataclass(frozen=True)
class Int8Codec(Codec):
    """`int8`: D int8 `q` then one little-endian float32 scale `s` (value q·s), D + 4 bytes."""

    def _row_bytes(self, dim: int) -> int:
        return dim + 4

    @staticmethod
    def scales(x32: np.ndarray) -> np.ndarray:
        """float32 [N]: s = amax/127 rounded to nearest (see the two edge cases below); all-zero row: 0."""
        amax = np.abs(x32).max(axis=1)
        s = amax / np.float32(127.0)
        # amax/127 can underflow to 0 for subnormal rows; the smallest subnormal scale is then exact
        s = np.where((amax > 0) & (s < np.float32(2.0**-149)), np.float32(2.0**-149), s)
        # near float32's top, a rounded-up s can make 127·s overflow on decode: step it down one ulp
        with np.errstate(over="ignore"):
            return np.where(np.isinf(s * np.float32(127)), np.nextafter(s, np.float32(0)), s)

    def _encode(self, x32: np.ndarray) -> np.ndarray:
        s = self.scales(x32)
        safe = np.where(s > 0, s, 1.0).astype(np.float64)[:, None]
        q = np.clip(np.rint(x32 / safe), -127, 127).astype(np.int8)  # rint: half to even
        out = np.empty((x32.shape[0], x32.shape[1] + 4), np.uint8)
        out[:, : x32.shape[1]] = q.view(np.uint8)
        out[:, x32.shape[1] :] = s.astype("<f4").reshape(-1, 1).view(np.uint8)
        return out

    def _decode(self, rows: np.ndarray, dim: int) -> np.ndarray:
        q = rows[:, :dim].view(np.int8).astype(np.float32)
        s = np.ascontiguousarray(rows[:, dim:]).view("<f4").astype(np.float32)
        return q * s  # one float32 multiply, round to nearest even


def _blocks(x: np.ndarray) -> np.ndarray:
    """[N, D] -> [N, D/32, 32] view: the values sharing one ue8m0 scale."""
    return x.reshape(x.shape[0], x.shape[1] // FP8_BLOCK, FP8_BLOCK)


@dataclass(frozen=True)
class Fp8E4m3Codec(Codec):
    """`fp8_e4m3`: D float8-e4m3fn `q` then D/32 ue8m0 bytes `e` (value q·2^(e−127)), D + D/32 bytes."""

    def _check_dim(self, dim: int) -> None:
        super()._check_dim(dim)
        if dim % FP8_BLOCK:
            raise ValueError(f"codec {self.name}: dim must be a multiple of {FP8_BLOCK}, got {dim}")

    def _row_bytes(self, dim: int) -> int:
        return dim + dim // FP8_BLOCK

    @staticmethod
    def scale_exponents(x32: np.ndarray) -> np.ndarray:
        """uint8 [N, D/32]: e = clamp(ceil(log2(amax/448)) + 127, 0, 254) per block, computed exactly."""
        amax = np.abs(_blocks(x32)).max(axis=2)
        # amax = m·2^k with m in [0.5, 1); 448 = 0.875·2^9, so the smallest t with amax <= 448·2^t is
        # k - 9, or k - 8 when m > 0.875. Done on frexp's exact parts, not with a rounded log2.
        m, k = np.frexp(amax)
        t = k.astype(np.int64) - 9 + (m > 0.875)
        t = np.where(amax == 0, -127, t)  # log2(0) = -inf: an all-zero block clamps to e = 0
        return np.clip(t + 127, 0, 254).astype(np.uint8)

    def _encode(self, x32: np.ndarray) -> np.ndarray:
        n, d = x32.shape
        e = self.scale_exponents(x32)
        # scaling by a power of two is exact in float32 (up to subnormals far below fp8 resolution),
        # and |x|/2^(e-127) <= 448 by the choice of e, so the fp8 cast never saturates
        y = np.ldexp(_blocks(x32), (127 - e.astype(np.int32))[:, :, None])
        q = torch.from_numpy(np.ascontiguousarray(y, np.float32)).to(torch.float8_e4m3fn)  # RNE
        out = np.empty((n, self._row_bytes(d)), np.uint8)
        out[:, :d] = q.view(torch.uint8).numpy().reshape(n, d)
        out[:, d:] = e
        if (e >= 247).any():  # only scales this large can round up past float32's range on decode
            with np.errstate(over="ignore"):
                inf = np.isinf(self._decode(out, d))
            if inf.any():
                row, col = np.argwhere(inf)[0]
                raise ValueError(f"row {row} (column {col}) is {x32[row, col]}: outside the fp8_e4m3 "
                                 f"range (it rounds to 2^128, which float32 cannot hold)")
        return out

    def _decode(self, rows: np.ndarray, dim: int) -> np.ndarray:
        q = _blocks(FP8_E4M3FN_VALUES[rows[:, :dim]])
        e = rows[:, dim:].astype(np.int32)
        scale = np.ldexp(np.float32(1.0), e - 127).astype(np.float32)  # e = 0 gives 2^-127, a subnormal
        scale[e == UE8M0_NAN] = np.nan
        return (q * scale[:, :, None]).reshape(rows.shape[0], dim)  # exact, see the module docstring


CODECS: dict[str, Codec] = {
    c.name: c
    for c in (
        Fp32Codec("fp32", 0),
        Bf16Codec("bf16", 1),
        Int8Codec("int8", 2),
        Fp8E4m3Codec("fp8_e4m3", 3),
    )
}


def check_out_dtype(dtype: torch.dtype) -> None:
    """ValueError unless rows can be decoded to dtype (OUT_DTYPES)."""
    if dtype not in OUT_DTYPES:
        raise ValueError(f"dtype must be one of {OUT_DTYPES}, got {dtype}")


def get_codec(name: str) -> Codec:
    """The codec called `name`; ValueError listing the valid names otherwise."""
    try:
        return CODECS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown codec {name!r}; valid codecs: {', '.join(CODECS)}") from None
