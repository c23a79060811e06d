// Gather: random rows are DRAM-latency bound, so each worker prefetches a few rows ahead.
#include "gather.h"

#include "decode.h"

#include <algorithm>
#include <cstdio>
#include <string>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace tiergram {

namespace {

constexpr uint64_t kPrefetchAhead = 8;  // rows in flight per thread; ~8 covers DRAM latency at 264 B/row
constexpr uint64_t kMaxPrefetchAhead = 64;  // the most gather_limit may be asked for

inline void prefetch_row(const uint8_t *p, uint64_t row_bytes) {
  for (uint64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(p + b, 0, 0);
  __builtin_prefetch(p + row_bytes - 1, 0, 0);
}


inline void emit(OutKind kind, int codec, const uint8_t *row, uint64_t dim, uint64_t row_bytes, void *out,
                 uint64_t i, bool stream) {
  switch (kind) {
    case OutKind::kF32: decode_row_f32(codec, row, dim, static_cast<float *>(out) + i * dim, stream); break;
    case OutKind::kBf16: decode_row_bf16(codec, row, dim, static_cast<uint16_t *>(out) + i * dim, stream); break;
    case OutKind::kRaw: std::memcpy(static_cast<uint8_t *>(out) + i * row_bytes, row, row_bytes); break;
  }
}

// The largest cache cpu0 reports in sysfs ("32768K"), or 32 MiB where none is reported. (glibc's
// sysconf(_SC_LEVEL3_CACHE_SIZE) reads CPUID, which in this project's VM says 320 MiB where the guest sees 32.)
uint64_t last_level_cache_bytes() {
  uint64_t best = 0;
  for (int i = 0; i < 16; ++i) {
    const std::string path = "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(i) + "/size";
    std::FILE *f = std::fopen(path.c_str(), "r");
    if (!f) continue;
    unsigned long long v = 0;
    char unit = 0;
    if (std::fscanf(f, "%llu%c", &v, &unit) >= 1)
      best = std::max<uint64_t>(best, v << (unit == 'K' ? 10 : unit == 'M' ? 20 : unit == 'G' ? 30 : 0));
    std::fclose(f);
  }
  return best ? best : uint64_t{32} << 20;
}

// Output bytes from which gathers stream by default: the last-level cache's size.
inline uint64_t stream_from_bytes() {
  static const uint64_t bytes = last_level_cache_bytes();
  return bytes;
}

inline void store_fence() {
#if defined(__x86_64__)
  _mm_sfence();  // non-temporal stores are weakly ordered: make them visible before the pool reports done
#endif
}

// Runs each(row, i) over [0, n) on the pool, prefetching rows ahead; row_at(i) gives the i-th source row.
template <typename RowAt, typename Each>
void run_rows(uint64_t n, uint64_t row_bytes, bool stream, uint64_t A, RowAt row_at, Each each) {
  const std::shared_ptr<WorkerPool> pool = global_pool();  // held: set_num_threads may swap it meanwhile
  pool->parallel_for(n, 256, [&](size_t begin, size_t end) {
    if (A == 0) {  // no prefetch (gather_limit may be asked for it)
      for (size_t i = begin; i < end; ++i) each(row_at(i), i);
      if (stream) store_fence();
      return;
    }
    // addresses computed once, when prefetched, in a ring indexed by a mask (a division by the runtime distance
    // per row cost more than the row's decode); row i + A overwrites row i's slot only after row i was taken
    constexpr size_t kRing = kMaxPrefetchAhead;
    static_assert((kRing & (kRing - 1)) == 0, "the ring's size must be a power of two");
    const uint8_t *ahead[kRing];
    for (size_t i = begin; i < std::min<size_t>(end, begin + A); ++i) {
      ahead[i & (kRing - 1)] = row_at(i);
      prefetch_row(ahead[i & (kRing - 1)], row_bytes);
    }
    for (size_t i = begin; i < end; ++i) {
      const uint8_t *row = ahead[i & (kRing - 1)];
      if (i + A < end) {
        const uint8_t *next = row_at(i + A);
        ahead[(i + A) & (kRing - 1)] = next;
        prefetch_row(next, row_bytes);
      }
      each(row, i);
    }
    if (stream) store_fence();
  });
}

// Runs emit over [0, n); row_at(i) gives the address of the i-th source row.
template <typename RowAt>
void run_gather(uint64_t n, OutKind kind, int codec, uint64_t dim, uint64_t row_bytes, void *out, int stream_mode,
                RowAt row_at) {
  // Non-temporal stores save the read-for-ownership of each output line; they pay only for outputs the last-level
  // cache cannot hold (its consumer would find them evicted anyway). Measured on this project's Zen 4 VM (32 MiB
  // L3, quiet, 4 GiB table, fp8 -> f32): 48 MiB outputs 1.06-1.34x faster with them, 12 MiB ones 0.91-1.30x,
  // 3 MiB and smaller 0.72-0.88x. Auto (stream_mode < 0): from the L3's size up.
  const uint64_t out_row = kind == OutKind::kF32 ? 4 * dim : kind == OutKind::kBf16 ? 2 * dim : row_bytes;
  const bool stream = stream_mode > 0 || (stream_mode < 0 && kind != OutKind::kRaw && n * out_row >= stream_from_bytes());
  run_rows(n, row_bytes, stream, kPrefetchAhead, row_at,
           [&](const uint8_t *row, uint64_t i) { emit(kind, codec, row, dim, row_bytes, out, i, stream); });
}

// The same-bytes limit's row: every byte of the row read, out_bytes written (the row's 16-byte chunks over and
// over), no arithmetic; stream: non-temporal stores (needs 16-byte aligned output rows).
inline void copy_cyclic(const uint8_t *row, uint64_t row_bytes, uint8_t *out, uint64_t out_bytes, bool stream) {
#if defined(__x86_64__)
  const uint64_t chunks = (row_bytes + 15) / 16;  // the last chunk ends at the row's last byte
  for (uint64_t j = 0, c = 0; j + 16 <= out_bytes; j += 16, c = c + 1 == chunks ? 0 : c + 1) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i *>(row + std::min(16 * c, row_bytes - 16)));
    if (stream)
      _mm_stream_si128(reinterpret_cast<__m128i *>(out + j), v);
    else
      _mm_storeu_si128(reinterpret_cast<__m128i *>(out + j), v);
  }
#else
  (void)stream;
  for (uint64_t j = 0; j + 16 <= out_bytes; j += 16) std::memcpy(out + j, row + (j % (row_bytes - 15)), 16);
#endif
}

}  // namespace

