// Python bindings of the native row cache; the Python wrapper is tiergram.cache.native.NativeRowCache.
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <vector>

#include "bindings.h"
#include "row_cache.h"

namespace tiergram {

namespace {

using SlotsOut = nb::ndarray<int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using MaskOut = nb::ndarray<uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using RowsIn = nb::ndarray<const uint8_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;

template <typename T, size_t D>
nb::ndarray<nb::numpy, T> view(T *data, const size_t (&shape)[D], nb::handle owner) {
  return nb::ndarray<nb::numpy, T>(data, D, shape, owner);
}

}  // namespace

void register_row_cache(nb::module_ &m) {
  nb::class_<NativeRowCache>(m, "RowCache",
                             "Native row cache over a slot array [capacity, row_bytes]: key -> slot index, pins, "
                             "counters, policy 'lru', 'lfu' or 'lookahead'; the same decisions as "
                             "tiergram.cache.RowCache with that policy.")
      .def(
          "__init__",
          [](NativeRowCache *self, uint64_t capacity, uint64_t row_bytes, const std::string &policy) {
            new (self) NativeRowCache(capacity, row_bytes, policy_from_name(policy));
          },
          nb::arg("capacity"), nb::arg("row_bytes"), nb::arg("policy") = "lru")
      .def_prop_ro("policy", [](NativeRowCache &c) { return std::string(policy_name(c.policy())); })
      .def_prop_ro("capacity", &NativeRowCache::capacity)
      .def_prop_ro("row_bytes", &NativeRowCache::row_bytes)
      .def("__len__", &NativeRowCache::size)
      .def(
          "probe",
          [](NativeRowCache &c, IdsIn keys, SlotsOut slots, int64_t batch) {
            require(slots.size() == keys.size(), "slots must be int64 [n] like keys");
            nb::gil_scoped_release release;
            c.probe(keys.data(), keys.size(), slots.data(), batch);
          },
          nb::arg("keys").noconvert(), nb::arg("slots").noconvert(), nb::arg("batch") = -1,
          "slots[i] = slot of keys[i] or -1 (int64 [n]); hits are touched and pinned; batch >= 0 (announce's id) "
          "is retired.")
      .def(
          "touch",
          [](NativeRowCache &c, IdsIn keys) {
            nb::gil_scoped_release release;
            return c.touch(keys.data(), keys.size());
          },
          nb::arg("keys").noconvert(),
          "Mark the resident keys int64 [n] used, in order, as a probe's hits (no pins, not counted); returns how "
          "many were resident.")
      .def(
          "announce",
          [](NativeRowCache &c, IdsIn keys) {
            nb::gil_scoped_release release;
            return c.announce(keys.data(), keys.size());
          },
          nb::arg("keys").noconvert(),
          "Lookahead: the keys int64 [n] a later probe will ask for; returns the batch id (-1: other policies).")
      .def("retire", &NativeRowCache::retire, nb::arg("batch"),
           "Forget an announced batch that will not be probed (batch < 0 ignored).")
      .def("live_batches", &NativeRowCache::live_batches, "Announced batches not yet probed or retired.")
      .def("lookahead_state",
           [](NativeRowCache &c) {
             std::vector<int64_t> idle, held, planned, next_use;
             c.lookahead_state(idle, held, planned, next_use);
             return std::make_tuple(idle, held, planned, next_use);
           },
           "(idle keys LRU first, parked keys, planned keys, their next uses): for tests.")
      .def(
          "frequencies",
          [](NativeRowCache &c, IdsIn keys) { return c.frequencies(keys.data(), keys.size()); },
          nb::arg("keys").noconvert(), "LFU: the count of each key of int64 [n].")
      .def(
          "missing",
          [](NativeRowCache &c, IdsIn keys, MaskOut out) {
            require(out.size() == keys.size(), "out must be uint8 [n] like keys");
            nb::gil_scoped_release release;
            c.missing(keys.data(), keys.size(), out.data());
          },
          nb::arg("keys").noconvert(), nb::arg("out").noconvert(), "out[i] = 1 where keys[i] is not resident.")
      .def(
          "admit",
          [](NativeRowCache &c, IdsIn keys, RowsIn rows) {
            require(rows.shape(0) == keys.size() && rows.shape(1) == c.row_bytes(),
                    "rows must be uint8 [" + std::to_string(keys.size()) + ", " + std::to_string(c.row_bytes()) +
                        "]");
            nb::gil_scoped_release release;
            std::vector<const uint8_t *> src(keys.size());
            for (size_t i = 0; i < src.size(); ++i) src[i] = rows.data() + i * c.row_bytes();
            return c.admit(keys.data(), keys.size(), src.data());
          },
          nb::arg("keys").noconvert(), nb::arg("rows").noconvert(),
          "Offer keys int64 [n] with encoded rows uint8 [n, row_bytes]; returns how many entered.")
      .def(
          "unpin",
          [](NativeRowCache &c, IdsIn slots) {
            nb::gil_scoped_release release;
            c.unpin(slots.data(), slots.size());
          },
          nb::arg("slots").noconvert(), "Release the pins a probe took (slots < 0 ignored).")
      .def("counters",
           [](NativeRowCache &c) {
             const auto k = c.counters();
             return std::vector<uint64_t>{k.probes, k.hits, k.admitted, k.rejected, k.evicted};
           },
           "[probes, hits, admitted, rejected, evicted].")
      .def("order",
           [](NativeRowCache &c) {
             std::vector<int64_t> keys, slots;
             c.order(keys, slots);
             return std::make_pair(keys, slots);
           },
           "(resident keys in the policy's order, their slots): see row_cache.h.")
      .def("check_invariants", &NativeRowCache::check_invariants)
      .def("hold_next_fetch", &NativeRowCache::hold_next_fetch,
           "Test hook: the next fetch through this cache waits after its probe (hits pinned), or the next read-ahead once "
           "its keys are marked in flight, until release_held().")
      .def(
          "wait_held",
          [](NativeRowCache &c, double timeout_s) {
            nb::gil_scoped_release release;
            return c.wait_held(timeout_s);
          },
          nb::arg("timeout_s"), "True once a fetch is held (False after timeout_s).")
      .def("release_held", &NativeRowCache::release_held, "Let the held fetch go on (or disarm the hook).")
      .def_prop_ro(
          "rows",
          [](nb::handle self) {
            auto &c = nb::cast<NativeRowCache &>(self);
            const size_t shape[2] = {static_cast<size_t>(c.capacity()), static_cast<size_t>(c.row_bytes())};
            return view(c.rows(), shape, self);
          },
          "The slot array uint8 [capacity, row_bytes] (a view).")
      .def_prop_ro(
          "pins",
          [](nb::handle self) {
            auto &c = nb::cast<NativeRowCache &>(self);
            const size_t shape[1] = {static_cast<size_t>(c.capacity())};
            return view(c.pins(), shape, self);
          },
          "Pins per slot int32 [capacity] (a view).")
      .def_prop_ro(
          "slot_key",
          [](nb::handle self) {
            auto &c = nb::cast<NativeRowCache &>(self);
            const size_t shape[1] = {static_cast<size_t>(c.capacity())};
            return view(c.slot_keys(), shape, self);
          },
          "Key of each slot int64 [capacity] (-1: never used) (a view).");
}

}  // namespace tiergram
