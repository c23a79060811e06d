// Gather: random rows are DRAM-latency bound, so each worker prefetches a few rows ahead.
#include "gather.h"

#include "decode.h"

namespace tiergram {

namespace {

constexpr uint64_t kPrefetchAhead = 8;  // rows in flight per thread; ~8 covers DRAM latency at 264 B/row

inline void prefetch_row(const uint8_t *p, uint64_t row_bytes) {
  for (uint64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(p + b, 0, 0);
  __builtin_prefetch(p + row_bytes - 1, 0, 0);
}

inline void emit(OutKind kind, int codec, const uint8_t *row, uint64_t dim, uint64_t row_bytes, void *out,
                 uint64_t i) {
  switch (kind) {
    case OutKind::kF32: decode_row_f32(codec, row, dim, static_cast<float *>(out) + i * dim); break;
    case OutKind::kBf16: decode_row_bf16(codec, row, dim, static_cast<uint16_t *>(out) + i * dim); break;
    case OutKind::kRaw: std::memcpy(static_cast<uint8_t *>(out) + i * row_bytes, row, row_bytes); break;
  }
}

// Runs emit over [0, n) on the pool; row_at(i) gives the address of the i-th source row.
template <typename RowAt>
void run_gather(uint64_t n, OutKind kind, int codec, uint64_t dim, uint64_t row_bytes, void *out, RowAt row_at) {
  const std::shared_ptr<WorkerPool> pool = global_pool();  // held: set_num_threads may swap it meanwhile
  pool->parallel_for(n, 256, [&](size_t begin, size_t end) {
    const uint8_t *ahead[kPrefetchAhead];  // addresses computed once, when prefetched
    for (size_t i = begin; i < std::min<size_t>(end, begin + kPrefetchAhead); ++i) {
      ahead[i % kPrefetchAhead] = row_at(i);
      prefetch_row(ahead[i % kPrefetchAhead], row_bytes);
    }
    for (size_t i = begin; i < end; ++i) {
      const uint8_t *row = ahead[i % kPrefetchAhead];
      if (i + kPrefetchAhead < end) {
        ahead[i % kPrefetchAhead] = row_at(i + kPrefetchAhead);
        prefetch_row(ahead[i % kPrefetchAhead], row_bytes);
      }
      emit(kind, codec, row, dim, row_bytes, out, i);
    }
  });
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

void gather_rows(const TableView &t, const int64_t *ids, uint64_t n_ids, OutKind kind, void *out) {
  const FastDiv32 heads(t.n_heads);
  run_gather(n_ids, kind, t.codec, t.dim, t.geo.row_bytes, out, [&](size_t i) {
    const uint64_t h = (i >> 32) ? i % t.n_heads : heads.mod(i);
    const uint64_t global = static_cast<uint64_t>(t.head_offsets[h] + ids[i]);
    return t.data + t.geo.row_offset(global);
  });
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
  run_gather(n, kind, codec, dim, row_bytes, out, [&](size_t i) { return src + offsets[i]; });
}

void gather_located(const uint8_t *const *rows, const uint64_t *which, uint64_t n, OutKind kind, int codec,
                    uint64_t dim, uint64_t row_bytes, void *out) {
  run_gather(n, kind, codec, dim, row_bytes, out, [&](size_t i) { return rows[which[i]]; });
}

}  // namespace tiergram
