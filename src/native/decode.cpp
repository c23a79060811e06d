// Dequantisation kernels, written branch-free so the compiler vectorises them (AVX2 clone + baseline).
#include "decode.h"

#include <cmath>
#include <limits>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

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


#if defined(__x86_64__)
// AVX2 fp8 e4m3 block decode: 8 values per step, same arithmetic as fp8_e4m3_to_f32 above.
__attribute__((target("avx2"))) inline __m256 fp8x8_to_f32(const uint8_t *q, __m256 scale) {
  uint64_t bytes;
  std::memcpy(&bytes, q, 8);
  const __m256i v = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(bytes)));
  const __m256i em = _mm256_and_si256(v, _mm256_set1_epi32(0x7F));
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0x80)), 24);
  const __m256 normal = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(em, 20), _mm256_set1_epi32(120 << 23)));
  const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_and_si256(em, _mm256_set1_epi32(7))),
                                   _mm256_set1_ps(1.0f / 512.0f));
  const __m256 is_sub = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(8), em));
  __m256 mag = _mm256_blendv_ps(normal, sub, is_sub);
  const __m256 is_nan = _mm256_castsi256_ps(_mm256_cmpeq_epi32(em, _mm256_set1_epi32(0x7F)));
  mag = _mm256_blendv_ps(mag, _mm256_set1_ps(std::numeric_limits<float>::quiet_NaN()), is_nan);
  return _mm256_mul_ps(_mm256_or_ps(mag, _mm256_castsi256_ps(sign)), scale);
}

// fp32 x8 -> bf16 x8 (round to nearest even; NaN kept quiet), packed into 16 bytes.
__attribute__((target("avx2"))) inline __m128i f32x8_to_bf16(__m256 x) {
  const __m256i b = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(0x40));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, quiet, nan);
  // pack 32-bit lanes (values < 65536) to 16-bit; packus works per 128-bit half, then fix the order
  const __m256i packed = _mm256_packus_epi32(r, r);
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}

__attribute__((target("avx2"))) void fp8_row_avx2(const uint8_t *row, uint64_t dim, float *out_f32,
                                                  uint16_t *out_bf16) {
  const uint8_t *scales = row + dim;
  for (uint64_t b = 0; b < dim / 32; ++b) {
    const __m256 s = _mm256_set1_ps(ue8m0_scale(scales[b]));
    for (uint64_t k = 0; k < 32; k += 8) {
      const __m256 v = fp8x8_to_f32(row + 32 * b + k, s);
      if (out_f32) _mm256_storeu_ps(out_f32 + 32 * b + k, v);
      else _mm_storeu_si128(reinterpret_cast<__m128i *>(out_bf16 + 32 * b + k), f32x8_to_bf16(v));
    }
  }
}

bool have_avx2() {
  static const bool yes = [] {
    __builtin_cpu_init();  // static initialisers may run before the CPU model is read
    return __builtin_cpu_supports("avx2") != 0;
  }();
  return yes;
}
#endif

}  // namespace

__attribute__((target_clones("avx2", "default")))
void decode_row_f32(int codec, const uint8_t *row, uint64_t dim, float *out) {
#if defined(__x86_64__)
  if (codec == kFp8E4M3 && have_avx2()) return fp8_row_avx2(row, dim, out, nullptr);
#endif
  decode_row(codec, row, dim, [out](uint64_t j, float v) { out[j] = v; });
}

__attribute__((target_clones("avx2", "default")))
void decode_row_bf16(int codec, const uint8_t *row, uint64_t dim, uint16_t *out) {
  if (codec == kBf16) {  // already bf16: a straight copy keeps NaN payloads and costs nothing
    std::memcpy(out, row, 2 * dim);
    return;
  }
#if defined(__x86_64__)
  if (codec == kFp8E4M3 && have_avx2()) return fp8_row_avx2(row, dim, nullptr, out);
#endif
  decode_row(codec, row, dim, [out](uint64_t j, float v) { out[j] = f32_to_bf16(v); });
}

}  // namespace tiergram
