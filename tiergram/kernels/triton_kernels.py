"""The Triton gather + dequant kernel: rows of per-head ids from a page-structured table, optionally through a
row cache; bit-exact with tiergram.codecs (docs/accelerator.md)."""

import triton
import triton.language as tl

NAN_BITS = tl.constexpr(0x7FC00000)
UE8M0_ZERO_BITS = tl.constexpr(0x00400000)  # 2^-127, the float32 subnormal that ue8m0 byte 0 stands for


@triton.jit
def _load(data, cache, hoff, coff, hit, mask, ELEM: tl.constexpr, HAS_CACHE: tl.constexpr):
    """Elements of ELEM bytes at element offsets hoff (data) or coff (cache, where hit)."""
    if ELEM == 4:
        dp = data.to(tl.pointer_type(tl.int32))
        cp = cache.to(tl.pointer_type(tl.int32))
    elif ELEM == 2:
        dp = data.to(tl.pointer_type(tl.int16))
        cp = cache.to(tl.pointer_type(tl.int16))
    else:
        dp = data
        cp = cache
    if HAS_CACHE:
        x = tl.load(dp + hoff, mask=mask & (hit == 0), other=0)
        y = tl.load(cp + coff, mask=mask & (hit != 0), other=0)
        x = tl.where(hit != 0, y, x)
    else:
        x = tl.load(dp + hoff, mask=mask, other=0)
    return x


@triton.jit
def _fill(cache, foff, x, mask, ELEM: tl.constexpr):
    """Write elements x of ELEM bytes at element offsets foff of the cache."""
    if ELEM == 4:
        cp = cache.to(tl.pointer_type(tl.int32))
    elif ELEM == 2:
        cp = cache.to(tl.pointer_type(tl.int16))
    else:
        cp = cache
    tl.store(cp + foff, x, mask=mask)


