// Helpers shared by the nanobind binding files: array aliases and argument checks.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include "gather.h"

namespace nb = nanobind;

namespace tiergram {

using BytesIn = nb::ndarray<const uint8_t, nb::c_contig, nb::device::cpu>;
using BytesOut = nb::ndarray<uint8_t, nb::c_contig, nb::device::cpu>;
using IdsIn = nb::ndarray<const int64_t, nb::c_contig, nb::device::cpu>;
using AnyOut = nb::ndarray<nb::c_contig, nb::device::cpu>;

// The output kind of a float32 / bfloat16 (or uint16 bits) / uint8 (raw rows) array; invalid_argument otherwise.
OutKind out_kind(const AnyOut &out);
// Checks out holds n rows of dim values (raw: row_bytes bytes).
void check_out_size(const AnyOut &out, OutKind kind, uint64_t n, uint64_t dim, uint64_t row_bytes);

// Registration functions, one per binding file.
void register_gather(nb::module_ &m);
void register_file_reader(nb::module_ &m);
void register_row_cache(nb::module_ &m);
void register_pipeline(nb::module_ &m);
void register_callback_source(nb::module_ &m);

}  // namespace tiergram
