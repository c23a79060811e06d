// The fetch pipeline: one lookup (or read-ahead) of a file-tier table in one native call, the GIL released for
// all of it — bounds check, dedup, cache probe (hits pinned), one batched read of the missing pages (verified),
// admission, gather + dequantise of hits and misses into the output, unpin, per-head counts.
#include <nanobind/stl/pair.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/tuple.h>
#include <pthread.h>
#include <sched.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <condition_variable>
#include <deque>
#include <functional>
#include <thread>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cerrno>
#include <cstdlib>
#include <optional>
#include <string>
#include <memory>
#include <utility>
#include <vector>

#include "bindings.h"
#include "decode.h"
#include "file_reader.h"
#include "gather.h"
#include "row_cache.h"

namespace tiergram {

namespace {

constexpr size_t kAlign = 4096;                 // O_DIRECT buffer alignment (covers 512e and 4Kn disks)
constexpr size_t kStagingKeepBytes = 16 << 20;  // staging a thread keeps between calls; larger reads chunk

std::atomic<uint64_t> g_staging_serial{0};

struct AlignedBuffer {
  uint8_t *p = nullptr;
  size_t n = 0;
  uint64_t serial = 0;  // names this allocation (StagingArea)
  AlignedBuffer() = default;
  AlignedBuffer(const AlignedBuffer &) = delete;
  AlignedBuffer &operator=(const AlignedBuffer &) = delete;
  ~AlignedBuffer() { std::free(p); }
  uint8_t *reserve(size_t bytes) {
    if (bytes <= n) return p;
    std::free(p);
    p = nullptr, n = 0;
    void *q = nullptr;
    if (posix_memalign(&q, kAlign, std::max<size_t>(bytes, kAlign)) != 0) throw std::bad_alloc();
    p = static_cast<uint8_t *>(q), n = bytes;
    serial = ++g_staging_serial;
    return p;
  }
};

// Each thread reuses its staging buffer: a fresh one per call costs its page faults (the kernel pins and zero-fills
// every page it DMAs into), about 4% of a 6,000-page lookup; and a kept one can stay registered with the reader's
// io_uring rings (READ_FIXED). A call with more pages than it keeps reads them in chunks.
thread_local AlignedBuffer t_staging;
thread_local std::vector<uint8_t> t_rows;  // compact copies of a chunked read's rows
thread_local bool t_background = false;    // this thread is a read-ahead queue's worker: its reads give way
std::atomic<size_t> g_staging_keep{kStagingKeepBytes};

// The pages of sorted rows (plan_pages: pages, and at[j] = row j's byte offset were all pages staged at once) read
// through this thread's staging buffer, verified; returns each row's encoded bytes. The pointers are valid until
// this thread's next read: into the staging buffer when the pages fit it, else into compact copies of the rows
// made after each chunk of pages.
std::vector<const uint8_t *> read_rows(PageSource &src, const std::vector<int64_t> &pages,
                                       const std::vector<uint64_t> &at, uint64_t page_size, uint64_t row_bytes) {
  std::vector<const uint8_t *> rows(at.size());
  if (pages.empty()) return rows;
  const size_t chunk = std::max<size_t>(1, g_staging_keep.load() / page_size);  // pages per read
  const size_t first = std::min(pages.size(), chunk);
  t_staging.reserve(std::max(first * page_size, std::min(g_staging_keep.load(), 2 * t_staging.n)));
  const StagingArea area{t_staging.p, t_staging.n, t_staging.serial};
  const bool one = pages.size() <= chunk;
  if (!one) t_rows.resize(at.size() * row_bytes);
  size_t j = 0;
  for (size_t p0 = 0; p0 < pages.size(); p0 += chunk) {
    const size_t p1 = std::min(pages.size(), p0 + chunk);
    src.read_nogil(pages.data() + p0, p1 - p0, t_staging.p, true, &area, t_background);
    const uint64_t base = p0 * page_size, end = p1 * page_size;
    for (; j < at.size() && at[j] < end; ++j) {
      const uint8_t *row = t_staging.p + (at[j] - base);
      if (one) {
        rows[j] = row;
      } else {
        uint8_t *copy = t_rows.data() + j * row_bytes;
        std::memcpy(copy, row, row_bytes);
        rows[j] = copy;
      }
    }
  }
  return rows;
}

// Test hook: the staging bytes a thread keeps (chunks of a larger read); returns the previous value.
size_t set_staging_keep_bytes(size_t bytes) {
  require(bytes >= kAlign && bytes % kAlign == 0 && bytes <= (size_t{1} << 30),
          "staging bytes must be a multiple of 4096 in [4096, 2^30], got " + std::to_string(bytes));
  return g_staging_keep.exchange(bytes);
}

struct Table {
  TableView view;
  const int64_t *head_offsets;
  uint64_t n_heads;
};

Table make_table(PageSource &src, IdsIn head_offsets, IdsIn head_rows, uint64_t rows_per_page, int codec,
                 uint64_t dim) {
  const uint64_t row_bytes = codec_row_bytes(codec, dim);
  require(row_bytes > 0, "invalid codec " + std::to_string(codec) + " for dim " + std::to_string(dim));
  const uint64_t page_size = src.page_size();
  require(rows_per_page >= 1 && row_bytes + kPageTrailerBytes <= page_size &&
              rows_per_page <= (page_size - kPageTrailerBytes) / row_bytes,
          "page geometry does not fit: " + std::to_string(rows_per_page) + " rows of " + std::to_string(row_bytes) +
              " bytes in a " + std::to_string(page_size) + "-byte page");
  require(head_offsets.ndim() == 1 && head_offsets.size() == head_rows.size() && head_offsets.size() > 0,
          "head_offsets and head_rows must be int64 [H] of the same length");
  const int64_t *offs = head_offsets.data();
  for (size_t h = 1; h < head_offsets.size(); ++h)
    require(offs[h] > offs[h - 1], "head_offsets must increase (head " + std::to_string(h) + ")");
  Table t;
  t.view.data_bytes = src.n_pages() * page_size;
  t.view.geo = PageGeometry(page_size, rows_per_page, row_bytes);
  t.view.head_offsets = offs;
  t.view.head_rows = head_rows.data();
  t.view.n_heads = head_offsets.size();
  t.view.codec = codec;
  t.view.dim = dim;
  t.head_offsets = offs;
  t.n_heads = head_offsets.size();
  return t;
}

// Sorted distinct global rows of ids [n] (head = i % H): what a read-ahead reads.
void sorted_unique(const Table &t, const int64_t *ids, size_t n, std::vector<int64_t> &uniq) {
  uniq.resize(n);
  for (size_t i = 0; i < n; ++i) uniq[i] = ids[i] + t.head_offsets[i % t.n_heads];
  std::sort(uniq.begin(), uniq.end());
  uniq.erase(std::unique(uniq.begin(), uniq.end()), uniq.end());
}

// Distinct global rows of ids [n] in order of first occurrence, the head of each, and for each id the index of its
// row among them. A hash set in a per-thread scratch table: linear in n and L2-resident for a step's ids (sorting
// 6,144 ids cost more than probing the cache for them).
struct Dedup {
  std::vector<int64_t> uniq;
  std::vector<uint32_t> head;   // head of uniq[u]
  std::vector<uint64_t> which;  // ids[i] is uniq[which[i]]
};

thread_local std::vector<int64_t> t_set_keys;
thread_local std::vector<uint32_t> t_set_vals;

void dedup(const Table &t, const int64_t *ids, size_t n, Dedup &d) {
  size_t buckets = 64;
  while (buckets < 2 * n) buckets <<= 1;
  const size_t mask = buckets - 1;
  const unsigned shift = 64 - static_cast<unsigned>(__builtin_ctzll(buckets));
  if (t_set_keys.size() < buckets) t_set_keys.resize(buckets), t_set_vals.resize(buckets);
  std::fill(t_set_keys.begin(), t_set_keys.begin() + buckets, -1);
  d.uniq.clear();
  d.head.clear();
  d.uniq.reserve(n);
  d.head.reserve(n);
  d.which.resize(n);
  const uint64_t H = t.n_heads;
  for (size_t i = 0, h = 0; i < n; ++i, h = h + 1 == H ? 0 : h + 1) {
    const int64_t key = ids[i] + t.head_offsets[h];
    size_t b = static_cast<size_t>((static_cast<uint64_t>(key) * 0x9E3779B97F4A7C15ull) >> shift);
    while (t_set_keys[b] >= 0 && t_set_keys[b] != key) b = (b + 1) & mask;
    if (t_set_keys[b] < 0) {
      t_set_keys[b] = key;
      t_set_vals[b] = static_cast<uint32_t>(d.uniq.size());
      d.uniq.push_back(key);
      d.head.push_back(static_cast<uint32_t>(h));
    }
    d.which[i] = t_set_vals[b];
  }
}

// The distinct pages (in order) of sorted rows, and where each row sits in a buffer of those pages read in a row.
void plan_pages(const Table &t, const std::vector<int64_t> &rows, std::vector<int64_t> &pages,
                std::vector<uint64_t> &at) {
  const PageGeometry &g = t.view.geo;
  pages.clear();
  at.resize(rows.size());
  for (size_t j = 0; j < rows.size(); ++j) {
    const uint64_t r = static_cast<uint64_t>(rows[j]);
    const int64_t page = static_cast<int64_t>(r / g.rows_per_page);
    if (pages.empty() || pages.back() != page) pages.push_back(page);
    at[j] = (pages.size() - 1) * g.page_size + (r % g.rows_per_page) * g.row_bytes;
  }
}

// Releases a lookup's pins however it ends.
struct Unpin {
  NativeRowCache *cache;
  const std::vector<int64_t> &slots;
  ~Unpin() {
    if (!cache) return;
    std::lock_guard<std::mutex> lock(cache->mutex());
    cache->unpin_locked(slots.data(), slots.size());
  }
};

using Counts = nb::ndarray<int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

// Statistics are added into caller-owned counters atomically (several threads fetch from one table at once), so
// that a lookup costs Python no bookkeeping per call.
inline void add(int64_t *at, int64_t v) {
  if (v) __atomic_fetch_add(at, v, __ATOMIC_RELAXED);
}

// Nanoseconds spent in fetch without the GIL, and calls, over the process (the benchmark's Python-time split).
std::atomic<uint64_t> g_fetch_ns{0}, g_fetch_calls{0}, g_fetch_total_ns{0};

// A cancelled queued fetch stops at a phase boundary by throwing this (the queue turns it into CancelledError).
struct Cancelled {};

// Everything one fetch needs, as raw pointers into the caller's arrays (valid while the caller keeps them).
struct FetchArgs {
  PageSource *src = nullptr;
  NativeRowCache *cache = nullptr;
  Table t;
  const int64_t *ids = nullptr;
  size_t n = 0;
  OutKind kind = OutKind::kF32;
  void *out = nullptr;
  int64_t *acc = nullptr, *tier_acc = nullptr;
  int64_t batch = -1;  // the lookahead batch announced for these ids (a queued prefetch), retired by the probe
};

// Retires an announced batch unless the probe (which retires it itself) was reached.
struct RetireUnlessProbed {
  NativeRowCache *cache;
  int64_t batch;
  ~RetireUnlessProbed() {
    if (cache && batch >= 0) cache->retire(batch);
  }
};

// Checks the arguments (GIL held) and captures them.
FetchArgs prepare_fetch(PageSource &src, NativeRowCache *cache, IdsIn ids, IdsIn head_offsets, IdsIn head_rows,
                        uint64_t rows_per_page, int codec, uint64_t dim, AnyOut out, Counts acc, Counts tier_acc) {
  FetchArgs a;
  a.t = make_table(src, head_offsets, head_rows, rows_per_page, codec, dim);
  const uint64_t H = a.t.n_heads, row_bytes = a.t.view.geo.row_bytes;
  require(cache == nullptr || cache->row_bytes() == row_bytes,
          "cache rows are " + std::to_string(cache ? cache->row_bytes() : 0) + " bytes, the table's " +
              std::to_string(row_bytes));
  require(ids.size() % H == 0, "row ids: last dimension must equal the table's " + std::to_string(H) + " heads");
  require(ids.size() < (uint64_t{1} << 32), "a lookup of " + std::to_string(ids.size()) + " ids is over 2^32");
  require(acc.size() == 4 * H + 4, "acc must be int64 [4 * H + 4] = [" + std::to_string(4 * H + 4) + "]");
  require(tier_acc.size() == 2, "tier_acc must be int64 [2]");
  a.kind = out_kind(out);
  check_out_size(out, a.kind, ids.size(), dim, row_bytes);
  a.src = &src, a.cache = cache, a.ids = ids.data(), a.n = ids.size(), a.out = out.data();
  a.acc = acc.data(), a.tier_acc = tier_acc.data();
  return a;
}

// The fetch itself, without the GIL. With a cache, a set `cancel` stops it before the probe or before the reads
// (as the reference pipeline: without a cache a started fetch runs to the end).
int64_t run_fetch(const FetchArgs &a, const std::atomic<bool> *cancel) {
  const Table &t = a.t;
  const uint64_t H = t.n_heads, row_bytes = t.view.geo.row_bytes;
  NativeRowCache *cache = a.cache;
  int64_t *sum = a.acc, *tier_sum = a.tier_acc;
  const size_t n = a.n;
  auto stop = [&] { return cache && cancel && cancel->load(); };
  RetireUnlessProbed retire{cache, a.batch};
  check_ids(t.view, a.ids, n);  // RowIndexError -> IndexError naming head, id and position
  if (stop()) throw Cancelled{};
  if (n == 0) {
    add(sum + 4 * H, 1);
    return 0;
  }
  Dedup d;
  dedup(t, a.ids, n, d);
  const std::vector<int64_t> &uniq = d.uniq;
  std::vector<int64_t> slots(uniq.size(), -1);
  std::vector<int64_t> landing;  // missed keys a read-ahead has in flight: waited for, not read a second time
  std::vector<size_t> landing_u;
  if (cache) {
    std::lock_guard<std::mutex> lock(cache->mutex());
    cache->probe_locked(uniq.data(), uniq.size(), slots.data(), a.batch);
    retire.batch = -1;
    if (cache->any_in_flight_locked())
      for (size_t u = 0; u < uniq.size(); ++u)
        if (slots[u] < 0 && cache->in_flight_locked(uniq[u])) landing.push_back(uniq[u]), landing_u.push_back(u);
  }
  Unpin unpin{cache, slots};
  if (cache) cache->maybe_hold();

  // Reads the rows of uniq[u] for u in `which` (sorted by key, so that rows sharing a page are read once and the
  // pages go to the disk in file order) and points rows[u] at their staged bytes (an admitted row may be evicted
  // by a concurrent lookup before this one's gather runs, its staged copy cannot; it lasts until this thread's
  // next read). The rows are admitted after the gather (admit_staged): the gather then decodes pages the reads
  // just left in the L3, before the admission's copies and index updates push them out (perf: the decode cost
  // 2.5x as much CPU when it ran after the admission).
  std::vector<const uint8_t *> rows(uniq.size());
  size_t pages_read = 0, rows_read = 0;
  std::vector<int64_t> staged_keys;
  std::vector<const uint8_t *> staged_rows;
  auto admit_staged = [&] {  // before the staging is reused by a second read, and after the gather
    if (!cache || staged_keys.empty()) return;
    std::lock_guard<std::mutex> lock(cache->mutex());
    cache->admit_locked(staged_keys.data(), staged_keys.size(), staged_rows.data(), true);
    staged_keys.clear(), staged_rows.clear();
  };
  auto read_and_stage = [&](std::vector<size_t> &which) {  // sorts `which` in place
    std::vector<std::pair<int64_t, size_t>> by_key(which.size());  // (key, u): sorted with the key in hand
    for (size_t j = 0; j < which.size(); ++j) by_key[j] = {uniq[which[j]], which[j]};
    std::sort(by_key.begin(), by_key.end());
    std::vector<int64_t> keys(which.size());
    for (size_t j = 0; j < which.size(); ++j) keys[j] = by_key[j].first, which[j] = by_key[j].second;
    std::vector<int64_t> pages;
    std::vector<uint64_t> at;
    plan_pages(t, keys, pages, at);
    if (!pages.empty() && stop()) throw Cancelled{};
    const std::vector<const uint8_t *> staged = read_rows(*a.src, pages, at, t.view.geo.page_size, row_bytes);
    for (size_t j = 0; j < which.size(); ++j) rows[which[j]] = staged[j];
    staged_keys.insert(staged_keys.end(), keys.begin(), keys.end());
    staged_rows.insert(staged_rows.end(), staged.begin(), staged.end());
    pages_read += pages.size(), rows_read += keys.size();
  };
  std::vector<size_t> miss_u;  // every probe miss, landed or read
  for (size_t u = 0; u < uniq.size(); ++u)
    if (slots[u] < 0) miss_u.push_back(u);
  std::vector<size_t> others;  // with keys landing: the misses this fetch reads itself
  if (!landing.empty()) {
    std::vector<uint8_t> is_landing(uniq.size(), 0);
    for (size_t u : landing_u) is_landing[u] = 1;
    for (size_t u : miss_u)
      if (!is_landing[u]) others.push_back(u);
  }
  std::vector<size_t> &own = landing.empty() ? miss_u : others;
  if (!own.empty()) read_and_stage(own);
  std::vector<uint8_t> kept;  // the first read's rows, copied when a second read would reuse their staging
  if (!landing.empty()) {
    // The read-ahead's reads ran beside this fetch's; what landed is pinned like a hit, the rest (its read failed
    // or the cache turned it away) is read here.
    std::vector<int64_t> got(landing.size(), -1);
    {
      std::unique_lock<std::mutex> lock(cache->mutex());
      if (!cache->wait_landed(lock, landing.data(), landing.size(), stop)) throw Cancelled{};
      cache->pin_resident_locked(landing.data(), landing.size(), got.data());
    }
    std::vector<size_t> again;
    for (size_t j = 0; j < landing.size(); ++j) {
      slots[landing_u[j]] = got[j];  // unpinned with the hits
      if (got[j] < 0) again.push_back(landing_u[j]);
    }
    if (!again.empty()) {
      kept.resize(own.size() * row_bytes);
      for (size_t j = 0; j < own.size(); ++j) {
        std::memcpy(kept.data() + j * row_bytes, rows[own[j]], row_bytes);
        rows[own[j]] = kept.data() + j * row_bytes;
      }
      admit_staged();
      read_and_stage(again);
    }
  }
  for (size_t u = 0; u < uniq.size(); ++u)
    if (slots[u] >= 0) rows[u] = cache->row(slots[u]);
  gather_located(rows.data(), d.which.data(), n, a.kind, t.view.codec, t.view.dim, row_bytes, a.out);
  admit_staged();

  // acc: ids [H], distinct rows [H], hits [H], misses [H], then lookups, pages, hit rows, miss rows
  std::vector<int64_t> per_head(2 * H, 0);
  for (size_t u = 0; u < uniq.size(); ++u) ++per_head[d.head[u]];
  for (size_t u : miss_u) ++per_head[H + d.head[u]];
  const int64_t positions = static_cast<int64_t>(n / H);
  for (uint64_t h = 0; h < H; ++h) {
    add(sum + h, positions);
    add(sum + H + h, per_head[h]);
    add(sum + 2 * H + h, per_head[h] - per_head[H + h]);
    add(sum + 3 * H + h, per_head[H + h]);
  }
  add(sum + 4 * H, 1);
  add(sum + 4 * H + 1, static_cast<int64_t>(pages_read));
  add(sum + 4 * H + 2, static_cast<int64_t>(uniq.size() - miss_u.size()));
  add(sum + 4 * H + 3, static_cast<int64_t>(miss_u.size()));
  add(tier_sum, static_cast<int64_t>(rows_read));
  add(tier_sum + 1, static_cast<int64_t>(pages_read));
  return static_cast<int64_t>(pages_read);
}

struct Timer {
  std::atomic<uint64_t> &ns;
  std::chrono::steady_clock::time_point t0 = std::chrono::steady_clock::now();
  ~Timer() { ns += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count(); }
};

int64_t fetch(PageSource &src, NativeRowCache *cache, IdsIn ids, IdsIn head_offsets, IdsIn head_rows,
              uint64_t rows_per_page, int codec, uint64_t dim, AnyOut out, Counts acc, Counts tier_acc) {
  Timer whole{g_fetch_total_ns};  // the call after argument conversion, GIL reacquisition included
  const FetchArgs a =
      prepare_fetch(src, cache, ids, head_offsets, head_rows, rows_per_page, codec, dim, out, acc, tier_acc);
  nb::gil_scoped_release release;
  Timer nogil{g_fetch_ns};
  ++g_fetch_calls;
  return run_fetch(a, nullptr);
}

// A read-ahead: the rows of ids the cache lacks, read and admitted; no pins, no probes counted.
struct WarmArgs {
  PageSource *src = nullptr;
  NativeRowCache *cache = nullptr;
  Table t;
  const int64_t *ids = nullptr;
  size_t n = 0;
  int64_t *acc = nullptr, *tier_acc = nullptr;  // acc: rows admitted, pages read
};

WarmArgs prepare_warm(PageSource &src, NativeRowCache &cache, IdsIn ids, IdsIn head_offsets, IdsIn head_rows,
                      uint64_t rows_per_page, int codec, uint64_t dim, Counts acc, Counts tier_acc) {
  WarmArgs a;
  a.t = make_table(src, head_offsets, head_rows, rows_per_page, codec, dim);
  require(cache.row_bytes() == a.t.view.geo.row_bytes, "cache rows are " + std::to_string(cache.row_bytes()) +
                                                           " bytes, the table's " +
                                                           std::to_string(a.t.view.geo.row_bytes));
  require(ids.size() % a.t.n_heads == 0,
          "row ids: last dimension must equal the table's " + std::to_string(a.t.n_heads) + " heads");
  require(acc.size() == 2 && tier_acc.size() == 2, "acc and tier_acc must be int64 [2]");
  a.src = &src, a.cache = &cache, a.ids = ids.data(), a.n = ids.size(), a.acc = acc.data();
  a.tier_acc = tier_acc.data();
  return a;
}

std::pair<int64_t, int64_t> run_warm(const WarmArgs &a, const std::atomic<bool> *cancel) {
  const Table &t = a.t;
  check_ids(t.view, a.ids, a.n);
  if (cancel && cancel->load()) throw Cancelled{};
  std::vector<int64_t> uniq, miss;
  sorted_unique(t, a.ids, a.n, uniq);
  {
    std::lock_guard<std::mutex> lock(a.cache->mutex());
    for (int64_t k : uniq)
      if (!a.cache->contains_locked(k) && !a.cache->in_flight_locked(k)) miss.push_back(k);
    a.cache->mark_in_flight_locked(miss);
  }
  if (miss.empty()) return {0, 0};
  // Lands the keys when this read-ahead ends, admitted or not (a fetch waiting for one then reads it itself).
  struct Land {
    NativeRowCache *cache;
    const std::vector<int64_t> &keys;
    ~Land() {
      std::lock_guard<std::mutex> lock(cache->mutex());
      cache->land_locked(keys);
    }
  } land{a.cache, miss};
  a.cache->maybe_hold();  // test hook: held here with its reads in flight
  std::vector<int64_t> pages;
  std::vector<uint64_t> at;
  plan_pages(t, miss, pages, at);
  const std::vector<const uint8_t *> rows = read_rows(*a.src, pages, at, t.view.geo.page_size, t.view.geo.row_bytes);
  uint64_t entered;
  {
    std::lock_guard<std::mutex> lock(a.cache->mutex());
    entered = a.cache->admit_locked(miss.data(), miss.size(), rows.data(), true);
  }
  add(a.acc, static_cast<int64_t>(entered));
  add(a.acc + 1, static_cast<int64_t>(pages.size()));
  add(a.tier_acc, static_cast<int64_t>(miss.size()));
  add(a.tier_acc + 1, static_cast<int64_t>(pages.size()));
  return {static_cast<int64_t>(entered), static_cast<int64_t>(pages.size())};
}

std::pair<int64_t, int64_t> warm(PageSource &src, NativeRowCache &cache, IdsIn ids, IdsIn head_offsets,
                                 IdsIn head_rows, uint64_t rows_per_page, int codec, uint64_t dim, Counts acc,
                                 Counts tier_acc) {
  const WarmArgs a = prepare_warm(src, cache, ids, head_offsets, head_rows, rows_per_page, codec, dim, acc, tier_acc);
  nb::gil_scoped_release release;
  return run_warm(a, nullptr);
}

// ---- the native job queue: prefetches and read-aheads run on a C++ thread, in submission order, and a Ticket
// waits on the job without the GIL (no Python worker thread, so a fetch never waits for the GIL to start).

struct Job {
  enum State { kPending, kRunning, kDone, kCancelled };
  std::function<void(const std::atomic<bool> *)> work;
  std::function<void()> on_cancel;  // run (without the job's lock) when a job is cancelled before it ran
  std::mutex mu;
  std::condition_variable cv;
  State state = kPending;
  std::exception_ptr error;
  std::atomic<bool> cancel{false};
};

// What a queued job's raw pointers point into (Python objects: taken and let go with the GIL held).
struct Keep {
  nb::object reader, cache;
  IdsIn ids, head_offsets, head_rows;
  AnyOut out;
  Counts acc, tier_acc;
};

// Handles dropped before their job ended (the engine fires read-aheads and forgets them): their arrays wait here
// until the job ends, and are let go by the next call into the queue, which holds the GIL.
struct Orphans {
  std::mutex mu;
  std::vector<std::pair<std::shared_ptr<Job>, Keep>> list;

