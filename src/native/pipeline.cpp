// The fetch pipeline: one lookup (or read-ahead) of a file-tier table in one native call, the GIL released for
// all of it — bounds check, dedup, cache probe (hits pinned), one batched read of the missing pages (verified),
// admission, gather + dequantise of hits and misses into the output, unpin, per-head counts.
#include <nanobind/stl/pair.h>
#include <nanobind/stl/tuple.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
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
constexpr size_t kStagingKeepBytes = 16 << 20;  // staging a thread keeps between calls; larger calls allocate

struct AlignedBuffer {
  uint8_t *p = nullptr;
  size_t n = 0;
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
    return p;
  }
};

// Each thread reuses its staging buffer: a fresh one per call costs its page faults (the kernel pins and zero-fills
// every page it DMAs into), about 4% of a 6,000-page lookup.
thread_local AlignedBuffer t_staging;

uint8_t *staging(size_t bytes, AlignedBuffer &oversize) {
  if (bytes > kStagingKeepBytes) return oversize.reserve(bytes);
  return t_staging.reserve(std::max(bytes, std::min(kStagingKeepBytes, 2 * t_staging.n)));
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

int64_t fetch_impl(PageSource &src, NativeRowCache *cache, IdsIn ids, IdsIn head_offsets, IdsIn head_rows,
              uint64_t rows_per_page, int codec, uint64_t dim, AnyOut out, Counts acc, Counts tier_acc) {
  const Table t = make_table(src, head_offsets, head_rows, rows_per_page, codec, dim);
  const uint64_t H = t.n_heads, row_bytes = t.view.geo.row_bytes;
  require(cache == nullptr || cache->row_bytes() == row_bytes,
          "cache rows are " + std::to_string(cache ? cache->row_bytes() : 0) + " bytes, the table's " +
              std::to_string(row_bytes));
  require(ids.size() % H == 0, "row ids: last dimension must equal the table's " + std::to_string(H) + " heads");
  require(acc.size() == 4 * H + 4, "acc must be int64 [4 * H + 4] = [" + std::to_string(4 * H + 4) + "]");
  require(tier_acc.size() == 2, "tier_acc must be int64 [2]");
  const OutKind kind = out_kind(out);
  check_out_size(out, kind, ids.size(), dim, row_bytes);
  const int64_t *id = ids.data();
  const size_t n = ids.size();
  int64_t *sum = acc.data(), *tier_sum = tier_acc.data();
  void *dst = out.data();

  nb::gil_scoped_release release;
  const auto t0 = std::chrono::steady_clock::now();
  struct Clock {
    std::chrono::steady_clock::time_point t0;
    ~Clock() {
      g_fetch_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
      ++g_fetch_calls;
    }
  } clock{t0};
  check_ids(t.view, id, n);  // RowIndexError -> IndexError naming head, id and position
  if (n == 0) {
    add(sum + 4 * H, 1);
    return 0;
  }
  require(n < (uint64_t{1} << 32), "a lookup of " + std::to_string(n) + " ids is over the 2^32 limit");
  Dedup d;
  dedup(t, id, n, d);
  const std::vector<int64_t> &uniq = d.uniq;
  std::vector<int64_t> slots(uniq.size(), -1);
  if (cache) {
    std::lock_guard<std::mutex> lock(cache->mutex());
    cache->probe_locked(uniq.data(), uniq.size(), slots.data());
  }
  Unpin unpin{cache, slots};
  if (cache) cache->maybe_hold();

  // Misses in row order, so that rows sharing a page are read once and the pages go to the disk in file order.
  std::vector<std::pair<int64_t, size_t>> miss_at;
  for (size_t u = 0; u < uniq.size(); ++u)
    if (slots[u] < 0) miss_at.emplace_back(uniq[u], u);
  std::sort(miss_at.begin(), miss_at.end());
  std::vector<int64_t> miss(miss_at.size());
  std::vector<size_t> miss_u(miss_at.size());
  for (size_t j = 0; j < miss_at.size(); ++j) miss[j] = miss_at[j].first, miss_u[j] = miss_at[j].second;
  std::vector<int64_t> pages;
  std::vector<uint64_t> at;
  plan_pages(t, miss, pages, at);
  AlignedBuffer oversize;
  uint8_t *buf = staging(pages.size() * t.view.geo.page_size, oversize);
  src.read_nogil(pages.data(), pages.size(), buf, true);

  // Hits decode from their pinned slots; misses from the staging buffer (an admitted row may be evicted by a
  // concurrent lookup before this one's gather runs, its staged copy cannot).
  std::vector<const uint8_t *> rows(uniq.size());
  for (size_t u = 0; u < uniq.size(); ++u)
    if (slots[u] >= 0) rows[u] = cache->row(slots[u]);
  std::vector<const uint8_t *> miss_rows(miss.size());
  for (size_t j = 0; j < miss.size(); ++j) rows[miss_u[j]] = miss_rows[j] = buf + at[j];
  if (cache && !miss.empty()) {
    std::lock_guard<std::mutex> lock(cache->mutex());
    cache->admit_locked(miss.data(), miss.size(), miss_rows.data(), true);
  }
  gather_located(rows.data(), d.which.data(), n, kind, codec, dim, row_bytes, dst);

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
  add(sum + 4 * H + 1, static_cast<int64_t>(pages.size()));
  add(sum + 4 * H + 2, static_cast<int64_t>(uniq.size() - miss.size()));
  add(sum + 4 * H + 3, static_cast<int64_t>(miss.size()));
  add(tier_sum, static_cast<int64_t>(miss.size()));
  add(tier_sum + 1, static_cast<int64_t>(pages.size()));
  return static_cast<int64_t>(pages.size());
}

// The whole call once its arguments are converted, GIL reacquisition included (fetch_impl times its GIL-free part).
int64_t fetch(PageSource &src, NativeRowCache *cache, IdsIn ids, IdsIn head_offsets, IdsIn head_rows,
              uint64_t rows_per_page, int codec, uint64_t dim, AnyOut out, Counts acc, Counts tier_acc) {
  const auto t0 = std::chrono::steady_clock::now();
  struct Clock {
    std::chrono::steady_clock::time_point t0;
    ~Clock() {
      g_fetch_total_ns +=
          std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
    }
  } clock{t0};
  return fetch_impl(src, cache, ids, head_offsets, head_rows, rows_per_page, codec, dim, out, acc, tier_acc);
}

std::pair<int64_t, int64_t> warm(PageSource &src, NativeRowCache &cache, IdsIn ids, IdsIn head_offsets,
                                 IdsIn head_rows, uint64_t rows_per_page, int codec, uint64_t dim) {
  const Table t = make_table(src, head_offsets, head_rows, rows_per_page, codec, dim);
  require(cache.row_bytes() == t.view.geo.row_bytes, "cache rows are " + std::to_string(cache.row_bytes()) +
                                                         " bytes, the table's " + std::to_string(t.view.geo.row_bytes));
  require(ids.size() % t.n_heads == 0,
          "row ids: last dimension must equal the table's " + std::to_string(t.n_heads) + " heads");
  const int64_t *id = ids.data();
  const size_t n = ids.size();

  nb::gil_scoped_release release;
  check_ids(t.view, id, n);
  std::vector<int64_t> uniq, miss;
  sorted_unique(t, id, n, uniq);
  {
    std::lock_guard<std::mutex> lock(cache.mutex());
    for (int64_t k : uniq)
      if (!cache.contains_locked(k)) miss.push_back(k);
  }
  if (miss.empty()) return {0, 0};
  std::vector<int64_t> pages;
  std::vector<uint64_t> at;
  plan_pages(t, miss, pages, at);
  AlignedBuffer oversize;
  uint8_t *buf = staging(pages.size() * t.view.geo.page_size, oversize);
  src.read_nogil(pages.data(), pages.size(), buf, true);
  std::vector<const uint8_t *> rows(miss.size());
  for (size_t j = 0; j < miss.size(); ++j) rows[j] = buf + at[j];
  std::lock_guard<std::mutex> lock(cache.mutex());
  const uint64_t entered = cache.admit_locked(miss.data(), miss.size(), rows.data(), true);
  return {static_cast<int64_t>(entered), static_cast<int64_t>(pages.size())};
}

}  // namespace

