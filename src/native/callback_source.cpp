// A page source whose reads a Python callable makes (a remote tier: Mooncake's client is Python-only), so that such
// a tier runs the same native fetch pipeline as the file tier: dedup, cache probe, admission, decode and the
// in-flight sharing stay native, and Python is called once per batch of missed pages, not per row.
#include <cstring>
#include <string>

#include "bindings.h"
#include "file_reader.h"

namespace tiergram {
namespace {

using BytesView = nb::ndarray<const uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

class CallbackPageSource : public PageSource {
 public:
  CallbackPageSource(nb::callable read_pages, uint64_t page_size, uint64_t n_pages)
      : read_pages_(std::move(read_pages)), page_size_(page_size), n_pages_(n_pages) {
    require(page_size > 0, "page_size must be positive");
  }

  // Takes the GIL for the call: read_pages(int64 [m]) must return the verified pages as uint8 [m * page_size] (or
  // raise, e.g. PageReadError naming table and page: the error reaches the ticket unchanged).
  void read_nogil(const int64_t *ids, size_t m, uint8_t *out, bool, const StagingArea *, bool) override {
    if (m == 0) return;
    nb::gil_scoped_acquire gil;
    if (!read_pages_.is_valid()) throw std::invalid_argument("the page source is closed");
    int64_t *copy = new int64_t[m];
    std::memcpy(copy, ids, m * sizeof(int64_t));
    nb::capsule owner(copy, [](void *p) noexcept { delete[] static_cast<int64_t *>(p); });
    const size_t shape[1] = {m};
    nb::object pages = nb::cast(nb::ndarray<nb::numpy, int64_t, nb::ndim<1>>(copy, 1, shape, owner));
    nb::object got = read_pages_(pages);
    BytesView bytes;
    if (!nb::try_cast(got, bytes, false))  // no conversion: other dtypes are refused, never cast
      throw std::invalid_argument("read_pages must return a contiguous uint8 array, got " +
                                  std::string(nb::str(nb::type_name(got.type())).c_str()));
    const uint64_t want = m * page_size_;
    if (bytes.size() < want)
      throw std::invalid_argument("read_pages returned " + std::to_string(bytes.size()) + " bytes for " +
                                  std::to_string(m) + " pages of " + std::to_string(page_size_) + " bytes");
    std::memcpy(out, bytes.data(), want);
  }
  uint64_t page_size() const override { return page_size_; }
  uint64_t n_pages() const override { return n_pages_; }

  void close() { read_pages_.reset(); }  // GIL held: lets go of the callable (and what it keeps alive)

 private:
  nb::callable read_pages_;
  uint64_t page_size_, n_pages_;
};

}  // namespace

void register_callback_source(nb::module_ &m) {
  nb::class_<CallbackPageSource, PageSource>(
      m, "CallbackPageSource",
      "A page source for the native fetch pipeline whose reads a Python callable makes: read_pages(pages int64 "
      "[m]) -> the verified pages as uint8 [m * page_size] (it takes the GIL once per batch of missed pages).")
      .def(nb::init<nb::callable, uint64_t, uint64_t>(), nb::arg("read_pages"), nb::arg("page_size"),
           nb::arg("n_pages"))
      .def_prop_ro("page_size", &CallbackPageSource::page_size)
      .def_prop_ro("n_pages", &CallbackPageSource::n_pages)
      .def("close", &CallbackPageSource::close, "Let go of the callable; later reads raise ValueError.");
}

}  // namespace tiergram
