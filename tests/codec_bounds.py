"""The codecs' worst-case error, the tolerance oracle of the tests (`from codec_bounds import error_bound`)."""

from __future__ import annotations

import numpy as np

from tiergram.codecs import FP8_BLOCK, Codec, Fp8E4m3Codec, _to_numpy, _values_to_float32

TINY = 2.0**-140  # absolute slack covering float32 subnormal rounding


def error_bound(codec: Codec, values) -> np.ndarray:
    """float64 [N, D]: worst-case |decode(encode(values)) - values| (float32 decode), elementwise."""
    x32 = _values_to_float32(values)
    codec.row_bytes(x32.shape[1])  # the codec's own dim check
    a = np.abs(x32.astype(np.float64))
    if codec.name == "fp32":
        quant = np.zeros(x32.shape)
    elif codec.name == "bf16":  # 8 significant bits: half an ulp is at most 2^-8 relative; subnormals 2^-133 apart
        quant = a * 2.0**-8 + 2.0**-134
    elif codec.name == "int8":  # half a step s/2 = amax/254, plus float32 rounding of s and of q*s (2^-24 each)
        amax = a.max(axis=1, keepdims=True)
        quant = np.broadcast_to(amax / 254.0 + amax * 2.0**-22 + TINY, x32.shape)
    else:  # y = x/2^t rounds to e4m3 within max(|y| 2^-4, 2^-10) (3 mantissa bits, subnormal spacing 2^-9)
        t = Fp8E4m3Codec.scale_exponents(x32).astype(np.float64) - 127
        quant = a * 2.0**-4 + np.repeat(np.exp2(t - 10), FP8_BLOCK, axis=1) + TINY
    # plus rounding the input to float32: half an ulp (relative 2^-24) and subnormal slack
    return quant + np.abs(_to_numpy(values).astype(np.float64)) * 2.0**-24 + 2.0**-150
