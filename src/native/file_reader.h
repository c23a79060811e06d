// What the fetch pipeline needs of a page reader: whole pages into a buffer, verified, without the GIL.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "uring.h"  // StagingArea

namespace tiergram {

class PageSource {
 public:
  virtual ~PageSource() = default;
  // Reads page ids[i] (each < n_pages(), checked by the caller) into out + i * page_size(), out aligned to 4096;
  // re-reads a failed page once, then throws (PageReadFailure -> PageReadError naming file and page). Called
  // without the GIL; throws std::invalid_argument once the reader is closed. area: the staging buffer `out` lies
  // in, when it is one (nullptr otherwise). background: a read-ahead, which gives way to the reader's other reads
  // (see PageReader's yield_depth).
  virtual void read_nogil(const int64_t *ids, size_t m, uint8_t *out, bool verify,
                          const StagingArea *area = nullptr, bool background = false) = 0;
  virtual uint64_t page_size() const = 0;
  virtual uint64_t n_pages() const = 0;
};

}  // namespace tiergram
