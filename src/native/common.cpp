// CRC-32C, page trailers and the worker pool.
#include "common.h"

#include <sys/mman.h>

#include <memory>
#include <new>
#include <utility>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace tiergram {

namespace {

struct Crc32cTable {
  uint32_t t[8][256];
  Crc32cTable() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
      t[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; ++i)
      for (int s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xFF];
  }
};

uint32_t crc32c_soft(const uint8_t *p, size_t n, uint32_t c) {
  static const Crc32cTable tab;
  while (n >= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    v ^= c;
    c = tab.t[7][v & 0xFF] ^ tab.t[6][(v >> 8) & 0xFF] ^ tab.t[5][(v >> 16) & 0xFF] ^
        tab.t[4][(v >> 24) & 0xFF] ^ tab.t[3][(v >> 32) & 0xFF] ^ tab.t[2][(v >> 40) & 0xFF] ^
        tab.t[1][(v >> 48) & 0xFF] ^ tab.t[0][v >> 56];
    p += 8;
    n -= 8;
  }
  while (n--) c = (c >> 8) ^ tab.t[0][(c ^ *p++) & 0xFF];
  return c;
}

#if defined(__x86_64__)
// The crc32 instruction has a 3-cycle latency and a 1-cycle throughput, so one stream runs at a third of the
// instruction's speed. Three streams over consecutive blocks of kBlock bytes run in parallel and are joined by
// shifting a block's CRC over the next block's length (a linear map on the 32-bit CRC, tabulated once), as in
// Mark Adler's crc32c.c (zlib licence) and Intel's "Fast CRC Computation for iSCSI Polynomial Using CRC32
// Instruction".
constexpr size_t kBlock = 256;  // 3 x 256 B per round: a 4 KiB page's 4,092 checked bytes take 5 rounds

// Multiplies the 32x32 GF(2) matrix mat (columns) by the vector vec.
uint32_t gf2_times(const uint32_t *mat, uint32_t vec) {
  uint32_t sum = 0;
  while (vec) {
    if (vec & 1) sum ^= *mat;
    vec >>= 1;
    ++mat;
  }
  return sum;
}

// square = mat * mat.
void gf2_square(uint32_t *square, const uint32_t *mat) {
  for (int n = 0; n < 32; ++n) square[n] = gf2_times(mat, mat[n]);
}

// Tables that shift a (pre-/post-conditioning free) CRC over `len` zero bytes: four byte-indexed lookups.
struct ShiftTable {
  uint32_t t[4][256];
  explicit ShiftTable(size_t len) {
    uint32_t op[32], even[32], odd[32];
    odd[0] = 0x82F63B78u;  // the operator for one zero bit
    for (int n = 1; n < 32; ++n) odd[n] = 1u << (n - 1);
    gf2_square(even, odd);  // two zero bits
    gf2_square(odd, even);  // four zero bits
    // apply len zero bytes: square for each bit of len (starting at one byte = 8 bits)
    uint32_t *cur = odd, *nxt = even;
    for (int n = 0; n < 32; ++n) op[n] = 1u << n;  // identity
    bool first = true;
    do {
      gf2_square(nxt, cur);  // the first square gives 8 bits = one byte
      std::swap(cur, nxt);
      if (len & 1) {
        if (first) {
          std::memcpy(op, cur, sizeof op);
          first = false;
        } else {
          uint32_t tmp[32];
          for (int n = 0; n < 32; ++n) tmp[n] = gf2_times(cur, op[n]);
          std::memcpy(op, tmp, sizeof op);
        }
      }
      len >>= 1;
    } while (len);
    for (uint32_t b = 0; b < 256; ++b) {
      t[0][b] = gf2_times(op, b);
      t[1][b] = gf2_times(op, b << 8);
      t[2][b] = gf2_times(op, b << 16);
      t[3][b] = gf2_times(op, b << 24);
    }
  }
  uint32_t shift(uint32_t crc) const {
    return t[0][crc & 0xFF] ^ t[1][(crc >> 8) & 0xFF] ^ t[2][(crc >> 16) & 0xFF] ^ t[3][crc >> 24];
  }
};

__attribute__((target("sse4.2"))) uint32_t crc32c_hw(const uint8_t *p, size_t n, uint32_t c) {
  static const ShiftTable block_shift(kBlock);
  uint64_t c0 = c;
  while (n > 0 && (reinterpret_cast<uintptr_t>(p) & 7)) {
    c0 = _mm_crc32_u8(static_cast<uint32_t>(c0), *p++);
    --n;
  }
  while (n >= 3 * kBlock) {
    uint64_t c1 = 0, c2 = 0;
    for (size_t i = 0; i < kBlock; i += 8) {
      uint64_t v0, v1, v2;
      std::memcpy(&v0, p + i, 8);
      std::memcpy(&v1, p + kBlock + i, 8);
      std::memcpy(&v2, p + 2 * kBlock + i, 8);
      c0 = _mm_crc32_u64(c0, v0);
      c1 = _mm_crc32_u64(c1, v1);
      c2 = _mm_crc32_u64(c2, v2);
    }
    c0 = block_shift.shift(static_cast<uint32_t>(c0)) ^ static_cast<uint32_t>(c1);
    c0 = block_shift.shift(static_cast<uint32_t>(c0)) ^ static_cast<uint32_t>(c2);
    p += 3 * kBlock;
    n -= 3 * kBlock;
  }
  while (n >= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    c0 = _mm_crc32_u64(c0, v);
    p += 8;
    n -= 8;
  }
  while (n--) c0 = _mm_crc32_u8(static_cast<uint32_t>(c0), *p++);
  return static_cast<uint32_t>(c0);
}
#endif

}  // namespace

