// The tiergram._native extension: each binding file registers its functions here.
#include "bindings.h"
#include "gather.h"

NB_MODULE(_native, m) {
  m.doc() = "tiergram native core: batched page reads, parallel gather + dequant, checksums";
  nb::register_exception_translator([](const std::exception_ptr &p, void *) {
    try {
      std::rethrow_exception(p);
    } catch (const tiergram::RowIndexError &e) {
      PyErr_SetString(PyExc_IndexError, e.what());
    }
  });
  tiergram::register_gather(m);
  tiergram::register_file_reader(m);
  tiergram::register_row_cache(m);
  tiergram::register_pipeline(m);
  tiergram::register_callback_source(m);
}