  void add(std::shared_ptr<Job> job, Keep keep) {
    std::lock_guard<std::mutex> lock(mu);
    list.emplace_back(std::move(job), std::move(keep));
  }
  // GIL held. Lets go of the arrays of the jobs that ended.
  void reap() {
    std::vector<Keep> dead;
    {
      std::lock_guard<std::mutex> lock(mu);
      for (size_t i = 0; i < list.size();) {
        bool ended;
        {
          std::lock_guard<std::mutex> jl(list[i].first->mu);
          ended = list[i].first->state == Job::kDone || list[i].first->state == Job::kCancelled;
        }
        if (ended) {
          dead.push_back(std::move(list[i].second));
          list[i] = std::move(list.back());
          list.pop_back();
        } else {
          ++i;
        }
      }
    }
  }  // dead's references go here, outside the lock
};

class FetchQueue {
 public:
  // background: a read-ahead queue, whose page reads give way to the reader's foreground reads (fetches).
  // nice: the worker's CPU priority (setpriority on its own thread; 0 leaves it as created).
  explicit FetchQueue(bool background = false, int nice = 0) : background_(background), nice_(nice) {
    if (nice < -20 || nice > 19) throw std::invalid_argument("nice must be in -20..19, got " + std::to_string(nice));
    // The worker starts at the first submit, from whichever thread submits (a server's step thread, which may have a
    // CPU of its own): it takes the CPUs of the thread that made the queue instead.
    CPU_ZERO(&cpus_);
    has_cpus_ = pthread_getaffinity_np(pthread_self(), sizeof(cpus_), &cpus_) == 0;
  }

