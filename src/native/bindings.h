// Helpers shared by the nanobind binding files: array aliases and argument checks.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <stdexcept>
#include <string>

namespace nb = nanobind;

namespace tiergram {

using BytesIn = nb::ndarray<const uint8_t, nb::c_contig, nb::device::cpu>;
using BytesOut = nb::ndarray<uint8_t, nb::c_contig, nb::device::cpu>;
using IdsIn = nb::ndarray<const int64_t, nb::c_contig, nb::device::cpu>;
using AnyOut = nb::ndarray<nb::c_contig, nb::device::cpu>;

inline void require(bool ok, const std::string &what) {
  if (!ok) throw std::invalid_argument(what);
}

// Registration functions, one per binding file.
void register_gather(nb::module_ &m);
void register_file_reader(nb::module_ &m);

}  // namespace tiergram
