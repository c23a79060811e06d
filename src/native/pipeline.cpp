// The fetch pipeline's algorithm (pipeline.h): staging, dedup, page planning, the fetch and the read-ahead.
#include "pipeline.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "decode.h"

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
std::atomic<size_t> g_staging_keep{kStagingKeepBytes};

// The pages of sorted rows (plan_pages: pages, and at[j] = row j's byte offset were all pages staged at once) read
// through this thread's staging buffer, verified; returns each row's encoded bytes. The pointers are valid until
// this thread's next read: into the staging buffer when the pages fit it, else into compact copies of the rows
// made after each chunk of pages.
std::vector<const uint8_t *> read_rows(PageSource &src, const std::vector<int64_t> &pages,
                                       const std::vector<uint64_t> &at, uint64_t page_size, uint64_t row_bytes,
                                       bool background) {
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
    src.read_nogil(pages.data() + p0, p1 - p0, t_staging.p, true, &area, background);
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

// Statistics are added into caller-owned counters atomically (several threads fetch from one table at once), so
// that a lookup costs Python no bookkeeping per call.
inline void add(int64_t *at, int64_t v) {
  if (v) __atomic_fetch_add(at, v, __ATOMIC_RELAXED);
}

// Retires an announced batch unless the probe (which retires it itself) was reached.
struct RetireUnlessProbed {
  NativeRowCache *cache;
  int64_t batch;
  ~RetireUnlessProbed() {
    if (cache && batch >= 0) cache->retire(batch);
  }
};

}  // namespace

size_t set_staging_keep_bytes(size_t bytes) {
  require(bytes >= kAlign && bytes % kAlign == 0 && bytes <= (size_t{1} << 30),
          "staging bytes must be a multiple of 4096 in [4096, 2^30], got " + std::to_string(bytes));
  return g_staging_keep.exchange(bytes);
}

Table make_table(const PageSource &src, const int64_t *head_offsets, const int64_t *head_rows, uint64_t n_heads,
                 uint64_t rows_per_page, int codec, uint64_t dim) {
  const uint64_t row_bytes = codec_row_bytes(codec, dim);
  require(row_bytes > 0, "invalid codec " + std::to_string(codec) + " for dim " + std::to_string(dim));
  const uint64_t page_size = src.page_size();
  require(rows_per_page >= 1 && row_bytes + kPageTrailerBytes <= page_size &&
              rows_per_page <= (page_size - kPageTrailerBytes) / row_bytes,
          "page geometry does not fit: " + std::to_string(rows_per_page) + " rows of " + std::to_string(row_bytes) +
              " bytes in a " + std::to_string(page_size) + "-byte page");
  require(n_heads > 0, "a table needs at least one head");
  for (uint64_t h = 1; h < n_heads; ++h)
    require(head_offsets[h] > head_offsets[h - 1], "head_offsets must increase (head " + std::to_string(h) + ")");
  Table t;
  t.view.data_bytes = src.n_pages() * page_size;
  t.view.geo = PageGeometry(page_size, rows_per_page, row_bytes);
  t.view.head_offsets = head_offsets;
  t.view.head_rows = head_rows;
  t.view.n_heads = n_heads;
  t.view.codec = codec;
  t.view.dim = dim;
  t.head_offsets = head_offsets;
  t.n_heads = n_heads;
  return t;
}

void sorted_unique(const Table &t, const int64_t *ids, size_t n, std::vector<int64_t> &uniq) {
  uniq.resize(n);
  for (size_t i = 0; i < n; ++i) uniq[i] = ids[i] + t.head_offsets[i % t.n_heads];
  std::sort(uniq.begin(), uniq.end());
  uniq.erase(std::unique(uniq.begin(), uniq.end()), uniq.end());
}

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
    const std::vector<const uint8_t *> staged =
        read_rows(*a.src, pages, at, t.view.geo.page_size, row_bytes, a.background);
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
  const std::vector<const uint8_t *> rows =
      read_rows(*a.src, pages, at, t.view.geo.page_size, t.view.geo.row_bytes, a.background);
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

}  // namespace tiergram