  // The worker's nice value once it started (kNotStarted before): what the kernel granted, which is the requested
  // value unless raising the priority was refused (it needs CAP_SYS_NICE or RLIMIT_NICE).
  static constexpr int kNotStarted = 100;
  int worker_nice() const { return worker_nice_.load(); }
  ~FetchQueue() {
    shutdown(true);
    orphans_->reap();
  }

  const std::shared_ptr<Orphans> &orphans() const { return orphans_; }

  // GIL held.
  void submit(const std::shared_ptr<Job> &job) {
    orphans_->reap();
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stop_) throw std::invalid_argument("the fetch queue is shut down (the table was closed)");
      if (!worker_.joinable()) worker_ = std::thread([this] { loop(); });
      q_.push_back(job);
    }
    // Without the GIL and outside the lock: on a busy machine the woken worker may take this core at once and run
    // the whole fetch before the caller resumes (the caller's wall time then grew with the rows while it held the
    // GIL; now other Python threads run meanwhile), and a worker woken inside the lock would block on it again.
    nb::gil_scoped_release release;
    cv_.notify_one();
  }

  // Stops taking jobs; cancel_pending: queued jobs are cancelled, else they run first. Waits for the running one.
  void shutdown(bool cancel_pending) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
      if (cancel_pending) {
        for (auto &job : q_) {
          bool dropped;
          {
            std::lock_guard<std::mutex> jl(job->mu);
            dropped = job->state == Job::kPending;
            if (dropped) job->state = Job::kCancelled;
            job->cv.notify_all();
          }
          if (dropped && job->on_cancel) job->on_cancel();
        }
        q_.clear();
      }
    }
    cv_.notify_all();
    if (worker_.joinable() && worker_.get_id() != std::this_thread::get_id()) worker_.join();
  }

  // Test hook: the next job waits, once running, until release_held().
  void hold_next() {
    std::lock_guard<std::mutex> lock(hold_mu_);
    hold_ = kArmed;
  }
  bool wait_held(double timeout_s) {
    std::unique_lock<std::mutex> lock(hold_mu_);
    return hold_cv_.wait_for(lock, std::chrono::duration<double>(timeout_s), [&] { return hold_ == kHeld; });
  }
  void release_held() {
    std::lock_guard<std::mutex> lock(hold_mu_);
    hold_ = hold_ == kHeld ? kReleased : kNone;
    hold_cv_.notify_all();
  }

 private:
  void loop() {
    name_this_thread(background_ ? "tiergram-warm" : "tiergram-fetch");
    t_background = background_;
    if (has_cpus_) pthread_setaffinity_np(pthread_self(), sizeof(cpus_), &cpus_);  // refused: stays as created
    // A page read's completion must be reaped and the next read submitted promptly, or the disk's queue drains
    // while the step's compute threads hold the cores; a refused change leaves the thread as it was.
    const auto tid = static_cast<id_t>(syscall(SYS_gettid));
    if (nice_ != 0) setpriority(PRIO_PROCESS, tid, nice_);
    errno = 0;
    const int got = getpriority(PRIO_PROCESS, tid);
    worker_nice_.store(errno == 0 ? got : 0);
    for (;;) {
      std::shared_ptr<Job> job;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !q_.empty(); });
        if (q_.empty()) return;  // stopped and drained
        job = std::move(q_.front());
        q_.pop_front();
      }
      {
        std::lock_guard<std::mutex> jl(job->mu);
        if (job->state != Job::kPending) continue;  // cancelled while queued
        job->state = Job::kRunning;
      }
      {
        std::unique_lock<std::mutex> lock(hold_mu_);
        if (hold_ == kArmed) {
          hold_ = kHeld;
          hold_cv_.notify_all();
          hold_cv_.wait(lock, [&] { return hold_ == kReleased; });
          hold_ = kNone;
        }
      }
      Job::State end = Job::kDone;
      std::exception_ptr error;
      try {
        job->work(&job->cancel);
      } catch (const Cancelled &) {
        end = Job::kCancelled;
      } catch (...) {
        error = std::current_exception();
      }
      std::lock_guard<std::mutex> jl(job->mu);
      job->state = end;
      job->error = error;
      job->work = nullptr;  // what it captured goes now
      job->cv.notify_all();
    }
  }

  bool background_;
  int nice_;
  cpu_set_t cpus_;  // the creating thread's CPUs, the worker's once it starts
  bool has_cpus_ = false;
  std::atomic<int> worker_nice_{kNotStarted};
  std::shared_ptr<Orphans> orphans_ = std::make_shared<Orphans>();
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Job>> q_;
  bool stop_ = false;
  std::thread worker_;
  enum Hold { kNone, kArmed, kHeld, kReleased };
  std::mutex hold_mu_;
  std::condition_variable hold_cv_;
  Hold hold_ = kNone;
};