void register_pipeline(nb::module_ &m) {
  m.def("fetch", &fetch, nb::arg("reader"), nb::arg("cache").none(), nb::arg("ids").noconvert(),
        nb::arg("head_offsets").noconvert(), nb::arg("head_rows").noconvert(), nb::arg("rows_per_page"),
        nb::arg("codec"), nb::arg("dim"), nb::arg("out").noconvert(), nb::arg("acc").noconvert(),
        nb::arg("tier_acc").noconvert(),
        "Rows of per-head ids int64 [N, H] into out [N, H, D] (f32/bf16) or uint8 [N, H, row_bytes], through the "
        "cache (None: no cache) and the reader, in one call without the GIL. Adds (atomically) into acc int64 "
        "[4H + 4] the ids, distinct rows, hits and misses per head, then lookups, pages read, hit rows and miss "
        "rows; into tier_acc int64 [2] rows and pages read. Returns the pages read. IndexError names head and id; "
        "a page that cannot be read raises PageReadError and admits nothing.");
  m.def(
      "fetch_timing",
      []() { return std::make_tuple(g_fetch_calls.load(), g_fetch_ns.load(), g_fetch_total_ns.load()); },
      "(calls, nanoseconds without the GIL, nanoseconds in the whole call after argument conversion) of fetch, "
      "over the process.");
  m.def("warm", &warm, nb::arg("reader"), nb::arg("cache"), nb::arg("ids").noconvert(),
        nb::arg("head_offsets").noconvert(), nb::arg("head_rows").noconvert(), nb::arg("rows_per_page"),
        nb::arg("codec"), nb::arg("dim"),
        "Read the rows of per-head ids int64 [N, H] that the cache lacks into it (no pins, no probes counted); "
        "returns (rows admitted, pages read).");
}

}  // namespace tiergram
