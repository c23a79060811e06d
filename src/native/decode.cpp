// Dequantisation kernels, written branch-free so the compiler vectorises them (AVX2 clone + baseline).
#include "decode.h"

#include <cmath>
#include <limits>

namespace tiergram {

namespace {

inline float bits_to_f32(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

inline uint32_t f32_to_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

// fp32 -> bf16 with round-to-nearest-even; NaN stays a quiet NaN.
inline uint16_t f32_to_bf16(float f) {
  const uint32_t b = f32_to_bits(f);
  const uint32_t rounded = (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
  return (f != f) ? static_cast<uint16_t>((b >> 16) | 0x40u) : static_cast<uint16_t>(rounded);
}

// ue8m0 exponent byte -> 2^(e-127); e = 255 is NaN.
inline float ue8m0_scale(uint8_t e) {
  if (e == 255) return std::numeric_limits<float>::quiet_NaN();
  if (e == 0) return std::ldexp(1.0f, -127);
  return bits_to_f32(static_cast<uint32_t>(e) << 23);
}

// float8 e4m3fn -> fp32 without tables: normals by rebiasing the exponent (7 -> 127), subnormals
// (exponent 0) as m * 2^-9, 0x7F/0xFF as NaN. Integer-only for normals, so no denormal stalls.
inline float fp8_e4m3_to_f32(uint8_t q) {
  const uint32_t sign = static_cast<uint32_t>(q & 0x80) << 24;
  const uint32_t em = q & 0x7F;
  const float normal = bits_to_f32(sign | ((em << 20) + (120u << 23)));
  const float sub = static_cast<float>(static_cast<int>(em & 7)) * (1.0f / 512.0f);
  const float subnormal = (q & 0x80) ? -sub : sub;
  const float v = em < 8 ? subnormal : normal;
  return em == 0x7F ? std::numeric_limits<float>::quiet_NaN() : v;
}

template <typename Store>
__attribute__((always_inline)) inline void decode_row(int codec, const uint8_t *row, uint64_t dim, Store store) {
  switch (codec) {
    case kFp32:
      for (uint64_t j = 0; j < dim; ++j) {
        float v;
        std::memcpy(&v, row + 4 * j, 4);
        store(j, v);
      }
      break;
    case kBf16:
      for (uint64_t j = 0; j < dim; ++j) {
        uint16_t h;
        std::memcpy(&h, row + 2 * j, 2);
        store(j, bits_to_f32(static_cast<uint32_t>(h) << 16));
      }
      break;
    case kInt8: {
      float s;
      std::memcpy(&s, row + dim, 4);
      for (uint64_t j = 0; j < dim; ++j) store(j, static_cast<float>(static_cast<int8_t>(row[j])) * s);
      break;
    }
    case kFp8E4M3: {
      const uint8_t *scales = row + dim;
      for (uint64_t b = 0; b < dim / 32; ++b) {
        const float s = ue8m0_scale(scales[b]);
        const uint8_t *q = row + 32 * b;
        for (uint64_t j = 0; j < 32; ++j) store(32 * b + j, fp8_e4m3_to_f32(q[j]) * s);
      }
      break;
    }
    default:
      break;
  }
}

}  // namespace

__attribute__((target_clones("avx2", "default")))
void decode_row_f32(int codec, const uint8_t *row, uint64_t dim, float *out) {
  decode_row(codec, row, dim, [out](uint64_t j, float v) { out[j] = v; });
}

__attribute__((target_clones("avx2", "default")))
void decode_row_bf16(int codec, const uint8_t *row, uint64_t dim, uint16_t *out) {
  if (codec == kBf16) {  // already bf16: a straight copy keeps NaN payloads and costs nothing
    std::memcpy(out, row, 2 * dim);
    return;
  }
  decode_row(codec, row, dim, [out](uint64_t j, float v) { out[j] = f32_to_bf16(v); });
}

}  // namespace tiergram