PyObject *g_cancelled_error = nullptr;  // concurrent.futures.CancelledError

// The Python handle of a queued job. It keeps every array the job reads or writes alive; dropped before the job
// ended (a job runs whether or not anyone waits for it, as a Future does), it leaves them to the queue's orphans.
class FetchJob {
 public:
  FetchJob(std::shared_ptr<Job> job, Keep keep, std::shared_ptr<Orphans> orphans)
      : job_(std::move(job)), keep_(std::move(keep)), orphans_(std::move(orphans)) {}
  FetchJob(const FetchJob &) = delete;
  FetchJob &operator=(const FetchJob &) = delete;
  ~FetchJob() {
    if (!done()) orphans_->add(job_, std::move(keep_));
  }

  bool done() {
    std::lock_guard<std::mutex> lock(job_->mu);
    return job_->state == Job::kDone || job_->state == Job::kCancelled;
  }

  const char *state() {
    std::lock_guard<std::mutex> lock(job_->mu);
    switch (job_->state) {
      case Job::kPending: return "pending";
      case Job::kRunning: return "running";
      case Job::kDone: return "done";
      default: return "cancelled";
    }
  }

  // True once the job ended (timeout_s < 0: no limit); the GIL is released while waiting.
  bool wait(double timeout_s) {
    nb::gil_scoped_release release;
    std::unique_lock<std::mutex> lock(job_->mu);
    auto ended = [&] { return job_->state == Job::kDone || job_->state == Job::kCancelled; };
    if (timeout_s < 0) {
      job_->cv.wait(lock, ended);
      return true;
    }
    return job_->cv.wait_for(lock, std::chrono::duration<double>(timeout_s), ended);
  }