@triton.jit
def _fp8_e4m3_value(q):
    """uint8 float8-e4m3fn codes -> exact float32 values (0x7F, 0xFF: NaN)."""
    qi = q.to(tl.int32)
    mag = qi & 0x7F
    normal = ((mag << 20) + (120 << 23)).to(tl.float32, bitcast=True)  # 2^(exp-7) * (1 + man/8)
    sub = (mag & 7).to(tl.float32) * 0.001953125  # exponent 0: man * 2^-9, exact
    v = tl.where(mag < 8, sub, normal)
    bits = v.to(tl.int32, bitcast=True) | ((qi & 0x80) << 24)  # the sign by bit, so -0.0 stays -0.0
    bits = tl.where(mag == 0x7F, NAN_BITS, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _ue8m0_scale(e):
    """uint8 ue8m0 exponents -> float32 2^(e-127), exact (0: the subnormal 2^-127, 255: NaN)."""
    ei = e.to(tl.int32)
    bits = tl.where(ei == 0, UE8M0_ZERO_BITS, ei << 23)
    bits = tl.where(ei == 255, NAN_BITS, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _store(ptrs, v, mask, OUT_BF16: tl.constexpr):
    """Store float32 v as float32, or as bfloat16 rounded to nearest even by integer ops (exact everywhere)."""
    if OUT_BF16:
        b = v.to(tl.uint32, bitcast=True)
        rounded = (b + 0x7FFF + ((b >> 16) & 1)) >> 16  # a carry into the exponent is right, up to inf
        nan = (b & 0x7FFFFFFF) > 0x7F800000
        bits = tl.where(nan, (b >> 16) | 0x40, rounded)
        tl.store(ptrs.to(tl.pointer_type(tl.int16)), bits.to(tl.int16), mask=mask)
    else:
        tl.store(ptrs, v, mask=mask)


@triton.jit
def gather_kernel(data, ids, head_off, out, cache, slots, fill, n_rows, n_heads, rows_per_page, page_size,
                  row_bytes, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr,
                  CODEC: tl.constexpr, ALIGN: tl.constexpr, HAS_CACHE: tl.constexpr, OUT_BF16: tl.constexpr):
    """out[r] = decode(row ids[r] + head_off[r % H]) for flat r < n_rows; rows from cache where slots[r] >= 0."""
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = r < n_rows
    g = tl.load(ids + r, mask=rmask, other=0) + tl.load(head_off + r % n_heads, mask=rmask, other=0)
    base = tl.multiple_of((g // rows_per_page) * page_size + (g % rows_per_page) * row_bytes, ALIGN)
    if HAS_CACHE:
        slot = tl.load(slots + r, mask=rmask, other=-1)
        hit = (slot >= 0).to(tl.int32)
        cbase = tl.multiple_of(tl.where(slot >= 0, slot, 0) * row_bytes, ALIGN)
        dst = tl.load(fill + r, mask=rmask, other=-1)
        do_fill = (dst >= 0) & (slot < 0)
        fbase = tl.multiple_of(tl.where(do_fill, dst, 0) * row_bytes, ALIGN)
    else:
        hit = (r < 0).to(tl.int32)
        cbase = base
        do_fill = r < 0
        fbase = base
    cols = tl.arange(0, BLOCK_D)
    m2 = rmask[:, None] & (cols < D)[None, :]
    orow = out + r[:, None] * D
    if CODEC == 0:  # fp32: D float32
        w = _load(data, cache, base[:, None] // 4 + cols[None, :], cbase[:, None] // 4 + cols[None, :],
                  hit[:, None], m2, 4, HAS_CACHE)
        if HAS_CACHE:
            _fill(cache, fbase[:, None] // 4 + cols[None, :], w, m2 & do_fill[:, None], 4)
        _store(orow + cols[None, :], w.to(tl.float32, bitcast=True), m2, OUT_BF16)
    elif CODEC == 1:  # bf16: D bfloat16, the upper halves of float32
        w = _load(data, cache, base[:, None] // 2 + cols[None, :], cbase[:, None] // 2 + cols[None, :],
                  hit[:, None], m2, 2, HAS_CACHE)
        if HAS_CACHE:
            _fill(cache, fbase[:, None] // 2 + cols[None, :], w, m2 & do_fill[:, None], 2)
        v = ((w.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
        _store(orow + cols[None, :], v, m2, OUT_BF16)
    elif CODEC == 2:  # int8: D int8 q, then a float32 scale s at byte D (any alignment); value q * s
        q = _load(data, cache, base[:, None] + cols[None, :], cbase[:, None] + cols[None, :], hit[:, None], m2,
                  1, HAS_CACHE)
        k = tl.arange(0, 4)
        m4 = rmask[:, None] & (k < 4)[None, :]
        sb = _load(data, cache, base[:, None] + D + k[None, :], cbase[:, None] + D + k[None, :], hit[:, None], m4,
                   1, HAS_CACHE)
        if HAS_CACHE:
            _fill(cache, fbase[:, None] + cols[None, :], q, m2 & do_fill[:, None], 1)
            _fill(cache, fbase[:, None] + D + k[None, :], sb, m4 & do_fill[:, None], 1)
        s = tl.sum(sb.to(tl.int64) << (8 * k[None, :]).to(tl.int64), axis=1).to(tl.int32).to(tl.float32, bitcast=True)
        v = q.to(tl.int8, bitcast=True).to(tl.float32) * s[:, None]
        _store(orow + cols[None, :], v, m2, OUT_BF16)
    else:  # fp8_e4m3: D e4m3fn codes in blocks of 32, then D/32 ue8m0 exponents; value q * 2^(e-127)
        s = tl.arange(0, BLOCK_S)
        j = tl.arange(0, 32)
        c3 = s[:, None] * 32 + j[None, :]  # [BLOCK_S, 32] value index
        m3 = rmask[:, None, None] & (s < D // 32)[None, :, None] & (j < 32)[None, None, :]
        q = _load(data, cache, base[:, None, None] + c3[None, :, :], cbase[:, None, None] + c3[None, :, :],
                  hit[:, None, None], m3, 1, HAS_CACHE)
        ms = rmask[:, None] & (s < D // 32)[None, :]
        e = _load(data, cache, base[:, None] + D + s[None, :], cbase[:, None] + D + s[None, :], hit[:, None], ms,
                  1, HAS_CACHE)
        if HAS_CACHE:
            _fill(cache, fbase[:, None, None] + c3[None, :, :], q, m3 & do_fill[:, None, None], 1)
            _fill(cache, fbase[:, None] + D + s[None, :], e, ms & do_fill[:, None], 1)
        v = _fp8_e4m3_value(q) * _ue8m0_scale(e)[:, :, None]
        _store(orow[:, :, None] + c3[None, :, :], v, m3, OUT_BF16)


@triton.jit
def copy_rows_kernel(data, ids, head_off, out, n_rows, n_heads, rows_per_page, page_size, row_bytes,
                     BLOCK_B: tl.constexpr, BLOCK_R: tl.constexpr):
    """out[r] = the encoded bytes of row ids[r] + head_off[r % H], undecoded: the limit a gather is measured against."""
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = r < n_rows
    g = tl.load(ids + r, mask=rmask, other=0) + tl.load(head_off + r % n_heads, mask=rmask, other=0)
    base = (g // rows_per_page) * page_size + (g % rows_per_page) * row_bytes
    b = tl.arange(0, BLOCK_B)
    m = rmask[:, None] & (b < row_bytes)[None, :]
    tl.store(out + r[:, None] * row_bytes + b[None, :], tl.load(data + base[:, None] + b[None, :], mask=m), mask=m)