void check_ids(const TableView &t, const int64_t *ids, uint64_t n_ids) {
  if (t.n_heads == 0) throw std::invalid_argument("table has no heads");
  if (n_ids % t.n_heads != 0)
    throw std::invalid_argument("row ids: last dimension must equal the table's " + std::to_string(t.n_heads) +
                                " heads");
  for (uint64_t h = 0; h < t.n_heads; ++h) {
    if (t.head_rows[h] <= 0 || t.head_offsets[h] < 0)
      throw std::invalid_argument("head " + std::to_string(h) + " has an invalid row range");
    const uint64_t last = static_cast<uint64_t>(t.head_offsets[h] + t.head_rows[h] - 1);
    if (t.geo.row_offset(last) + t.geo.row_bytes > t.data_bytes)
      throw std::invalid_argument("head " + std::to_string(h) + " extends past the table data (" +
                                  std::to_string(t.data_bytes) + " bytes)");
  }
  const uint64_t positions = n_ids / t.n_heads;
  for (uint64_t p = 0; p < positions; ++p) {
    const int64_t *row = ids + p * t.n_heads;
    for (uint64_t h = 0; h < t.n_heads; ++h) {
      if (row[h] < 0 || row[h] >= t.head_rows[h])
        throw RowIndexError("row id " + std::to_string(row[h]) + " out of range for head " + std::to_string(h) +
                            " (rows 0.." + std::to_string(t.head_rows[h] - 1) + ") at position " +
                            std::to_string(p));
    }
  }
}

void gather_rows(const TableView &t, const int64_t *ids, uint64_t n_ids, OutKind kind, void *out, int stream) {
  const FastDiv32 heads(t.n_heads);
  run_gather(n_ids, kind, t.codec, t.dim, t.geo.row_bytes, out, stream, [&](size_t i) {
    const uint64_t h = (i >> 32) ? i % t.n_heads : heads.mod(i);
    const uint64_t global = static_cast<uint64_t>(t.head_offsets[h] + ids[i]);
    return t.data + t.geo.row_offset(global);
  });
}

void gather_limit(const TableView &t, const int64_t *ids, uint64_t n_ids, uint64_t out_bytes, bool stream,
                  uint64_t ahead, uint8_t *out) {
  if (ahead > kMaxPrefetchAhead)
    throw std::invalid_argument("prefetch distance " + std::to_string(ahead) + " above the maximum " +
                                std::to_string(kMaxPrefetchAhead));
  if (t.geo.row_bytes < 16 || out_bytes % 16 != 0)
    throw std::invalid_argument("gather_limit needs rows of >= 16 bytes and whole 16-byte output chunks, got " +
                                std::to_string(t.geo.row_bytes) + " and " + std::to_string(out_bytes));
  stream = stream && reinterpret_cast<uintptr_t>(out) % 16 == 0;
  const FastDiv32 heads(t.n_heads);
  run_rows(
      n_ids, t.geo.row_bytes, stream, ahead,
      [&](size_t i) {
        const uint64_t h = (i >> 32) ? i % t.n_heads : heads.mod(i);
        return t.data + t.geo.row_offset(static_cast<uint64_t>(t.head_offsets[h] + ids[i]));
      },
      [&](const uint8_t *row, uint64_t i) { copy_cyclic(row, t.geo.row_bytes, out + i * out_bytes, out_bytes, stream); });
}

void decode_at(const uint8_t *src, uint64_t src_bytes, const int64_t *offsets, uint64_t n, int codec, uint64_t dim,
               OutKind kind, void *out) {
  const uint64_t row_bytes = codec_row_bytes(codec, dim);
  if (row_bytes == 0) throw std::invalid_argument("invalid codec/dim pair");
  for (uint64_t i = 0; i < n; ++i) {
    if (offsets[i] < 0 || static_cast<uint64_t>(offsets[i]) + row_bytes > src_bytes)
      throw RowIndexError("row byte offset " + std::to_string(offsets[i]) + " at index " + std::to_string(i) +
                          " outside the " + std::to_string(src_bytes) + "-byte source");
  }
  run_gather(n, kind, codec, dim, row_bytes, out, -1, [&](size_t i) { return src + offsets[i]; });
}

void gather_located(const uint8_t *const *rows, const uint64_t *which, uint64_t n, OutKind kind, int codec,
                    uint64_t dim, uint64_t row_bytes, void *out) {
  run_gather(n, kind, codec, dim, row_bytes, out, -1, [&](size_t i) { return rows[which[i]]; });
}

}  // namespace tiergram