  // Raises the job's error (IndexError, PageReadError, ...) or CancelledError; the job must have ended.
  void result() {
    std::exception_ptr error;
    {
      std::lock_guard<std::mutex> lock(job_->mu);
      if (job_->state == Job::kCancelled) {
        PyErr_SetString(g_cancelled_error, "the fetch was cancelled");
        throw nb::python_error();
      }
      require(job_->state == Job::kDone, "the fetch has not finished");
      error = job_->error;
    }
    if (error) std::rethrow_exception(error);
  }

  // Cancels a queued job (True); a running one is asked to stop at its next phase (False: wait, then look).
  bool cancel() {
    {
      std::lock_guard<std::mutex> lock(job_->mu);
      if (job_->state != Job::kPending) {
        if (job_->state == Job::kRunning) job_->cancel = true;
        return job_->state == Job::kCancelled;
      }
      job_->state = Job::kCancelled;
      job_->cv.notify_all();
    }
    if (job_->on_cancel) job_->on_cancel();  // outside the job's lock: it takes the cache's
    return true;
  }

 private:
  std::shared_ptr<Job> job_;
  Keep keep_;
  std::shared_ptr<Orphans> orphans_;
};

// Queues a job and hands Python its handle; a job that cannot be queued runs its on_cancel (nothing else would).
FetchJob *enqueue(FetchQueue &q, const std::shared_ptr<Job> &job, Keep keep) {
  auto *handle = new FetchJob(job, std::move(keep), q.orphans());
  try {
    q.submit(job);
  } catch (...) {
    if (job->on_cancel) job->on_cancel();  // never queued: e.g. nothing will probe an announced batch
    delete handle;
    throw;
  }
  return handle;
}

