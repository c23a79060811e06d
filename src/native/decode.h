// Row decoders: one encoded row -> D output values (fp32 or bf16 bits).
#pragma once

#include <cstdint>
#include <cstring>

namespace tiergram {

enum Codec : int { kFp32 = 0, kBf16 = 1, kInt8 = 2, kFp8E4M3 = 3 };

// Encoded bytes of one row of `dim` values; 0 when the codec/dim pair is invalid.
inline uint64_t codec_row_bytes(int codec, uint64_t dim) {
  if (dim == 0 || dim >= (uint64_t(1) << 32)) return 0;  // keeps 4 * dim far from overflow
  switch (codec) {
    case kFp32: return 4 * dim;
    case kBf16: return 2 * dim;
    case kInt8: return dim + 4;
    case kFp8E4M3: return dim % 32 == 0 ? dim + dim / 32 : 0;
    default: return 0;
  }
}

// Decodes one row into fp32 values. `row` holds codec_row_bytes(codec, dim) bytes. stream: the output may be
// written with non-temporal stores (worth it only for outputs larger than the cache; the caller then issues
// an sfence before anyone reads it).
void decode_row_f32(int codec, const uint8_t *row, uint64_t dim, float *out, bool stream = false);
// Decodes one row into bf16 values (round to nearest even), stored as uint16 bit patterns.
void decode_row_bf16(int codec, const uint8_t *row, uint64_t dim, uint16_t *out, bool stream = false);

}  // namespace tiergram
