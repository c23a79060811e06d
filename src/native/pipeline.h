// The fetch pipeline: one lookup (or read-ahead) of a table in one native call, run without the GIL — bounds check,
// dedup, cache probe (hits pinned), one batched read of the missing pages (verified), admission, gather + dequantise
// of hits and misses into the output, unpin, per-head counts. The arguments are checked by the bindings
// (pipeline_bindings.cpp) with the GIL held and captured here as raw pointers.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "fetch_queue.h"  // Cancelled
#include "file_reader.h"
#include "gather.h"
#include "row_cache.h"

namespace tiergram {

// A table's geometry as the pipeline reads it; make_table checks it (invalid_argument naming what does not fit).
struct Table {
  TableView view;
  const int64_t *head_offsets;
  uint64_t n_heads;
};
Table make_table(const PageSource &src, const int64_t *head_offsets, const int64_t *head_rows, uint64_t n_heads,
                 uint64_t rows_per_page, int codec, uint64_t dim);

// Everything one fetch needs, as raw pointers into the caller's arrays (valid while the caller keeps them).
struct FetchArgs {
  PageSource *src = nullptr;
  NativeRowCache *cache = nullptr;  // nullptr: no cache
  Table t;
  const int64_t *ids = nullptr;
  size_t n = 0;
  OutKind kind = OutKind::kF32;
  void *out = nullptr;
  // acc int64 [4H + 4]: ids, distinct rows, hits, misses per head, then lookups, pages, hit rows, miss rows;
  // tier_acc int64 [2]: rows and pages read
  int64_t *acc = nullptr, *tier_acc = nullptr;
  int64_t batch = -1;       // the lookahead batch announced for these ids (a queued prefetch), retired by the probe
  bool background = false;  // a read-ahead queue's job: its page reads give way to the reader's other reads
};

// A read-ahead: the rows of ids the cache lacks, read and admitted; no pins, no probes counted.
struct WarmArgs {
  PageSource *src = nullptr;
  NativeRowCache *cache = nullptr;
  Table t;
  const int64_t *ids = nullptr;
  size_t n = 0;
  int64_t *acc = nullptr, *tier_acc = nullptr;  // acc: rows admitted, pages read; tier_acc: rows, pages read
  bool background = false;
};

// The fetch, without the GIL; returns the pages read. With a cache, a set `cancel` stops it (Cancelled) before the
// probe or before the reads (as the reference pipeline: without a cache a started fetch runs to the end).
int64_t run_fetch(const FetchArgs &a, const std::atomic<bool> *cancel);
// The read-ahead, without the GIL; returns (rows admitted, pages read).
std::pair<int64_t, int64_t> run_warm(const WarmArgs &a, const std::atomic<bool> *cancel);

// Sorted distinct global rows of ids [n] (head = i % H): what a read-ahead reads, and a lookahead announcement.
void sorted_unique(const Table &t, const int64_t *ids, size_t n, std::vector<int64_t> &uniq);

// Test hook: the staging bytes a thread keeps (larger reads go in chunks); returns the previous value.
size_t set_staging_keep_bytes(size_t bytes);

}  // namespace tiergram
