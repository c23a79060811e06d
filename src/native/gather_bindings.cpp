// Python bindings of checksums and gathers; all heavy work runs with the GIL released.
#include <optional>
#include <vector>

#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "bindings.h"
#include "decode.h"
#include "gather.h"

namespace tiergram {

OutKind out_kind(const AnyOut &out) {
  const nb::dlpack::dtype dt = out.dtype();
  if (dt == nb::dtype<float>()) return OutKind::kF32;
  if (dt == nb::dtype<uint16_t>() || (dt.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Bfloat) && dt.bits == 16))
    return OutKind::kBf16;
  if (dt == nb::dtype<uint8_t>()) return OutKind::kRaw;
  throw std::invalid_argument("out must be float32, bfloat16 (or uint16 bf16 bits) or uint8 (raw rows)");
}

void check_out_size(const AnyOut &out, OutKind kind, uint64_t n, uint64_t dim, uint64_t row_bytes) {
  const uint64_t want = n * (kind == OutKind::kRaw ? row_bytes : dim);
  require(out.size() == want, "out has " + std::to_string(out.size()) + " elements, expected " +
                                  std::to_string(want) + " (" + std::to_string(n) + " rows)");
}

namespace {

// The checked view of a table's rows for gathers (the geometry's overflow and fit checks in one place).
TableView table_view(BytesIn data, IdsIn head_offsets, IdsIn head_rows, uint64_t page_size, uint64_t rows_per_page,
                     int codec, uint64_t dim) {
  const uint64_t row_bytes = codec_row_bytes(codec, dim);
  require(row_bytes > 0, "invalid codec " + std::to_string(codec) + " for dim " + std::to_string(dim));
  // division, not multiplication: rows_per_page * row_bytes could wrap around
  require(page_size >= 512 && page_size <= (uint64_t(1) << 31) && rows_per_page >= 1 &&
              row_bytes + kPageTrailerBytes <= page_size && rows_per_page <= (page_size - kPageTrailerBytes) / row_bytes,
          "page geometry does not fit: " + std::to_string(rows_per_page) + " rows of " +
              std::to_string(row_bytes) + " bytes in a " + std::to_string(page_size) + "-byte page");
  require(head_offsets.size() == head_rows.size(), "head_offsets and head_rows differ in length");
  TableView t;
  t.data = data.data();
  t.data_bytes = data.size();
  t.geo = PageGeometry(page_size, rows_per_page, row_bytes);
  t.head_offsets = head_offsets.data();
  t.head_rows = head_rows.data();
  t.n_heads = head_offsets.size();
  t.codec = codec;
  t.dim = dim;
  return t;
}

void gather(BytesIn data, IdsIn ids, IdsIn head_offsets, IdsIn head_rows, uint64_t page_size,
            uint64_t rows_per_page, int codec, uint64_t dim, AnyOut out, std::optional<bool> stream) {
  const TableView t = table_view(data, head_offsets, head_rows, page_size, rows_per_page, codec, dim);
  const OutKind kind = out_kind(out);
  check_out_size(out, kind, ids.size(), dim, t.geo.row_bytes);
  nb::gil_scoped_release release;
  check_ids(t, ids.data(), ids.size());
  gather_rows(t, ids.data(), ids.size(), kind, out.data(), stream ? int(*stream) : -1);
}

void gather_limit_py(BytesIn data, IdsIn ids, IdsIn head_offsets, IdsIn head_rows, uint64_t page_size,
                     uint64_t rows_per_page, int codec, uint64_t dim, BytesOut out, bool stream, uint64_t ahead) {
  const TableView t = table_view(data, head_offsets, head_rows, page_size, rows_per_page, codec, dim);
  require(ids.size() > 0 && out.size() % ids.size() == 0 && (out.size() / ids.size()) % 16 == 0,
          "out has " + std::to_string(out.size()) + " bytes: it must hold the same whole number of 16-byte chunks for "
          "each of the " + std::to_string(ids.size()) + " ids");
  nb::gil_scoped_release release;
  check_ids(t, ids.data(), ids.size());
  gather_limit(t, ids.data(), ids.size(), out.size() / ids.size(), stream, ahead, out.data());
}

void check_ids_py(IdsIn ids, IdsIn head_rows) {
  std::vector<int64_t> offsets(head_rows.size(), 0);
  TableView t;  // only the head row counts matter here; the data bound is checked by the reading tier
  t.head_offsets = offsets.data();
  t.head_rows = head_rows.data();
  t.n_heads = head_rows.size();
  t.geo = PageGeometry(4096, 1, 1);
  t.data_bytes = UINT64_MAX;
  nb::gil_scoped_release release;
  check_ids(t, ids.data(), ids.size());
}

void decode_at_py(BytesIn src, IdsIn offsets, int codec, uint64_t dim, AnyOut out) {
  const uint64_t row_bytes = codec_row_bytes(codec, dim);
  require(row_bytes > 0, "invalid codec " + std::to_string(codec) + " for dim " + std::to_string(dim));
  const OutKind kind = out_kind(out);
  check_out_size(out, kind, offsets.size(), dim, row_bytes);
  nb::gil_scoped_release release;
  decode_at(src.data(), src.size(), offsets.data(), offsets.size(), codec, dim, kind, out.data());
}

void check_pages_arg(uint64_t n_bytes, uint64_t page_size) {
  require(page_size >= 512 && (page_size & (page_size - 1)) == 0, "page_size must be a power of two >= 512");
  require(n_bytes % page_size == 0, "buffer of " + std::to_string(n_bytes) + " bytes is not whole pages of " +
                                        std::to_string(page_size));
}

void seal_pages(BytesOut pages, uint64_t page_size, uint64_t first_index) {
  check_pages_arg(pages.size(), page_size);
  uint8_t *p = pages.data();
  const uint64_t n = pages.size() / page_size;
  nb::gil_scoped_release release;
  global_pool()->parallel_for(n, 64, [&](size_t b, size_t e) {
    for (size_t i = b; i < e; ++i) seal_page(p + i * page_size, page_size, static_cast<uint32_t>(first_index + i));
  });
}

// Indices (expected_index(i)) of the pages of a uint8 [P * page_size] buffer whose trailer does not match.
template <class Expected>
std::vector<int64_t> bad_pages(BytesIn pages, uint64_t page_size, Expected expected_index) {
  check_pages_arg(pages.size(), page_size);
  const uint8_t *p = pages.data();
  const uint64_t n = pages.size() / page_size;
  std::vector<uint8_t> bad(n, 0);
  {
    nb::gil_scoped_release release;
    global_pool()->parallel_for(n, 64, [&](size_t b, size_t e) {
      for (size_t i = b; i < e; ++i)
        bad[i] = !page_ok(p + i * page_size, page_size, static_cast<uint32_t>(expected_index(i)));
    });
  }
  std::vector<int64_t> out;
  for (uint64_t i = 0; i < n; ++i)
    if (bad[i]) out.push_back(static_cast<int64_t>(expected_index(i)));
  return out;
}

std::vector<int64_t> verify_pages(BytesIn pages, uint64_t page_size, uint64_t first_index) {
  return bad_pages(pages, page_size, [=](uint64_t i) { return first_index + i; });
}

// Pages gathered from anywhere in a table (a remote store's batch): page i must carry index indices[i].
std::vector<int64_t> verify_pages_at(BytesIn pages, uint64_t page_size, IdsIn indices) {
  check_pages_arg(pages.size(), page_size);
  require(indices.ndim() == 1 && indices.shape(0) == pages.size() / page_size,
          "indices must be int64 [" + std::to_string(pages.size() / page_size) + "], one per page");
  const int64_t *idx = indices.data();
  for (size_t i = 0; i < indices.shape(0); ++i)
    require(idx[i] >= 0, "page index " + std::to_string(idx[i]) + " at position " + std::to_string(i) + " is negative");
  return bad_pages(pages, page_size, [=](uint64_t i) { return static_cast<uint64_t>(idx[i]); });
}

}  // namespace

