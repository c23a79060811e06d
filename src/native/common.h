// Shared pieces of the native core: the worker pool, CRC-32C and page geometry.
#pragma once

#include <pthread.h>

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace tiergram {

// Bad input from the caller: std::invalid_argument, which Python sees as ValueError naming the problem.
inline void require(bool ok, const std::string &what) {
  if (!ok) throw std::invalid_argument(what);
}

// CRC-32C (Castagnoli), reflected, init/final xor 0xFFFFFFFF. `crc` continues a previous value.
uint32_t crc32c(const uint8_t *data, size_t len, uint32_t crc = 0);

// Trailer at the end of every page: u32 page index, u32 CRC-32C of bytes [0, page_size - 4).
constexpr size_t kPageTrailerBytes = 8;

// Writes the trailer of one page (index + checksum) in place.
void seal_page(uint8_t *page, size_t page_size, uint32_t page_index);

// True when the page's trailer matches its contents and its expected index.
bool page_ok(const uint8_t *page, size_t page_size, uint32_t page_index);

// n / d and n % d for n < 2^32 by one 128-bit multiply (Lemire et al., "Faster remainder by direct
// computation"): a hardware 64-bit divide costs ~40 cycles, more than decoding a row's worth of values.
struct FastDiv32 {
  uint64_t d = 1, m = 0;
  FastDiv32() = default;
  explicit FastDiv32(uint64_t divisor) : d(divisor), m(divisor > 1 ? ~uint64_t(0) / divisor + 1 : 0) {}
  uint64_t div(uint64_t n) const {
    return d == 1 ? n : static_cast<uint64_t>((static_cast<unsigned __int128>(m) * n) >> 64);
  }
  uint64_t mod(uint64_t n) const {
    return d == 1 ? 0 : static_cast<uint64_t>((static_cast<unsigned __int128>(m * n) * d) >> 64);
  }
};

// Anonymous memory on a 2 MiB boundary, advised MADV_HUGEPAGE before any page is touched (the kernel backs it with
// transparent huge pages where its THP mode allows); munmap'd by huge_free. Throws std::bad_alloc.
void *huge_alloc(size_t bytes);
void huge_free(void *p, size_t bytes);

// A std::vector allocator that puts large arrays (>= 2 MiB) on huge pages: the row cache's slot array and index
// are read at random, and on 4 KiB pages every access of a large cache is also a TLB miss.
template <typename T>
struct HugeAlloc {
  using value_type = T;
  static constexpr size_t kFrom = size_t{2} << 20;
  HugeAlloc() = default;
  template <typename U>
  HugeAlloc(const HugeAlloc<U> &) {}
  T *allocate(size_t n) {
    if (n * sizeof(T) < kFrom) return std::allocator<T>().allocate(n);
    return static_cast<T *>(huge_alloc(n * sizeof(T)));
  }
  void deallocate(T *p, size_t n) {
    if (n * sizeof(T) < kFrom) return std::allocator<T>().deallocate(p, n);
    huge_free(p, n * sizeof(T));
  }
  template <typename U>
  bool operator==(const HugeAlloc<U> &) const { return true; }
  template <typename U>
  bool operator!=(const HugeAlloc<U> &) const { return false; }
};

template <typename T>
using HugeVector = std::vector<T, HugeAlloc<T>>;

// Where global row `row` lives: byte offset from the start of the data region.
struct PageGeometry {
  uint64_t page_size = 4096;
  uint64_t rows_per_page = 1;
  uint64_t row_bytes = 1;
  FastDiv32 per_page{1};  // valid for rows < 2^32; larger row spaces take the plain divide
  PageGeometry() = default;
  PageGeometry(uint64_t ps, uint64_t rpp, uint64_t rb) : page_size(ps), rows_per_page(rpp), row_bytes(rb), per_page(rpp) {}
  uint64_t row_offset(uint64_t row) const {
    if (row >> 32) return (row / rows_per_page) * page_size + (row % rows_per_page) * row_bytes;
    return per_page.div(row) * page_size + per_page.mod(row) * row_bytes;
  }
};

// A small persistent pool; parallel_for splits [0, n) into chunks run by the workers and the caller.
// Names the calling thread (at most 15 characters) as `top -H`, `perf` and py-spy show it.
inline void name_this_thread(const char *name) { pthread_setname_np(pthread_self(), name); }

class WorkerPool {
 public:
  explicit WorkerPool(unsigned n_threads);
  ~WorkerPool();
  unsigned size() const { return static_cast<unsigned>(workers_.size()) + 1; }
  // Runs fn(begin, end) over chunks of at least `grain` items; returns when all are done.
  void parallel_for(size_t n, size_t grain, const std::function<void(size_t, size_t)> &fn);

 private:
  void worker_loop();
  void run_chunks();
  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable cv_work_, cv_done_;
  const std::function<void(size_t, size_t)> *job_ = nullptr;
  size_t job_n_ = 0, job_grain_ = 1;
  std::atomic<size_t> next_{0};
  unsigned active_ = 0;
  uint64_t generation_ = 0;
  bool stop_ = false;
  std::mutex call_mu_;  // one parallel_for at a time
};

// The process-wide pool used by gathers (sized by set_num_threads, default: hardware threads). Callers hold the
// returned pointer for as long as they use the pool: set_num_threads swaps in a new pool, and the old one is
// destroyed (its workers joined) only when the last call running on it lets go.
std::shared_ptr<WorkerPool> global_pool();
void set_num_threads(unsigned n);

}  // namespace tiergram