FetchJob *submit_fetch(FetchQueue &q, nb::handle reader, nb::handle cache_obj, IdsIn ids, IdsIn head_offsets,
                       IdsIn head_rows, uint64_t rows_per_page, int codec, uint64_t dim, AnyOut out, Counts acc,
                       Counts tier_acc) {
  PageSource &src = nb::cast<PageSource &>(reader);
  NativeRowCache *cache = cache_obj.is_none() ? nullptr : &nb::cast<NativeRowCache &>(cache_obj);
  FetchArgs a = prepare_fetch(src, cache, ids, head_offsets, head_rows, rows_per_page, codec, dim, out, acc, tier_acc);
  auto job = std::make_shared<Job>();
  {
    nb::gil_scoped_release release;  // the caller's arrays stay alive for the call
    check_ids(a.t.view, a.ids, a.n);  // a bad id raises IndexError here, in the caller, not later in wait()
  }
  if (cache && cache->policy() == Policy::kLookahead) {
    // Tell the lookahead policy these rows are coming (sorted distinct keys, as the reference announces them), in
    // queue order; the job's probe retires the batch, a cancellation or a failure before the probe too.
    nb::gil_scoped_release release;
    std::vector<int64_t> uniq;
    sorted_unique(a.t, a.ids, a.n, uniq);
    a.batch = cache->announce(uniq.data(), uniq.size());
    const int64_t batch = a.batch;
    job->on_cancel = [cache, batch] { cache->retire(batch); };
  }
  job->work = [a](const std::atomic<bool> *cancel) { run_fetch(a, cancel); };
  return enqueue(q, job, Keep{nb::borrow(reader), nb::borrow(cache_obj), ids, head_offsets, head_rows, out, acc,
                              tier_acc});
}

