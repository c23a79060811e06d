// Parallel gather + dequant of table rows into a preallocated output.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

#include "common.h"

namespace tiergram {

// Raised for an out-of-range row id; mapped to Python IndexError.
struct RowIndexError : std::out_of_range {
  using std::out_of_range::out_of_range;
};

enum class OutKind { kF32, kBf16, kRaw };

// A table's rows in memory: the page-structured data region and the per-head row spaces.
struct TableView {
  const uint8_t *data = nullptr;
  uint64_t data_bytes = 0;
  PageGeometry geo;
  const int64_t *head_offsets = nullptr;  // [H] first global row of each head
  const int64_t *head_rows = nullptr;     // [H] rows of each head
  uint64_t n_heads = 0;
  int codec = 0;
  uint64_t dim = 0;
};

// Checks every id of ids [n_ids] (head = i % n_heads) and the table bounds; throws RowIndexError.
void check_ids(const TableView &t, const int64_t *ids, uint64_t n_ids);

// out[i] = decode(row of ids[i]); ids must be checked. out is [n_ids, dim] f32/bf16 or [n_ids, row_bytes].
// stream: 1 non-temporal stores (fp8 rows on AVX-512 cores), 0 normal stores, -1 non-temporal from the size of the
// last-level cache up (decoded outputs).
void gather_rows(const TableView &t, const int64_t *ids, uint64_t n_ids, OutKind kind, void *out, int stream = -1);

// The same-bytes limit of gather_rows: per id, every byte of its row read and out_bytes (a multiple of 16) written
// into out [n_ids, out_bytes] with no decode, on the same threads, prefetching `ahead` rows (<= 64) per thread;
// stream: non-temporal stores. ids must be checked.
void gather_limit(const TableView &t, const int64_t *ids, uint64_t n_ids, uint64_t out_bytes, bool stream,
                  uint64_t ahead, uint8_t *out);

// out[i] = decode(src + offsets[i]); every offset is checked against src_bytes (throws RowIndexError).
void decode_at(const uint8_t *src, uint64_t src_bytes, const int64_t *offsets, uint64_t n, int codec,
               uint64_t dim, OutKind kind, void *out);

// out[i] = decode(rows[which[i]]) for i < n: a gather from rows already located (the fetch pipeline's hits and
// misses); every rows[which[i]] must hold row_bytes readable bytes.
void gather_located(const uint8_t *const *rows, const uint64_t *which, uint64_t n, OutKind kind, int codec,
                    uint64_t dim, uint64_t row_bytes, void *out);

}  // namespace tiergram