void register_gather(nb::module_ &m) {
  m.def(
      "crc32c", [](BytesIn data, uint32_t crc) { return crc32c(data.data(), data.size(), crc); }, nb::arg("data"),
      nb::arg("crc") = 0, "CRC-32C of a uint8 buffer, continuing `crc`.");
  m.def("codec_row_bytes", &codec_row_bytes, nb::arg("codec"), nb::arg("dim"),
        "Encoded bytes per row (0 if the codec/dim pair is invalid).");
  m.def("seal_pages", &seal_pages, nb::arg("pages"), nb::arg("page_size"), nb::arg("first_index"),
        "Write each page's trailer (index, CRC-32C) in place; pages is uint8 [P * page_size].");
  m.def("verify_pages", &verify_pages, nb::arg("pages"), nb::arg("page_size"), nb::arg("first_index"),
        "Indices of the pages whose trailer does not match.");
  m.def("verify_pages", &verify_pages_at, nb::arg("pages"), nb::arg("page_size"), nb::arg("indices"),
        "Indices of the pages whose trailer does not match, page i expected to carry indices[i] (int64 [P]).");
  m.def("gather", &gather, nb::arg("data"), nb::arg("ids"), nb::arg("head_offsets"), nb::arg("head_rows"),
        nb::arg("page_size"), nb::arg("rows_per_page"), nb::arg("codec"), nb::arg("dim"), nb::arg("out"),
        nb::arg("stream") = nb::none(),
        "Bounds-check ids int64 [N, H] per head, then decode each row into out [N, H, D] (f32/bf16) or copy raw "
        "rows into uint8 out [N, H, row_bytes]. stream=True: non-temporal stores for fp8 rows on AVX-512 cores, "
        "False: normal stores, None: non-temporal for decoded outputs of at least the last-level cache's size.");
  m.def("gather_limit", &gather_limit_py, nb::arg("data"), nb::arg("ids"), nb::arg("head_offsets"),
        nb::arg("head_rows"), nb::arg("page_size"), nb::arg("rows_per_page"), nb::arg("codec"), nb::arg("dim"),
        nb::arg("out"), nb::arg("stream"), nb::arg("ahead"),
        "The same-bytes limit of `gather`: bounds-check ids int64 [N, H], then per id read every byte of its row "
        "and write out uint8 [N, H, B] (B a multiple of 16) by repeating the row's bytes, no decode; stream: "
        "non-temporal stores; ahead: rows prefetched ahead per thread (0..64).");
  m.def("check_ids", &check_ids_py, nb::arg("ids"), nb::arg("head_rows"),
        "Bounds-check per-head ids int64 [N, H] against head_rows int64 [H]; IndexError names head and id.");
  m.def("decode_at", &decode_at_py, nb::arg("src"), nb::arg("offsets"), nb::arg("codec"), nb::arg("dim"),
        nb::arg("out"), "Decode rows found at byte offsets int64 [N] of src into out [N, D] (or raw bytes).");
  m.def("set_num_threads", [](unsigned n) { set_num_threads(n); }, nb::arg("n"),
        "Size of the native worker pool used by gathers.");
  m.def("num_threads", []() { return global_pool()->size(); }, "Threads in the native worker pool.");
  m.def(
      "name_thread",
      [](const std::string &name) {
        require(!name.empty() && name.size() <= 15,
                "a thread name has 1-15 characters, got " + std::to_string(name.size()));
        name_this_thread(name.c_str());
      },
      nb::arg("name"), "Name the calling thread as the OS shows it (top -H, perf, py-spy); 1-15 characters.");
}

}  // namespace tiergram