FetchJob *submit_warm(FetchQueue &q, nb::handle reader, nb::handle cache_obj, IdsIn ids, IdsIn head_offsets,
                      IdsIn head_rows, uint64_t rows_per_page, int codec, uint64_t dim, Counts acc, Counts tier_acc) {
  PageSource &src = nb::cast<PageSource &>(reader);
  NativeRowCache &cache = nb::cast<NativeRowCache &>(cache_obj);
  const WarmArgs a = prepare_warm(src, cache, ids, head_offsets, head_rows, rows_per_page, codec, dim, acc, tier_acc);
  {
    nb::gil_scoped_release release;
    check_ids(a.t.view, a.ids, a.n);  // a bad id raises IndexError in the caller
  }
  auto job = std::make_shared<Job>();
  job->work = [a](const std::atomic<bool> *cancel) { run_warm(a, cancel); };
  return enqueue(q, job, Keep{nb::borrow(reader), nb::borrow(cache_obj), ids, head_offsets, head_rows, AnyOut(), acc,
                              tier_acc});
}

}  // namespace

void register_pipeline(nb::module_ &m) {
  g_cancelled_error = nb::module_::import_("concurrent.futures").attr("CancelledError").ptr();
  Py_INCREF(g_cancelled_error);
  m.def("fetch", &fetch, nb::arg("reader"), nb::arg("cache").none(), nb::arg("ids").noconvert(),
        nb::arg("head_offsets").noconvert(), nb::arg("head_rows").noconvert(), nb::arg("rows_per_page"),
        nb::arg("codec"), nb::arg("dim"), nb::arg("out").noconvert(), nb::arg("acc").noconvert(),
        nb::arg("tier_acc").noconvert(),
        "Rows of per-head ids int64 [N, H] into out [N, H, D] (f32/bf16) or uint8 [N, H, row_bytes], through the "
        "cache (None: no cache) and the reader, in one call without the GIL. Adds (atomically) into acc int64 "
        "[4H + 4] the ids, distinct rows, hits and misses per head, then lookups, pages read, hit rows and miss "
        "rows; into tier_acc int64 [2] rows and pages read. Returns the pages read. IndexError names head and id; "
        "a page that cannot be read raises PageReadError and admits nothing.");
  m.def("warm", &warm, nb::arg("reader"), nb::arg("cache"), nb::arg("ids").noconvert(),
        nb::arg("head_offsets").noconvert(), nb::arg("head_rows").noconvert(), nb::arg("rows_per_page"),
        nb::arg("codec"), nb::arg("dim"), nb::arg("acc").noconvert(), nb::arg("tier_acc").noconvert(),
        "Read the rows of per-head ids int64 [N, H] that the cache lacks into it (no pins, no probes counted); adds "
        "rows admitted and pages read into acc int64 [2], rows and pages read into tier_acc; returns both.");
  m.def("set_staging_keep_bytes", &set_staging_keep_bytes, nb::arg("bytes"),
        "Test hook: the page bytes a thread's staging buffer keeps (16 MiB); reads of more pages go in chunks of "
        "this size, their rows copied out after each. Returns the previous value.");
  m.def(
      "fetch_timing",
      []() { return std::make_tuple(g_fetch_calls.load(), g_fetch_ns.load(), g_fetch_total_ns.load()); },
      "(calls, nanoseconds without the GIL, nanoseconds in the whole call after argument conversion) of fetch, "
      "over the process.");

  nb::class_<FetchJob>(m, "FetchJob", "A queued fetch or read-ahead; keeps its arrays alive until it ends.")
      .def("done", &FetchJob::done)
      .def_prop_ro("state", &FetchJob::state, "'pending', 'running', 'done' or 'cancelled'.")
      .def("wait", &FetchJob::wait, nb::arg("timeout_s") = -1.0,
           "True once the job ended (timeout_s < 0: wait as long as it takes); the GIL is released meanwhile.")
      .def("result", &FetchJob::result, "Raise the job's error, or CancelledError; nothing if it succeeded.")
      .def("cancel", &FetchJob::cancel,
           "Cancel a queued job (True); a running one is asked to stop at its next phase (returns False).");

  nb::class_<FetchQueue>(m, "FetchQueue",
                         "One C++ worker thread running fetches (and read-aheads) in submission order.")
      .def(nb::init<bool, int>(), nb::arg("background") = false, nb::arg("nice") = 0,
           "background: a read-ahead queue; its page reads give way to the reader's other reads (yield_depth). "
           "nice: its worker thread's CPU priority (-20..19; below 0 needs CAP_SYS_NICE or RLIMIT_NICE).")
      .def_prop_ro(
          "worker_nice",
          [](const FetchQueue &q) -> std::optional<int> {
            const int n = q.worker_nice();
            return n == FetchQueue::kNotStarted ? std::nullopt : std::optional<int>(n);
          },
          "The worker thread's nice value as the kernel set it (None before its first job).")
      .def("fetch", &submit_fetch, nb::arg("reader"), nb::arg("cache").none(), nb::arg("ids").noconvert(),
           nb::arg("head_offsets").noconvert(), nb::arg("head_rows").noconvert(), nb::arg("rows_per_page"),
           nb::arg("codec"), nb::arg("dim"), nb::arg("out").noconvert(), nb::arg("acc").noconvert(),
           nb::arg("tier_acc").noconvert(), nb::rv_policy::take_ownership,
           "Queue what fetch() does; argument errors and out-of-range ids (IndexError) raise here, read errors from "
           "the job's result().")
      .def("warm", &submit_warm, nb::arg("reader"), nb::arg("cache"), nb::arg("ids").noconvert(),
           nb::arg("head_offsets").noconvert(), nb::arg("head_rows").noconvert(), nb::arg("rows_per_page"),
           nb::arg("codec"), nb::arg("dim"), nb::arg("acc").noconvert(), nb::arg("tier_acc").noconvert(),
           nb::rv_policy::take_ownership, "Queue what warm() does.")
      .def(
          "marker",
          [](FetchQueue &q) {
            auto job = std::make_shared<Job>();
            job->work = [](const std::atomic<bool> *) {};
            return enqueue(q, job, Keep{});
          },
          nb::rv_policy::take_ownership, "A job that does nothing: it ends once every job queued before it has.")
      .def(
          "shutdown",
          [](FetchQueue &q, bool cancel_pending) {
            {
              nb::gil_scoped_release release;
              q.shutdown(cancel_pending);
            }
            q.orphans()->reap();  // every job has ended now
          },
          nb::arg("cancel_pending") = true,
          "Take no more jobs; cancel the queued ones (or run them first); wait for the running one.")
      .def("hold_next", &FetchQueue::hold_next, "Test hook: the next job waits, once running, until release_held().")
      .def(
          "wait_held",
          [](FetchQueue &q, double timeout_s) {
            nb::gil_scoped_release release;
            return q.wait_held(timeout_s);
          },
          nb::arg("timeout_s"))
      .def("release_held", &FetchQueue::release_held);
}

}  // namespace tiergram