constexpr size_t kHugePage = size_t{2} << 20;

size_t huge_round(size_t bytes) { return (bytes + kHugePage - 1) & ~(kHugePage - 1); }

void *huge_alloc(size_t bytes) {
  const size_t size = huge_round(bytes);
  // map one huge page more than needed and trim the ends, so that the region starts on a 2 MiB boundary
  void *p = mmap(nullptr, size + kHugePage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw std::bad_alloc();
  const uintptr_t base = reinterpret_cast<uintptr_t>(p);
  const uintptr_t start = (base + kHugePage - 1) & ~(uintptr_t{kHugePage} - 1);
  if (start > base) munmap(p, start - base);
  if (const size_t tail = base + size + kHugePage - (start + size)) munmap(reinterpret_cast<void *>(start + size), tail);
#ifdef MADV_HUGEPAGE
  madvise(reinterpret_cast<void *>(start), size, MADV_HUGEPAGE);  // advice: where THP is off, 4 KiB pages serve
#endif
  return reinterpret_cast<void *>(start);
}

void huge_free(void *p, size_t bytes) {
  if (p) munmap(p, huge_round(bytes));
}

uint32_t crc32c(const uint8_t *data, size_t len, uint32_t crc) {
  uint32_t c = ~crc;
#if defined(__x86_64__)
  static const bool hw = __builtin_cpu_supports("sse4.2");
  c = hw ? crc32c_hw(data, len, c) : crc32c_soft(data, len, c);
#else
  c = crc32c_soft(data, len, c);
#endif
  return ~c;
}

void seal_page(uint8_t *page, size_t page_size, uint32_t page_index) {
  std::memcpy(page + page_size - 8, &page_index, 4);
  const uint32_t c = crc32c(page, page_size - 4);
  std::memcpy(page + page_size - 4, &c, 4);
}

bool page_ok(const uint8_t *page, size_t page_size, uint32_t page_index) {
  uint32_t stored_index, stored_crc;
  std::memcpy(&stored_index, page + page_size - 8, 4);
  std::memcpy(&stored_crc, page + page_size - 4, 4);
  return stored_index == page_index && stored_crc == crc32c(page, page_size - 4);
}

WorkerPool::WorkerPool(unsigned n_threads) {
  for (unsigned i = 1; i < (n_threads ? n_threads : 1); ++i) workers_.emplace_back([this] { worker_loop(); });
}

WorkerPool::~WorkerPool() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_work_.notify_all();
  for (auto &t : workers_) t.join();
}

void WorkerPool::run_chunks() {
  for (;;) {
    const size_t begin = next_.fetch_add(job_grain_);
    if (begin >= job_n_) return;
    (*job_)(begin, std::min(job_n_, begin + job_grain_));
  }
}

void WorkerPool::worker_loop() {
  name_this_thread("tiergram-gather");
  uint64_t seen = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_work_.wait(lk, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      ++active_;
    }
    run_chunks();
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (--active_ == 0) cv_done_.notify_all();
    }
  }
}

void WorkerPool::parallel_for(size_t n, size_t grain, const std::function<void(size_t, size_t)> &fn) {
  if (n == 0) return;
  grain = std::max<size_t>(grain, 1);
  if (workers_.empty() || n <= grain) {
    fn(0, n);
    return;
  }
  std::lock_guard<std::mutex> call(call_mu_);
  {
    std::lock_guard<std::mutex> lk(mu_);
    job_ = &fn;
    job_n_ = n;
    job_grain_ = std::max(grain, n / (size() * 8) + 1);
    next_.store(0);
    ++generation_;
  }
  cv_work_.notify_all();
  run_chunks();
  std::unique_lock<std::mutex> lk(mu_);
  // Workers that woke late find no chunks left and leave at once; wait for those still running.
  cv_done_.wait(lk, [&] { return active_ == 0 && next_.load() >= job_n_; });
  job_ = nullptr;
}

namespace {
std::mutex g_pool_mu;
std::shared_ptr<WorkerPool> g_pool;
}  // namespace

std::shared_ptr<WorkerPool> global_pool() {
  std::lock_guard<std::mutex> lk(g_pool_mu);
  if (!g_pool) g_pool = std::make_shared<WorkerPool>(std::max(1u, std::thread::hardware_concurrency()));
  return g_pool;
}

void set_num_threads(unsigned n) {
  auto fresh = std::make_shared<WorkerPool>(std::max(1u, n));
  std::shared_ptr<WorkerPool> old;
  {
    std::lock_guard<std::mutex> lk(g_pool_mu);
    old = std::move(g_pool);
    g_pool = std::move(fresh);
  }
  // `old` is released here, outside the lock; if a gather still runs on it, that gather's reference keeps it
  // alive and it is joined when the gather returns.
}

}  // namespace tiergram
